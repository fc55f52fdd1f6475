"""The tiny random Qwen-Image-Edit checkpoints load into the real diffusers pipelines and run."""

from __future__ import annotations

import json
import shutil
from importlib import resources
from pathlib import Path

import pytest
import torch
from diffusers import QwenImageEditPipeline, QwenImageEditPlusPipeline
from helpers import tiny_pipeline
from PIL import Image
from safetensors.torch import load_file
from transformers import Qwen2Tokenizer

from qie.components.tiny import build_tiny_model, default_tiny_path, ensure_tiny_model, system_prefix
from qie.components.tiny_presets import (
    DEMO_LAYERED_VAE_CONFIG,
    DEMO_LAYERED_VAE_FILE,
    DEMO_VAE_CONFIG,
    DEMO_VAE_FILE,
    DEMO_Z_DIM,
    read_vae_weights,
)
from qie.errors import ModelLoadError
from qie.models import qwen_image
from qie.models.processor import QwenImageProcessorNoVideo, load_processor

WEIGHT_FILES = (
    "transformer/diffusion_pytorch_model.safetensors",
    "vae/diffusion_pytorch_model.safetensors",
    "text_encoder/model.safetensors",
)


@pytest.fixture(scope="session")
def tiny_edit(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "edit", variant="edit", seed=0)


@pytest.fixture(scope="session")
def tiny_edit_plus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "edit_plus", variant="edit_plus", seed=0)


def _image(color: tuple[int, int, int]) -> Image.Image:
    return Image.new("RGB", (64, 64), color)


def _run(pipe, image) -> torch.Tensor:
    pipe.set_progress_bar_config(disable=True)
    out = pipe(
        image=image,
        prompt="Make the sky blue.",
        height=64,
        width=64,
        num_inference_steps=2,
        true_cfg_scale=1.0,
        generator=torch.Generator().manual_seed(0),
        output_type="pt",
    )
    return out.images


@pytest.mark.usefixtures("small_conditions")
def test_edit_pipeline_runs(tiny_edit: Path, tmp_path: Path) -> None:
    pipe = tiny_pipeline(QwenImageEditPipeline, tiny_edit)
    assert isinstance(pipe.processor, QwenImageProcessorNoVideo)
    assert pipe.vae.config.latents_mean == qwen_image.TINY_VAE["latents_mean"]
    images = _run(pipe, _image((200, 40, 90)))
    assert images.shape == (1, 3, 64, 64)
    assert torch.isfinite(images).all()
    # A pipeline saved by diffusers (transformers 5 writes processor_config.json) loads back too.
    pipe.save_pretrained(tmp_path / "resaved")
    assert isinstance(load_processor(tmp_path / "resaved"), QwenImageProcessorNoVideo)


@pytest.mark.usefixtures("small_conditions")
def test_edit_plus_pipeline_runs_with_two_images(tiny_edit_plus: Path) -> None:
    index = json.loads((tiny_edit_plus / "model_index.json").read_text())
    assert index["_class_name"] == "QwenImageEditPlusPipeline"
    pipe = tiny_pipeline(QwenImageEditPlusPipeline, tiny_edit_plus)
    images = _run(pipe, [_image((200, 40, 90)), _image((10, 180, 60))])
    assert images.shape == (1, 3, 64, 64)
    assert torch.isfinite(images).all()


@pytest.mark.parametrize("pipeline_cls", [QwenImageEditPipeline, QwenImageEditPlusPipeline])
def test_system_prefix_is_exactly_the_drop_index(tiny_edit: Path, pipeline_cls: type) -> None:
    tokenizer = Qwen2Tokenizer.from_pretrained(tiny_edit / "tokenizer")
    prefix, drop_idx = system_prefix(pipeline_cls)
    assert drop_idx == 64 and prefix.endswith("<|im_start|>user\n")
    template = pipeline_cls(None, None, None, None, None, None).prompt_template_encode
    prefix_ids = tokenizer(prefix)["input_ids"]
    assert len(prefix_ids) == drop_idx
    # The prefix tokenises the same inside the full prompt, so dropping it leaves the user turn.
    full_ids = tokenizer(template.format("Make the sky blue."))["input_ids"]
    assert full_ids[:drop_idx] == prefix_ids
    assert tokenizer.convert_ids_to_tokens(full_ids[drop_idx - 3 : drop_idx]) == ["<|im_start|>", "user", "Ċ"]


def test_config_token_ids_match_tokenizer(tiny_edit: Path) -> None:
    tokenizer = Qwen2Tokenizer.from_pretrained(tiny_edit / "tokenizer")
    config = json.loads((tiny_edit / "text_encoder" / "config.json").read_text())
    assert config["image_token_id"] == tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert config["video_token_id"] == tokenizer.convert_tokens_to_ids("<|video_pad|>")
    assert config["vision_start_token_id"] == tokenizer.convert_tokens_to_ids("<|vision_start|>")
    assert config["vision_end_token_id"] == tokenizer.convert_tokens_to_ids("<|vision_end|>")
    assert config["text_config"]["vocab_size"] == len(tokenizer)


