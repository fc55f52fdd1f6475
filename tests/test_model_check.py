"""The start-up check: a model config paired with a checkpoint of another model fails before anything is
built, naming both and the `model=` that fits; `model.check=false` lets it through."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel
from helpers import count_constructions
from stage_edges import predictor_for
from transformers import Qwen2_5_VLForConditionalGeneration

from qie.checks import compose
from qie.components import check, fingerprint, prepare_model
from qie.config import typed
from qie.errors import ConfigError
from qie.models import model_spec
from qie.stages import train as train_stage


@pytest.fixture
def constructions(monkeypatch: pytest.MonkeyPatch) -> Counter:
    """Counts constructions of the classes that hold weights."""
    return count_constructions(
        monkeypatch, (Qwen2_5_VLForConditionalGeneration, AutoencoderKLQwenImage, QwenImageTransformer2DModel)
    )


def _infer(model: str, path: Path, *more: str):
    return compose("infer", [f"model={model}", "model.tiny=null", f"model.pretrained_model_name_or_path={path}", *more])


def _edit_folder(root: Path) -> Path:
    from PIL import Image

    for sub in ("training_images", "control_images"):
        (root / sub).mkdir(parents=True)
        Image.new("RGB", (64, 64), (200, 30, 30)).save(root / sub / "a.png")
    (root / "training_images" / "a.txt").write_text("make it red", encoding="utf-8")
    return root


def test_edit_config_with_a_text_to_image_checkpoint(tiny_t2i_path: Path, tmp_path: Path, constructions) -> None:
    with pytest.raises(ConfigError) as err:
        predictor_for(_infer("tiny", tiny_t2i_path))
    message = str(err.value)
    assert "model=tiny does not match the checkpoint" in message and str(tiny_t2i_path) in message
    assert "QwenImagePipeline" in message and "QwenImageEditPipeline" in message
    assert "use model=qwen_image or model=qwen_image_2512 or model=tiny_t2i" in message
    assert "model.check=false" in message
    assert constructions == Counter()  # failed before any part was built
    # A real-model config gets the real models' names; the train stage stops as early.
    with pytest.raises(ConfigError, match="model=qwen_image_edit_plus does not match"):
        prepare_model(typed(_infer("qwen_image_edit_plus", tiny_t2i_path).model))
    model = ["model=tiny", "model.tiny=null", f"model.pretrained_model_name_or_path={tiny_t2i_path}"]
    cfg = compose("train", [*model, f"data.path={_edit_folder(tmp_path / 'data')}", f"cache.dir={tmp_path / 'c'}"])
    with pytest.raises(ConfigError, match="QwenImagePipeline"):
        train_stage.run(cfg, tmp_path / "run")
    assert constructions == Counter()


def test_2509_config_with_a_2511_checkpoint(tiny_2511_path: Path, constructions) -> None:
    with pytest.raises(ConfigError) as err:
        predictor_for(_infer("tiny_plus", tiny_2511_path))
    message = str(err.value)
    assert "zero_cond_t=True" in message and "expects False" in message
    assert "use model=qwen_image_edit_2511 or model=tiny_edit_2511 " in message
    assert constructions == Counter()
    # The override lets it through: the parts are built.
    predictor = predictor_for(_infer("tiny_plus", tiny_2511_path, "model.check=false"))
    assert predictor.parts.transformer.config.zero_cond_t is True
    assert constructions["QwenImageTransformer2DModel"] == 1


def test_the_reverse_pairing_and_a_fitting_pair(tiny_plus_path: Path, tiny_2511_path: Path) -> None:
    with pytest.raises(
        ConfigError, match="(?s)zero_cond_t=False.*expects True.*use model=qwen_image_edit_plus or model=tiny_plus"
    ):
        prepare_model(typed(_infer("tiny_edit_2511", tiny_plus_path).model))
    assert prepare_model(typed(_infer("qwen_image_edit_2511", tiny_2511_path).model)).name == "qwen_image_edit_2511"


def test_a_hub_id_is_checked_from_its_json_files_alone(monkeypatch: pytest.MonkeyPatch, tiny_t2i_path: Path) -> None:
    import huggingface_hub

    asked: list[list[str]] = []

    def snapshot_download(repo_id, revision=None, allow_patterns=None, **kw):
        assert repo_id == "Qwen/Qwen-Image-Edit-2511"
        asked.append(list(allow_patterns))
        return str(tiny_t2i_path)  # the "hub" holds a text-to-image model

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    check._hub_text.cache_clear()  # hub files are read once per process
    with pytest.raises(ConfigError, match="Qwen/Qwen-Image-Edit-2511.*QwenImagePipeline"):
        prepare_model(typed(compose("infer", ["model=qwen_image_edit_2511"]).model))
    assert asked and all(p.endswith(".json") for patterns in asked for p in patterns)
    check._hub_text.cache_clear()


def test_an_unreachable_hub_is_not_reported_as_a_mismatch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Offline, a hub id's JSON files cannot be read: the check knows nothing and says nothing (loading the part
    names the unreachable hub), rather than reporting the absent transformer config as zero_cond_t=False."""
    import huggingface_hub

    def snapshot_download(repo_id, revision=None, allow_patterns=None, **kw):
        raise OSError(f"cannot reach the hub for {repo_id}")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    check._hub_text.cache_clear()
    fingerprint._hub_snapshot.cache_clear()  # an earlier test's "hub" snapshot
    model = typed(compose("infer", ["model=qwen_image_edit_2511"]).model)
    found = check.read_facts("Qwen/Qwen-Image-Edit-2511")
    assert found.pipeline_class is None and found.zero_cond_t is None
    assert model_spec(model).mismatches(found) == []
    check.check_checkpoint(model_spec(model), model, "Qwen/Qwen-Image-Edit-2511")  # raises nothing
    check._hub_text.cache_clear()
    fingerprint._hub_snapshot.cache_clear()


