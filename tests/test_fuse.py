"""Training and inference on a fused base (`model.fuse_loras`): the fused weights are diffusers' own `fuse_lora`'s,
the run records the fused files, inference refuses a LoRA of another base unless told, bad inputs fail in one line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import QwenImageEditPipeline, QwenImageTransformer2DModel
from helpers import small_config, tiny_pipeline, write_noise_image
from PIL import Image
from safetensors import safe_open
from safetensors.torch import save_file
from stage_edges import parts_of, predictor_for

from qie.adapters.fused_base import FusedBase
from qie.adapters.lora import LORA_FILE
from qie.adapters.lora_files import BASE_KEY, write_exports
from qie.cache.keys import FileHasher
from qie.checks import compose
from qie.components import prepare_model
from qie.config import typed
from qie.errors import ConfigError, ModelLoadError
from qie.stages import train
from qie.stages.settings import fused_base

PROMPT = "Make the sky blue."
SAMPLING = dict(num_inference_steps=2, true_cfg_scale=1.0, seed=2, output_type="np")


@pytest.fixture(scope="module")
def loras(tiny_path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A random LoRA of the tiny transformer as diffusers writes it, the same weights in ComfyUI's layout, and a
    second, different one."""
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    root = tmp_path_factory.mktemp("fuse_loras")
    out = {}
    for name, seed in (("first", 5), ("second", 6)):
        transformer = QwenImageTransformer2DModel.from_pretrained(tiny_path, subfolder="transformer")
        config = LoraConfig(r=4, lora_alpha=4, init_lora_weights=False, target_modules=["to_q", "to_v", "add_k_proj"])
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            transformer.add_adapter(config)
        state = {k: v.detach().clone() for k, v in get_peft_model_state_dict(transformer).items()}
        QwenImageEditPipeline.save_lora_weights(root / name, transformer_lora_layers=state)
        out[name] = root / name / LORA_FILE
        if name == "first":  # alpha = rank: the ComfyUI file applies the same change at 1.0
            (root / "comfyui").mkdir()
            out["comfyui"] = write_exports(root / "comfyui", state, ["comfyui"])[0]
    return out


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Image.Image:
    return Image.open(write_noise_image(tmp_path_factory.mktemp("fuse_image") / "in.png", 1))


def _infer(*overrides: str):
    return small_config("infer", "predict.true_cfg_scale=1.0", *overrides)


def _transformer(*overrides: str) -> dict[str, torch.Tensor]:
    """The tiny transformer's weights as the stages build it, with `overrides`."""
    cfg = _infer(*overrides)
    spec = prepare_model(typed(cfg.model))
    parts = parts_of(cfg.model, ["transformer"], spec=spec, fuse=fused_base(typed(cfg.model), spec).fuse_into)
    return parts.transformer.state_dict()


# --- fusing --------------------------------------------------------------------------------------------


@pytest.mark.usefixtures("small_conditions")
def test_fused_base_equals_diffusers_fuse_lora(tiny_path: Path, loras: dict[str, Path], image: Image.Image) -> None:
    """Inference on the fused base equals the pipeline after `load_lora_weights` + `fuse_lora` at the same scale; a
    ComfyUI file of the same weights fuses to the same transformer."""
    fused = predictor_for(_infer(f"model.fuse_loras=[{loras['first']}]", "model.fuse_lora_scales=[0.6]"))
    mine = fused.predict(image, PROMPT, **SAMPLING)
    pipe = tiny_pipeline(QwenImageEditPipeline, tiny_path)
    generator = torch.Generator().manual_seed(2)
    base = pipe(image=image, prompt=PROMPT, num_inference_steps=2, true_cfg_scale=1.0, generator=generator,
                output_type="np").images  # fmt: skip
    pipe.load_lora_weights(loras["first"], adapter_name="lightning")
    pipe.fuse_lora(lora_scale=0.6)
    pipe.unload_lora_weights()
    generator = torch.Generator().manual_seed(2)
    ref = pipe(image=image, prompt=PROMPT, num_inference_steps=2, true_cfg_scale=1.0, generator=generator,
               output_type="np").images  # fmt: skip
    assert np.abs(mine - ref).max() <= 1e-5
    assert np.abs(mine - base).max() > 1e-3  # the fused LoRA changes the output
    assert not any("lora" in k for k in fused.parts.transformer.state_dict())  # fused and unloaded
    weights = fused.parts.transformer.state_dict()
    theirs = pipe.transformer.state_dict()
    assert all(torch.equal(weights[k], theirs[k]) for k in theirs)
    comfyui = _transformer(f"model.fuse_loras=[{loras['comfyui']}]", "model.fuse_lora_scales=[0.6]")
    assert all(torch.allclose(comfyui[k], weights[k], rtol=0, atol=1e-6) for k in weights)


