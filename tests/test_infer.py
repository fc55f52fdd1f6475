"""The infer stage and its Predictor equal the diffusers pipelines, with and without LoRA; errors are clear."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import QwenImageEditPipeline, QwenImageEditPlusPipeline, QwenImageTransformer2DModel
from helpers import small_config, tiny_pipeline, write_noise_image
from PIL import Image
from safetensors.torch import load_file, save_file
from stage_edges import predictor_for

from qie.adapters.lora import LORA_FILE, load_lora, merge_lora
from qie.config import typed
from qie.errors import ConfigError, DataError, ModelLoadError
from qie.stages import infer
from qie.stages.infer import Predictor

SIZE = 64
AREA = SIZE * SIZE
PROMPT = "Make the sky blue."
FAST = ["predict.true_cfg_scale=1.0"]  # and two denoising steps, as the shrunk config has


def _cfg(*overrides: str, model: str = "tiny"):
    return small_config("infer", f"model={model}", *FAST, *overrides)


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("images")
    return {"square": write_noise_image(root / "square.png", 1, (SIZE, SIZE)),
            "wide": write_noise_image(root / "wide.png", 2, (2 * SIZE, SIZE))}  # fmt: skip


@pytest.fixture(scope="module")
def predictor(tiny_path: Path) -> Predictor:
    return predictor_for(_cfg())


def _pipeline(cls: type, path: Path):
    return tiny_pipeline(cls, path)


def _reference(pipe, image, prompt=PROMPT, seed=0, steps=2, **kw) -> np.ndarray:
    generator = torch.Generator().manual_seed(seed)
    return pipe(image=image, prompt=prompt, num_inference_steps=steps, generator=generator,
                output_type="np", **kw).images  # fmt: skip


def _save_random_lora(transformer: QwenImageTransformer2DModel, folder: Path, rank: int = 4) -> Path:
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    config = LoraConfig(r=rank, lora_alpha=2 * rank, init_lora_weights=False,
                        target_modules=["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_v_proj"])  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(123)
        transformer.add_adapter(config)
    state = {k: v.detach().clone() for k, v in get_peft_model_state_dict(transformer).items()}
    metadata = {"r": rank, "lora_alpha": 2 * rank, "target_modules": sorted(config.target_modules)}
    QwenImageEditPipeline.save_lora_weights(folder, transformer_lora_layers=state,
                                            transformer_lora_adapter_metadata=metadata)  # fmt: skip
    return folder / LORA_FILE


@pytest.fixture(scope="module")
def lora(tiny_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    transformer = QwenImageTransformer2DModel.from_pretrained(tiny_path, subfolder="transformer")
    return _save_random_lora(transformer, tmp_path_factory.mktemp("lora"))


# --- parity with diffusers ---------------------------------------------------------------------------


@pytest.mark.usefixtures("small_conditions")
def test_edit_matches_pipeline(predictor: Predictor, tiny_path: Path, images: dict[str, Path]) -> None:
    wide = Image.open(images["wide"])
    mine = predictor.predict([wide], PROMPT, num_inference_steps=2, true_cfg_scale=1.0, seed=5, output_type="np")
    ref = _reference(_pipeline(QwenImageEditPipeline, tiny_path), wide, seed=5, true_cfg_scale=1.0)
    assert mine.shape == ref.shape == (1, 32, 96, 3)  # the wide image's aspect at 64x64 px
    assert np.abs(mine - ref).max() <= 1e-5


@pytest.mark.usefixtures("small_conditions")
def test_edit_with_cfg_and_two_images_per_prompt_matches_pipeline(
    predictor: Predictor, tiny_path: Path, images: dict[str, Path]
) -> None:
    square = Image.open(images["square"])
    mine = predictor.predict(square, PROMPT, negative_prompt=" ", num_inference_steps=2, true_cfg_scale=4.0, seed=1,
                             num_images=2, output_type="np")  # fmt: skip
    ref = _reference(_pipeline(QwenImageEditPipeline, tiny_path), square, seed=1, negative_prompt=" ",
                     true_cfg_scale=4.0, num_images_per_prompt=2)  # fmt: skip
    assert mine.shape == ref.shape == (2, SIZE, SIZE, 3)
    assert np.abs(mine - ref).max() <= 1e-5
    no_cfg = predictor.predict(square, PROMPT, num_inference_steps=2, true_cfg_scale=1.0, seed=1, output_type="np")
    assert np.abs(no_cfg[0] - mine[0]).max() > 1e-3


@pytest.mark.usefixtures("small_conditions")
def test_edit_with_lora_matches_pipeline(tiny_path: Path, lora: Path, images: dict[str, Path]) -> None:
    square = Image.open(images["square"])
    with_lora = predictor_for(_cfg(f"predict.lora={lora.parent}", "predict.lora_scale=0.7"))
    mine = with_lora.predict(square, PROMPT, num_inference_steps=2, true_cfg_scale=1.0, seed=2, output_type="np")
    pipe = _pipeline(QwenImageEditPipeline, tiny_path)
    base = _reference(pipe, square, seed=2, true_cfg_scale=1.0)
    pipe.load_lora_weights(lora, adapter_name="test")
    pipe.set_adapters(["test"], [0.7])
    ref = _reference(pipe, square, seed=2, true_cfg_scale=1.0)
    assert np.abs(mine - ref).max() <= 1e-5
    assert np.abs(mine - base).max() > 1e-3  # the LoRA does change the result
    with_lora.load_lora(lora, 0.7)  # loading again replaces the adapter rather than stacking a second
    assert np.array_equal(
        with_lora.predict(square, PROMPT, num_inference_steps=2, true_cfg_scale=1.0, seed=2, output_type="np"), mine
    )


@pytest.mark.usefixtures("small_conditions")
def test_edit_plus_two_images_matches_pipeline(tiny_plus_path: Path, images: dict[str, Path]) -> None:
    plus = predictor_for(_cfg(model="tiny_plus"))
    pair = [Image.open(images["square"]), Image.open(images["wide"])]
    mine = plus.predict(pair, "Put the object from picture 2 on the table in picture 1.", negative_prompt="",
                        num_inference_steps=2, true_cfg_scale=2.5, seed=4, output_type="np")  # fmt: skip
    ref = _reference(
        _pipeline(QwenImageEditPlusPipeline, tiny_plus_path),
        pair,
        seed=4,
        negative_prompt="",
        prompt="Put the object from picture 2 on the table in picture 1.",
        true_cfg_scale=2.5,
    )
    assert mine.shape == ref.shape == (1, 32, 96, 3)  # output follows the last image
    assert np.abs(mine - ref).max() <= 1e-5


def test_merged_lora_equals_unmerged(lora: Path, images: dict[str, Path], tmp_path: Path) -> None:
    merged_predictor = predictor_for(_cfg(f"predict.lora={lora}"))
    kw = dict(num_inference_steps=2, true_cfg_scale=1.0, seed=3, output_type="np")
    unmerged = merged_predictor.predict([images["square"]], PROMPT, **kw)
    merge_lora(merged_predictor.parts.transformer)
    assert not getattr(merged_predictor.parts.transformer, "peft_config", None)
    assert np.abs(merged_predictor.predict([images["square"]], PROMPT, **kw) - unmerged).max() <= 1e-4

    # The stage writes a loadable transformer folder, and prints where.
    (out,) = infer.run(_cfg(f"predict.lora={lora}", "predict.merge_to=merged"), tmp_path)
    assert out == tmp_path / "merged" / "transformer" and (out / "config.json").is_file()
    merged_predictor.parts.transformer = QwenImageTransformer2DModel.from_pretrained(out)
    assert np.abs(merged_predictor.predict([images["square"]], PROMPT, **kw) - unmerged).max() <= 1e-4


# --- the stage ---------------------------------------------------------------------------------------


def test_run_writes_numbered_outputs(images: dict[str, Path], tmp_path: Path, capsys) -> None:
    written = infer.run(_cfg(f"predict.image={images['square']}", f"predict.prompt={PROMPT}",
                             "predict.num_images=2", "predict.output=out/edit.png"), tmp_path)  # fmt: skip
    assert written == [tmp_path / "out" / "edit_0.png", tmp_path / "out" / "edit_1.png"]
    assert all(Image.open(p).size == (SIZE, SIZE) for p in written)
    assert str(written[0]) in capsys.readouterr().out
    absolute = tmp_path / "abs" / "one.png"
    assert infer.run(_cfg(f"predict.image={images['wide']}", f"predict.prompt={PROMPT}", "predict.height=64",
                          f"predict.output={absolute}"), tmp_path / "run") == [absolute]  # fmt: skip
    assert Image.open(absolute).size == (96, 64)


def test_batch_mode_writes_one_image_per_row(images: dict[str, Path], tmp_path: Path, capsys) -> None:
    data = tmp_path / "data"
    for stem, seed in (("a", 1), ("b", 2)):
        write_noise_image(data / "control_images" / f"{stem}.png", seed, (SIZE, SIZE))
        (data / "control_images" / f"{stem}.txt").write_text(PROMPT)
    (data / "control_images" / "c.png").write_bytes(b"broken")
    (data / "control_images" / "c.txt").write_text(PROMPT)
    written = infer.run(_cfg(f"predict.input={data}", "predict.output_dir=preds"), tmp_path)
    assert written == [tmp_path / "preds" / "a.png", tmp_path / "preds" / "b.png"]
    out = capsys.readouterr().out
    assert "skipped c:" in out and "c.png" in out


def test_cfg_without_negative_prompt_warns_and_runs_without_cfg(
    predictor: Predictor, images: dict[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="qie.models.sampling"):
        guided = predictor.predict(
            images["square"],
            PROMPT,
            negative_prompt=None,
            num_inference_steps=2,
            true_cfg_scale=4.0,
            seed=0,
            output_type="np",
        )
    assert "no negative prompt" in caplog.text
    plain = predictor.predict(
        images["square"], PROMPT, num_inference_steps=2, true_cfg_scale=1.0, seed=0, output_type="np"
    )
    assert np.array_equal(guided, plain)


# --- one image for one input, whoever samples it ----------------------------------------------------


def test_infer_api_and_validation_give_the_same_image(images: dict[str, Path], tmp_path: Path) -> None:
    """`python -m qie.infer`'s stage, `Trainer.predict` and training's Validator (inputs taken through an
    EmbeddingSource) turn one input into the same pixels under the same defaults: the `predict` group's
    SamplingOptions (CFG with the empty negative prompt, seed 0), the output size of the model's rule."""
    from stage_edges import parts_of, source_for

    import qie
    from qie.models import model_spec
    from qie.stages.settings import sampling_options
    from qie.stages.validation import validation_inputs, validation_samples
    from qie.training.validation import Validator

    image = images["wide"]  # a control of another aspect: the output size follows it
    run = small_config("infer", f"predict.image={image}", f"predict.prompt={PROMPT}")
    (written,) = infer.run(run, tmp_path / "infer")
    from_infer = np.asarray(Image.open(written))

    cfg = small_config("train", "cache=none", f"validation.images=['{image}']", f"validation.prompts=['{PROMPT}']")
    from_api = np.asarray(qie.Trainer(cfg, run_dir=tmp_path / "api").predict(image, PROMPT))

    v = cfg.validation
    options = sampling_options(cfg.predict)
    # Validation's own settings are unset by default, so it samples with predict's.
    assert sampling_options(cfg.predict, negative_prompt=v.negative_prompt, true_cfg_scale=v.true_cfg_scale,
                            num_inference_steps=v.num_inference_steps, seed=v.seed) == options  # fmt: skip
    assert options.guidance and options == sampling_options(run.predict)
    spec = model_spec(typed(cfg.model))
    samples = validation_samples(v, [], 0)
    inputs, negatives = validation_inputs(source_for(cfg), samples, options.negative_prompt)
    parts = parts_of(cfg.model, ["transformer", "scheduler", "vae"])
    validator = Validator(inputs, negatives, parts.scheduler, parts.vae, None, options, spec)
    (from_validation,) = validator.images(parts.transformer)

    assert from_infer.shape == (32, 96, 3)
    assert np.array_equal(from_api, from_infer)
    assert np.array_equal(np.asarray(from_validation), from_infer)