def test_model_descriptions_come_from_the_yaml() -> None:
    names = ("qwen_image_edit", "qwen_image_edit_plus", "qwen_image_edit_2511", "qwen_image", "qwen_image_2512")
    specs = {name: model_spec(typed(compose("infer", [f"model={name}"]).model)) for name in names}
    assert specs["qwen_image_edit_2511"].pipeline_class == "QwenImageEditPlusPipeline"
    assert specs["qwen_image_edit_2511"].zero_cond_t and not specs["qwen_image_edit_plus"].zero_cond_t
    assert specs["qwen_image"].pipeline_class == specs["qwen_image_2512"].pipeline_class == "QwenImagePipeline"
    assert "processor" not in specs["qwen_image"].part_names
    assert specs["qwen_image"].encoder_parts == ("vae", "text_encoder", "tokenizer")
    assert specs["qwen_image_edit_2511"].encoder_parts == ("vae", "text_encoder", "processor")
    templates = {name: spec.family.prompt_template(spec) for name, spec in specs.items()}
    assert templates["qwen_image"].endswith("|34|512")
    assert templates["qwen_image_edit_2511"] == templates["qwen_image_edit_plus"]
    assert [(s.min_control_images, s.max_control_images) for s in specs.values()] == [
        (1, 1),
        (0, 3),
        (0, 3),
        (0, 0),
        (0, 0),
    ]
    # Output sizes: Edit follows the first control image, Edit-Plus the last, text to image the request or
    # the target, else the pipeline's default (128 latent pixels a side).
    sizes = [(32, 96), (64, 64)]
    assert specs["qwen_image_edit"].output_size(None, None, sizes, None, 8) == (32, 96)
    assert specs["qwen_image_edit_plus"].output_size(None, None, sizes, None, 8) == (64, 64)
    assert specs["qwen_image"].output_size(None, 48, [], (80, 64), 8) == (80, 48)
    assert specs["qwen_image"].output_size(None, None, [], None, 8) == (1024, 1024)


def test_validation_inputs_follow_the_models_control_counts() -> None:
    from qie.stages.validation import validation_samples

    t2i = compose("train", ["model=tiny_t2i", "validation.prompts=[a cat,a dog]"])
    chosen = validation_samples(t2i.validation, [], 2)
    assert [(s.id, s.controls, s.prompt) for s in chosen] == [
        ("validation_0", (), "a cat"),
        ("validation_1", (), "a dog"),
    ]
    # Refused when the config is composed (`qie.checks.validate`).
    with pytest.raises(ConfigError, match=r"validation.prompts\[0\].*needs at least 1"):
        compose("train", ["model=tiny", "validation.prompts=[a cat]"])
    with pytest.raises(ConfigError, match="takes none"):
        compose("train", ["model=tiny_t2i", "validation.prompts=[a]", "validation.images=[x.png]"])


def test_channel_counts_are_checked() -> None:
    from qie.models import CheckpointFacts

    spec = model_spec(typed(compose("infer", ["model=qwen_image_edit_2511"]).model))
    real = CheckpointFacts("QwenImageEditPlusPipeline", True, patch_size=2, in_channels=64, out_channels=16,
                           latent_channels=16)  # fmt: skip
    assert spec.mismatches(real) == []
    # Patch-1 transformers on 64-channel latents (as Qwen-Image-2.1 is built) are not this family.
    (problem,) = spec.mismatches(CheckpointFacts("QwenImageEditPlusPipeline", True, 1, 64, 64, 64))
    assert "patch 1, in/out channels 64/64" in problem and "expects 2x2 patches" in problem
    # A transformer that takes channels beside the packed latents (in != 4 x out) does not fit either.
    assert spec.mismatches(CheckpointFacts("QwenImageEditPlusPipeline", True, 2, 68, 16, 16))
    assert spec.mismatches(CheckpointFacts("QwenImageEditPlusPipeline", True, 2, 64, 16, 8))  # VAE of 8 channels