def test_two_fused_loras_add_up_and_a_quantized_base_is_fused_first(loras: dict[str, Path]) -> None:
    plain = _transformer()
    both = _transformer(f"model.fuse_loras=[{loras['first']},{loras['second']}]", "model.fuse_lora_scales=[0.5,2]")
    first = _transformer(f"model.fuse_loras=[{loras['first']}]", "model.fuse_lora_scales=[0.5]")
    second = _transformer(f"model.fuse_loras=[{loras['second']}]", "model.fuse_lora_scales=[2]")
    key = "transformer_blocks.0.attn.to_q.weight"
    torch.testing.assert_close(both[key] - plain[key], (first[key] - plain[key]) + (second[key] - plain[key]))
    # int8: quantized after fusing, so its weights are near the fused ones, not the plain ones
    cfg = _infer(f"model.fuse_loras=[{loras['first']}]", "model.fuse_lora_scales=[0.5]", "model.quantize=int8")
    spec = prepare_model(typed(cfg.model))
    quantized = parts_of(cfg.model, ["transformer"], spec=spec, fuse=fused_base(typed(cfg.model), spec).fuse_into)
    weight = quantized.transformer.get_submodule("transformer_blocks.0.attn.to_q").weight.dequantize()
    error, change = (weight - first[key]).abs().max(), (first[key] - plain[key]).abs().max()
    assert error < change / 10


# --- bad inputs -----------------------------------------------------------------------------------------


def test_bad_fused_loras_fail_in_one_line(tiny_path: Path, loras: dict[str, Path], tmp_path: Path) -> None:
    first = loras["first"]
    cases = [  # (overrides, error type, what the message says)
        ([f"model.fuse_loras=[{first}]", "model.fuse_lora_scales=[1,2]"], ConfigError,
         "model.fuse_lora_scales has 2 entries and model.fuse_loras 1: give one scale per file"),
        ([f"model.fuse_loras=[{tmp_path / 'gone.safetensors'}]"], ConfigError,
         f"model.fuse_loras[0]='{tmp_path / 'gone.safetensors'}' does not exist"),
        ([f"model.fuse_loras=[{first}]", "model.quantize=nf4"], ConfigError,
         "model.fuse_loras fuses into plain weights, but model.quantize=nf4 quantizes the transformer while it loads"),
        (["experiment=lightning"], ConfigError, "set model.fuse_loras=[FILE]>' does not exist"),
    ]  # fmt: skip
    for overrides, error, expected in cases:
        with pytest.raises(error) as info:
            compose("train", overrides)
        assert expected in str(info.value) and "\n" not in str(info.value), overrides
    # A file without transformer weights: refused when read, before anything is built.
    save_file({"text_encoder.layers.0.lora_A.weight": torch.zeros(4, 8)}, str(tmp_path / "text.safetensors"))
    # A LoRA of other sizes: refused when fused, naming the key, the file and the module.
    save_file({"transformer.transformer_blocks.0.attn.to_q.lora_A.weight": torch.zeros(4, 7),
               "transformer.transformer_blocks.0.attn.to_q.lora_B.weight": torch.zeros(16, 4)},
              str(tmp_path / "other.safetensors"))  # fmt: skip
    expected_of = {
        "text": "model.fuse_loras[0]: LoRA '{}' holds no transformer weights",
        "other": "model.fuse_loras[0]: LoRA '{}' does not fit this model: key "
        "'transformer.transformer_blocks.0.attn.to_q.lora_A.weight' has shape (4, 7)",
    }
    for name, expected in expected_of.items():
        file = tmp_path / f"{name}.safetensors"
        with pytest.raises(ModelLoadError) as info:
            _transformer(f"model.fuse_loras=[{file}]")
        assert str(info.value).startswith(expected.format(file)) and "\n" not in str(info.value)


def test_a_stage_cannot_build_the_transformer_without_fusing(loras: dict[str, Path]) -> None:
    cfg = _infer(f"model.fuse_loras=[{loras['first']}]")
    with pytest.raises(ConfigError, match="model.fuse_loras is set, but the transformer is being built without"):
        parts_of(cfg.model, ["transformer"])


def test_a_quantized_transformer_is_not_fused_into(tiny_path: Path, loras: dict[str, Path]) -> None:
    from qie.components.quantize import quantize_weights

    transformer = QwenImageTransformer2DModel.from_pretrained(tiny_path, subfolder="transformer")
    quantize_weights(transformer, "int8")  # as fp8 weights kept from a file (model.single_file_fp8=keep) are
    fused = FusedBase.of([str(loras["first"])], [], QwenImageEditPipeline)
    with pytest.raises(ModelLoadError, match="model.fuse_loras fuses into plain weights, but this transformer's"):
        fused.fuse_into(transformer)


