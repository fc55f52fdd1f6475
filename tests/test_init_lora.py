"""`train.init_lora`: go on training from a LoRA file another tool wrote (kohya keys, alpha != rank), for every
family; the file is checked before any model is built."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from diffusers import AutoModel
from helpers import CachedData, small_config
from safetensors.torch import load_file, save_file

from qie.adapters.lora import load_lora
from qie.errors import ConfigError, ModelLoadError
from qie.stages import train as train_stage
from qie.training.modes import LoraMode

FAMILIES = {
    "tiny": "tiny_path",
    "tiny_edit_2511": "tiny_2511_path",
    "tiny_t2i": "tiny_t2i_path",
    "tiny_qwen_image_21": "tiny21_path",
}
RANK, ALPHA = 2, 1.0


def write_kohya_lora(transformer: torch.nn.Module, targets: list[str], path: Path) -> dict[str, torch.Tensor]:
    """A kohya/musubi-style file (`lora_unet_…`, alpha 1 at rank 2: applied at 0.5) on the first block's
    targeted modules; returns the weight change it means, per module."""
    modules = {n: m for n, m in transformer.named_modules()
               if n.startswith("transformer_blocks.0.") and any(n.endswith(f".{t}") for t in targets)}  # fmt: skip
    generator = torch.Generator().manual_seed(1)
    state, deltas = {}, {}
    for name, m in modules.items():
        down = torch.randn(RANK, m.in_features, generator=generator)
        up = torch.randn(m.out_features, RANK, generator=generator)
        stem = "lora_unet_" + name.replace(".", "_")
        state |= {f"{stem}.lora_down.weight": down, f"{stem}.lora_up.weight": up, f"{stem}.alpha": torch.tensor(ALPHA)}
        deltas[name] = ALPHA / RANK * up @ down
    save_file(state, str(path))
    return deltas


def deltas_of(transformer: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: m.get_delta_weight("default") for n, m in transformer.named_modules() if hasattr(m, "lora_A")}


def assert_same(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(expected)
    for name, delta in expected.items():
        torch.testing.assert_close(got[name].float(), delta, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("preset", list(FAMILIES))
def test_training_starts_from_the_file(preset: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    path = str(request.getfixturevalue(FAMILIES[preset]))
    targets = list(small_config("train", f"model={preset}").model.lora_target_modules)
    transformer = AutoModel.from_pretrained(path, subfolder="transformer")
    expected = write_kohya_lora(transformer, targets, tmp_path / "other_tool.safetensors")

    params = LoraMode(rank=16, alpha=16, init_lora=str(tmp_path / "other_tool.safetensors")).trainable(transformer)
    assert params and all(p.requires_grad and p.dtype == torch.float32 for p in params)
    assert len(params) == 2 * len(expected)
    assert_same(deltas_of(transformer), expected)  # the file's strength, not train.lora's rank / alpha


def test_cli_run_goes_on_from_the_file(cached_data: CachedData, tiny_path: Path, tmp_path: Path) -> None:
    """With a zero learning rate the trained LoRA is the starting file, at its strength."""
    transformer = AutoModel.from_pretrained(str(tiny_path), subfolder="transformer")
    targets = list(small_config("train").model.lora_target_modules)
    expected = write_kohya_lora(transformer, targets, tmp_path / "start.safetensors")
    cfg = small_config("train", *cached_data.overrides, f"train.init_lora={tmp_path / 'start.safetensors'}",
                       "train.learning_rate=0", "train.max_steps=1")  # fmt: skip
    result = train_stage.run(cfg, tmp_path / "run")
    fresh = AutoModel.from_pretrained(str(tiny_path), subfolder="transformer")
    load_lora(fresh, result["lora"])
    assert_same(deltas_of(fresh), expected)
    assert set(load_file(result["lora"])) == {f"transformer.{m}.lora_{ab}.weight" for m in expected for ab in "AB"}


@pytest.mark.parametrize(
    ("override", "error", "match"),
    [
        ("train.init_lora={tmp}/missing.safetensors", ModelLoadError, "does not exist"),
        ("train.init_lora={tmp}/te.safetensors", ModelLoadError, "holds no transformer weights"),
        ("train.lora.init={tmp}/start.safetensors", ConfigError, "use train.init_lora=PATH"),
    ],
)
def test_bad_start_is_refused_before_a_model_is_built(
    cached_data: CachedData, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, override: str, error, match: str
) -> None:
    save_file({"text_encoder.layers.0.q_proj.lora_A.weight": torch.zeros(2, 4)}, str(tmp_path / "te.safetensors"))
    monkeypatch.setattr(train_stage, "build_train_state", lambda *a: pytest.fail("a model was built"))
    monkeypatch.setattr(train_stage, "load_samples", lambda *a, **k: pytest.fail("the data was read first"))
    with pytest.raises(error, match=match):  # a name peft does not know: when the config is composed
        train_stage.run(small_config("train", *cached_data.overrides, override.format(tmp=tmp_path)), tmp_path / "run")