# --- errors ------------------------------------------------------------------------------------------


def test_missing_and_unreadable_images(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"nope\.png.*does not exist"):
        infer.run(_cfg(f"predict.image={tmp_path / 'nope.png'}", f"predict.prompt={PROMPT}"), tmp_path)
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"this is not a png")
    with pytest.raises(DataError, match=r"bad\.png.*cannot be read"):
        infer.run(_cfg(f"predict.image={bad}", f"predict.prompt={PROMPT}"), tmp_path)


def test_missing_prompt_or_image_and_bad_device(images: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="predict.prompt"):
        infer.run(_cfg(f"predict.image={images['square']}"), tmp_path)
    with pytest.raises(ConfigError, match="predict.image"):
        infer.run(_cfg(f"predict.prompt={PROMPT}"), tmp_path)
    with pytest.raises(ConfigError, match="cuda:7.*does not exist"):
        infer.run(_cfg(f"predict.image={images['square']}", f"predict.prompt={PROMPT}",
                       "predict.devices.transformer=cuda:7"), tmp_path)  # fmt: skip
    with pytest.raises(ConfigError, match="at most 1"):
        infer.run(_cfg(f"predict.images=[{images['square']},{images['wide']}]", f"predict.prompt={PROMPT}"), tmp_path)


def test_lora_that_does_not_fit(predictor: Predictor, lora: Path, tmp_path: Path) -> None:
    transformer = predictor.parts.transformer
    # A LoRA trained on a model of another width: shapes differ.
    other = QwenImageTransformer2DModel(patch_size=2, in_channels=16, out_channels=4, num_layers=2,
                                        attention_head_dim=8, num_attention_heads=3, joint_attention_dim=16,
                                        axes_dims_rope=(4, 2, 2))  # fmt: skip
    wrong = _save_random_lora(other, tmp_path / "other")
    first = r"key .transformer\.transformer_blocks\.0\.attn\.add_q_proj\.lora_A\.weight. has shape \(4, 24\)"
    with pytest.raises(ModelLoadError, match=rf"other.*does not fit.*{first}.*48 input features"):
        load_lora(transformer, wrong)
    # Keys for modules this model does not have (another architecture).
    state = load_file(lora)
    renamed = {k.replace("transformer_blocks", "single_transformer_blocks"): v for k, v in state.items()}
    save_file(renamed, tmp_path / "flux.safetensors")
    with pytest.raises(ModelLoadError, match=r"flux\.safetensors.*single_transformer_blocks.*does not have"):
        load_lora(transformer, tmp_path / "flux.safetensors")
    # Halves of one layer with different ranks.
    key = next(k for k in state if k.endswith("to_q.lora_B.weight"))
    save_file({**state, key: torch.zeros(state[key].shape[0], 2)}, tmp_path / "ranks.safetensors")
    with pytest.raises(ModelLoadError, match=r"ranks\.safetensors.*rank 2"):
        load_lora(transformer, tmp_path / "ranks.safetensors")
    # No transformer keys at all (diffusers would silently load nothing).
    save_file({"text_encoder.q_proj.lora_A.weight": torch.zeros(2, 2)}, tmp_path / "te.safetensors")
    with pytest.raises(ModelLoadError, match="holds no transformer weights"):
        load_lora(transformer, tmp_path / "te.safetensors")
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_lora(transformer, tmp_path / "missing")
    (tmp_path / "junk.safetensors").write_bytes(b"junk")
    with pytest.raises(ModelLoadError, match=r"cannot read LoRA.*junk\.safetensors"):
        load_lora(transformer, tmp_path / "junk.safetensors")
    assert not getattr(transformer, "peft_config", None)  # nothing half-loaded