# --- training on a fused base, and inference of what it trained ---------------------------------------------


@pytest.fixture(scope="module")
def runs(cached_data, loras: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Two steps on the plain base and on a fused one (the latter validating at 2 and 3 steps, checkpointing at 2)."""
    root = tmp_path_factory.mktemp("fuse_runs")
    common = ["train.seed=3", "train.learning_rate=1e-3", "data.batch_size=1"]
    fused = [f"model.fuse_loras=[{loras['first']}]", "train.checkpoint_every=2", "validation.every=2",
             "validation.step_counts=[2,3]", "validation.true_cfg_scale=1.0", "logging.log_images_count=1"]  # fmt: skip
    out = {}
    for name, extra in (("plain", []), ("fused", fused)):
        result = train.run(small_config("train", *cached_data.overrides, *common, *extra), root / name)
        out[name] = {"dir": root / name, **result}
    return out


def test_training_on_a_fused_base_records_the_fused_files(runs: dict, loras: dict[str, Path]) -> None:
    plain, fused = runs["plain"], runs["fused"]
    assert fused["losses"][0] != plain["losses"][0]  # the same batch and noise on another base
    record = [{"file": LORA_FILE, "fingerprint": FileHasher(None, "xxh3_128").hash(loras["first"]), "scale": 1.0}]
    state = json.loads((fused["dir"] / "checkpoints" / "step-000002" / "trainer_state.json").read_text())
    assert state["model"]["fused_loras"] == record
    for lora, expected in ((fused["lora"], record), (plain["lora"], [])):  # the file itself names its base
        with safe_open(lora, "pt") as f:
            assert json.loads(f.metadata()[BASE_KEY]) == expected
    # Validation at each step count, each in its own folder; the counts give different images.
    images = [np.asarray(Image.open(next((fused["dir"] / "validation" / f"steps-{n}" / "step-000002").glob("*.png"))))
              for n in (2, 3)]  # fmt: skip
    assert np.abs(images[0].astype(int) - images[1].astype(int)).max() > 0


def test_resuming_on_another_fused_base_is_refused(runs: dict, cached_data) -> None:
    checkpoint = runs["fused"]["dir"] / "checkpoints" / "step-000002"
    cfg = small_config("train", *cached_data.overrides, "train.max_steps=3", f"train.resume={checkpoint}")
    with pytest.raises(ConfigError, match=r"was trained on another model or data set \(model.fused_loras: \[\{"):
        train.run(cfg, runs["fused"]["dir"].parent / "resumed")


@pytest.mark.usefixtures("small_conditions")
def test_inference_refuses_a_lora_of_another_base_unless_told(
    runs: dict, loras: dict[str, Path], image: Image.Image, capsys: pytest.CaptureFixture
) -> None:
    fused_lora, plain_lora, base = runs["fused"]["lora"], runs["plain"]["lora"], f"model.fuse_loras=[{loras['first']}]"
    refusals = [  # (overrides, what the message says to do)
        ([f"predict.lora={fused_lora}"], "give the same model.fuse_loras (and model.fuse_lora_scales): qie fuses "
                                         "only the files you give, or set predict.allow_other_base=true"),
        ([f"predict.lora={fused_lora}", f"model.fuse_loras=[{loras['second']}]"], "give the same model.fuse_loras"),
        ([f"predict.lora={fused_lora}", base, "model.fuse_lora_scales=[0.5]"], "give the same model.fuse_loras"),
        ([f"predict.lora={plain_lora}", base], "leave model.fuse_loras empty, or set predict.allow_other_base=true"),
    ]  # fmt: skip
    for overrides, expected in refusals:
        with pytest.raises(ConfigError) as info:
            predictor_for(_infer(*overrides))
        message = str(info.value)
        assert f"LoRA '{overrides[0].split('=')[1]}' was trained on " in message and expected in message, overrides
        assert "\n" not in message
    assert "was trained on a base fused with pytorch_lora_weights.safetensors at 1.0 (" in str(
        pytest.raises(ConfigError, predictor_for, _infer(f"predict.lora={fused_lora}")).value
    )
    # The same base: accepted, silently; another one with predict.allow_other_base=true: accepted, with a warning.
    same = predictor_for(_infer(f"predict.lora={fused_lora}", base)).predict(image, PROMPT, **SAMPLING)
    assert "warning" not in capsys.readouterr().out
    other = predictor_for(_infer(f"predict.lora={fused_lora}", "predict.allow_other_base=true"))
    assert "using it anyway (predict.allow_other_base=true)" in capsys.readouterr().out
    assert np.abs(other.predict(image, PROMPT, **SAMPLING) - same).max() > 1e-3  # not the base it learnt on