def test_same_seed_builds_bitwise_equal_weights(tiny_edit: Path, tmp_path: Path) -> None:
    again = build_tiny_model(tmp_path / "again", variant="edit", seed=0)
    other = build_tiny_model(tmp_path / "other", variant="edit", seed=1)
    for name in WEIGHT_FILES:
        first, second, third = (load_file(root / name) for root in (tiny_edit, again, other))
        assert first.keys() == second.keys()
        assert all(torch.equal(first[k], second[k]) for k in first), name
        assert not all(torch.equal(first[k], third[k]) for k in first), name
    for name in ("tokenizer/tokenizer.json", "processor/tokenizer.json"):
        assert (tiny_edit / name).read_bytes() == (again / name).read_bytes()


def test_ensure_builds_when_missing_then_reuses(tmp_path: Path) -> None:
    target = tmp_path / "cache" / "edit-v1"
    stale = tmp_path / "cache" / ".edit-v1.tmp-killed"  # what a killed build leaves behind
    (stale / "vae").mkdir(parents=True)
    assert ensure_tiny_model(target) == target
    assert (target / "model_index.json").is_file()
    assert not [p for p in target.parent.iterdir() if p.name.startswith(f".{target.name}.tmp-")]
    stamp = (target / "model_index.json").stat().st_mtime_ns
    weights = (target / WEIGHT_FILES[0]).stat().st_mtime_ns
    assert ensure_tiny_model(target) == target
    assert (target / "model_index.json").stat().st_mtime_ns == stamp
    assert (target / WEIGHT_FILES[0]).stat().st_mtime_ns == weights
    with pytest.raises(ModelLoadError, match="QwenImageEditPipeline"):
        ensure_tiny_model(target, variant="edit_plus")


def test_default_tiny_path(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("QIE_HOME", str(tmp_path))
    assert default_tiny_path("edit_plus") == tmp_path / "tiny" / "edit_plus-v1"
    monkeypatch.delenv("QIE_HOME")
    assert default_tiny_path() == Path.home() / ".cache" / "qie" / "tiny" / "edit-v1"


def test_load_processor_without_video_config(tiny_edit: Path, tmp_path: Path) -> None:
    copy = tmp_path / "model"
    shutil.copytree(tiny_edit / "processor", copy / "processor")
    (copy / "processor" / "video_preprocessor_config.json").unlink(missing_ok=True)
    processor = load_processor(copy)
    inputs = processor(
        text=["<|vision_start|><|image_pad|><|vision_end|>Make the sky blue."],
        images=[_image((1, 2, 3))],
        padding=True,
        return_tensors="pt",
    )
    # 64 px -> 56x56 -> 4x4 patches of 14 px -> 2x2 merged -> 4 image tokens.
    assert inputs["image_grid_thw"].tolist() == [[1, 4, 4]]
    assert (inputs["input_ids"] == processor.image_token_id).sum() == 4


def test_load_processor_names_what_is_missing(tiny_edit: Path, tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"missing the folder itself"):
        load_processor(tmp_path)
    copy = tmp_path / "processor"
    shutil.copytree(tiny_edit / "processor", copy)
    (copy / "preprocessor_config.json").unlink()
    with pytest.raises(ModelLoadError, match=r"preprocessor_config\.json") as err:
        load_processor(tmp_path)
    assert str(tmp_path) in str(err.value)


def test_python_m_qie_tiny_writes_any_preset(tiny_t2i_path: Path, tmp_path: Path, capsys) -> None:
    from qie import tiny

    tiny.main(["t2i", str(tmp_path / "t2i")])
    assert str(tmp_path / "t2i") in capsys.readouterr().out
    assert json.loads((tmp_path / "t2i" / "model_index.json").read_text())["_class_name"] == "QwenImagePipeline"
    for name in WEIGHT_FILES:  # the same seed as the shared tiny model: the same weights
        first, second = load_file(tiny_t2i_path / name), load_file(tmp_path / "t2i" / name)
        assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first), name
    with pytest.raises(SystemExit) as stop:
        tiny.main(["edit_2512", str(tmp_path / "nope")])
    assert stop.value.code == 2 and not (tmp_path / "nope").exists()


def test_ensure_refuses_a_folder_of_another_preset(tiny_plus_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="zero_cond_t"):
        ensure_tiny_model(tiny_plus_path, variant="edit_2511")