# --- the real CLI ------------------------------------------------------------------------------------


@pytest.mark.subprocess
def test_cli_writes_png(tiny_path: Path, images: dict[str, Path], tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "qie.infer", f"predict.image={images['square']}", f"predict.prompt={PROMPT}",
           "predict.num_inference_steps=2", f"hydra.run.dir={run_dir}"]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert Image.open(run_dir / "output.png").size == (SIZE, SIZE)
    assert str(run_dir / "output.png") in done.stdout
    bad = subprocess.run([*cmd[:3], f"predict.image={tmp_path / 'nope.png'}", *cmd[4:]], env=env,
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert bad.returncode == 2 and "nope.png" in bad.stderr and "Traceback" not in bad.stderr


# --- everyday use --------------------------------------------------------------------------------------


def test_transformer_path_uses_a_merged_transformer_everywhere(
    lora: Path, images: dict[str, Path], tmp_path: Path
) -> None:
    from stage_edges import key_context_for, parts_of

    kw = dict(num_inference_steps=2, true_cfg_scale=1.0, seed=3, output_type="np")
    with_lora = predictor_for(_cfg(f"predict.lora={lora}")).predict([images["square"]], PROMPT, **kw)
    (out,) = infer.run(_cfg(f"predict.lora={lora}", "predict.merge_to=merged"), tmp_path)
    # The folder merge_to wrote, or the transformer folder in it: the base model's other parts around it.
    for path in (tmp_path / "merged", out):
        merged = predictor_for(_cfg(f"model.transformer_path={path}")).predict([images["square"]], PROMPT, **kw)
        assert np.abs(merged - with_lora).max() <= 1e-4
    base = predictor_for(_cfg()).predict([images["square"]], PROMPT, **kw)
    assert np.abs(base - with_lora).max() > 1e-3  # so the equality above is the merged weights' doing
    # Training and validation load it the same way; the cache keys do not depend on the transformer.
    cfg = small_config("train", f"model.transformer_path={out}")
    parts = parts_of(cfg.model, ["transformer"])
    saved = QwenImageTransformer2DModel.from_pretrained(out).state_dict()
    assert all(torch.equal(v, saved[k]) for k, v in parts.transformer.state_dict().items())
    assert key_context_for(cfg) == key_context_for(small_config("train"))
    with pytest.raises(ModelLoadError, match="model.transformer_path=.*no diffusers transformer"):
        predictor_for(_cfg(f"model.transformer_path={tmp_path}"))


def test_predict_takes_numpy_arrays_and_paths(predictor: Predictor, images: dict[str, Path]) -> None:
    kw = dict(num_inference_steps=2, true_cfg_scale=1.0, seed=3, output_type="np")
    pixels = np.asarray(Image.open(images["square"]).convert("RGB"))
    from_path = predictor.predict(images["square"], PROMPT, **kw)
    assert np.array_equal(predictor.predict(pixels, PROMPT, **kw), from_path)
    assert np.array_equal(predictor.predict([pixels / 255.0], PROMPT, **kw), from_path)
    with pytest.raises(DataError, match=r"spans \[0.0, 255.0\]: float images must lie in \[0, 1\]"):
        predictor.predict(pixels.astype(np.float32), PROMPT, **kw)
    with pytest.raises(DataError, match=r"shape \(3, 64, 64\).*channels last"):
        predictor.predict(pixels.transpose(2, 0, 1).copy(), PROMPT, **kw)


def test_meta_and_other_non_compute_devices_are_refused(images: dict[str, Path], tmp_path: Path) -> None:
    from qie.components import resolve_device

    for device, message in (("meta", "holds no data"), (torch.device("meta"), "holds no data"),
                            ("ipu", "not supported: use cpu, cuda")):  # fmt: skip
        with pytest.raises(ConfigError, match=message):
            resolve_device(device)
    with pytest.raises(ConfigError, match="'meta' holds no data"):
        infer.run(_cfg(f"predict.image={images['square']}", f"predict.prompt={PROMPT}",
                       "predict.devices.transformer=meta"), tmp_path)  # fmt: skip


def test_a_lora_trained_here_loads_without_peft_warnings(tiny_path: Path, tmp_path: Path) -> None:
    import warnings

    from qie.adapters.lora import add_lora, dead_modules, save_lora

    transformer = QwenImageTransformer2DModel.from_pretrained(tiny_path, subfolder="transformer")
    assert dead_modules(transformer)  # the last block's text side: left out of the adapter
    add_lora(transformer, 4, 4, ["to_q", "to_add_out", "add_q_proj"])
    saved = save_lora(transformer, tmp_path)
    fresh = QwenImageTransformer2DModel.from_pretrained(tiny_path, subfolder="transformer")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_lora(fresh, saved)
    assert [str(w.message)[:80] for w in caught] == []
    adapters = {n for n, m in fresh.named_modules() if hasattr(m, "lora_A")}
    assert adapters == {n for n, m in transformer.named_modules() if hasattr(m, "lora_A")}