def test_demo_preset_ships_a_trained_vae_and_a_matching_transformer(tiny_demo_path: Path) -> None:
    tensors, meta = read_vae_weights(DEMO_VAE_FILE)
    shipped = resources.files("qie.components") / DEMO_VAE_FILE
    assert shipped.is_file() and shipped.stat().st_size < 2 * 2**20
    assert json.loads(meta["config"]) == DEMO_VAE_CONFIG
    vae_config = json.loads((tiny_demo_path / "vae" / "config.json").read_text())
    assert vae_config["latents_mean"] == json.loads(meta["latents_mean"])
    assert vae_config["latents_std"] == json.loads(meta["latents_std"])
    assert vae_config["latents_mean"] != [0.0] * DEMO_Z_DIM  # the trained encoder's statistics, not defaults
    built = load_file(tiny_demo_path / "vae" / "diffusion_pytorch_model.safetensors")
    assert built.keys() == tensors.keys()
    assert all(torch.equal(built[k], tensors[k].float()) for k in built)
    transformer = json.loads((tiny_demo_path / "transformer" / "config.json").read_text())
    assert (transformer["in_channels"], transformer["out_channels"]) == (4 * DEMO_Z_DIM, DEMO_Z_DIM)
    assert sum(transformer["axes_dims_rope"]) == transformer["attention_head_dim"]
    # The text side is the tiny model's own.
    default = default_tiny_path("edit")
    ensure_tiny_model(default)
    for name in ("text_encoder/model.safetensors", "tokenizer/tokenizer.json"):
        assert (tiny_demo_path / name).read_bytes() == (default / name).read_bytes()


def test_demo_layered_preset_ships_a_trained_rgba_vae(tiny_demo_layered_path: Path, tiny_layered_path: Path) -> None:
    """The Layered demo's model is the tiny Layered model with the shipped RGBA VAE: its own statistics, the
    shipped weights, and every other part byte for byte the tiny model's (whose pinned losses do not move)."""
    tensors, meta = read_vae_weights(DEMO_LAYERED_VAE_FILE)
    shipped = resources.files("qie.components") / DEMO_LAYERED_VAE_FILE
    assert shipped.is_file() and shipped.stat().st_size < 2**20
    assert json.loads(meta["config"]) == DEMO_LAYERED_VAE_CONFIG and DEMO_LAYERED_VAE_CONFIG["input_channels"] == 4
    vae_config = json.loads((tiny_demo_layered_path / "vae" / "config.json").read_text())
    assert vae_config["latents_mean"] == json.loads(meta["latents_mean"]) != [0.0] * DEMO_Z_DIM
    assert vae_config["latents_std"] == json.loads(meta["latents_std"])
    built = load_file(tiny_demo_layered_path / "vae" / "diffusion_pytorch_model.safetensors")
    assert built.keys() == tensors.keys() and all(torch.equal(built[k], tensors[k].float()) for k in built)
    for name in ("transformer/diffusion_pytorch_model.safetensors", "text_encoder/model.safetensors",
                 "tokenizer/tokenizer.json", "model_index.json"):  # fmt: skip
        assert (tiny_demo_layered_path / name).read_bytes() == (tiny_layered_path / name).read_bytes()
    random_vae = load_file(tiny_layered_path / "vae" / "diffusion_pytorch_model.safetensors")
    assert random_vae.keys() == built.keys()  # the tiny model's own VAE has its shape, at its random initialisation
    assert all(not torch.equal(random_vae[k], built[k]) for k in built if k.endswith("conv.weight"))


def test_the_shipped_rgba_vae_reconstructs_the_demos_layers() -> None:
    """Frames of a demo sample as precompute sizes them for the Layered model (640²): the shipped VAE gives them back
    at 14.8 dB PSNR, a VAE of its config at its random initialisation at 6.9 dB. One sample's image and its top
    layer, a 320² window about the middle of each, where the shapes are (the whole frame costs 4x; whole frames,
    mostly flat, come back at ~20 dB: the file's `heldout_psnr_db`)."""
    import random

    from diffusers import AutoencoderKLQwenImage

    from qie.components.tiny_presets import load_shipped_vae
    from qie.data.images import prepare_target
    from qie.demo.synthetic import random_layers

    image, layers, _ = random_layers(random.Random(3), 64)
    frames = torch.stack([prepare_target(f, 640 * 640)[:, 160:480, 160:480] for f in (image, layers[-1])])
    x = frames.unsqueeze(2)

    def psnr(vae: AutoencoderKLQwenImage) -> float:
        with torch.no_grad():
            out = vae.decode(vae.encode(x).latent_dist.mode()).sample
        return float(10 * torch.log10(4 / (out - x).pow(2).mean()))

    torch.manual_seed(0)
    random_vae = AutoencoderKLQwenImage(**DEMO_LAYERED_VAE_CONFIG).eval()
    assert psnr(load_shipped_vae(DEMO_LAYERED_VAE_CONFIG, DEMO_LAYERED_VAE_FILE)) >= 14.5 > 10 > psnr(random_vae)


def test_unknown_preset_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown tiny model variant 'huge'"):
        ensure_tiny_model(tmp_path / "m", "huge")
    assert default_tiny_path("demo").name == "demo-v1"
