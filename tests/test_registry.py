"""The component registry builds exactly the parts asked for, where and how config says."""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path

import pytest
import torch
from diffusers import AutoencoderKLQwenImage, QwenImageEditPipeline, QwenImageTransformer2DModel
from helpers import count_constructions, tiny_pipeline
from stage_edges import parts_of
from transformers import Qwen2_5_VLForConditionalGeneration

from qie.components import PART_NAMES, build_parts, resolve_device
from qie.components.quantize import is_quantized
from qie.errors import ConfigError, ModelLoadError
from qie.models import families

QWEN_IMAGE = families()["qwen_image"].part_classes


@pytest.fixture
def constructions(monkeypatch: pytest.MonkeyPatch) -> Counter:
    """Counts __init__ calls of the model classes that hold weights."""
    return count_constructions(
        monkeypatch, (Qwen2_5_VLForConditionalGeneration, AutoencoderKLQwenImage, QwenImageTransformer2DModel)
    )


def test_transformer_and_scheduler_build_nothing_else(
    tiny_path: Path, constructions: Counter, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.DEBUG, logger="qie.components.registry"):
        parts = build_parts(str(tiny_path), ["transformer", "scheduler"], QWEN_IMAGE)
    assert parts.built() == ["transformer", "scheduler"]
    assert [r.part for r in caplog.records] == ["transformer", "scheduler"]  # what tools watch to see builds
    assert constructions == Counter({"QwenImageTransformer2DModel": 1})
    assert not any(p.requires_grad for p in parts.transformer.parameters())


def test_all_parts_build_from_config(small_cfg, constructions: Counter) -> None:
    cfg = small_cfg("infer")
    parts = parts_of(cfg.model, PART_NAMES, {"vae": "cpu", "text_encoder": "cpu", "transformer": "cpu"})
    assert sorted(parts.built()) == sorted(PART_NAMES)
    assert set(constructions.values()) == {1} and len(constructions) == 3
    assert parts.transformer.dtype == torch.float32 and parts.vae.device.type == "cpu"


def test_fp8_builds_a_quantized_transformer(small_cfg) -> None:
    cfg = small_cfg("train", "model.quantize=fp8")
    parts = parts_of(cfg.model, ["transformer"])
    assert is_quantized(parts.transformer)
    qlinear = parts.transformer.transformer_blocks[0].attn.to_q
    assert type(qlinear).__name__ == "QLinear"
    assert "float8" in str(qlinear.weight.dtype) or "float8" in str(qlinear.weight._data.dtype)
    # Input and output projections stay full precision.
    assert type(parts.transformer.proj_out).__name__ == "Linear"


def test_any_diffusers_folder_loads(tiny_path: Path, small_cfg, tmp_path: Path) -> None:
    """A folder written by diffusers' save_pretrained (not by qie) loads through model=qwen_image_edit."""
    pipe = tiny_pipeline(QwenImageEditPipeline, tiny_path)
    pipe.save_pretrained(tmp_path / "saved")
    cfg = small_cfg(
        "infer",
        "model=qwen_image_edit",
        f"model.pretrained_model_name_or_path={tmp_path / 'saved'}",
        "model.dtype=float32",
    )
    parts = parts_of(cfg.model, PART_NAMES)
    assert sorted(parts.built()) == sorted(PART_NAMES)
    original = pipe.transformer.state_dict()
    for name, value in parts.transformer.state_dict().items():
        assert torch.equal(value, original[name]), name


def test_missing_folder_part_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "model_index.json").write_text("{}")
    with pytest.raises(ModelLoadError, match="cannot load the vae of"):
        build_parts(str(tmp_path), ["vae"], QWEN_IMAGE)


def test_unknown_part_and_device() -> None:
    with pytest.raises(ConfigError, match="unknown model part"):
        build_parts("x", ["unet"], QWEN_IMAGE)
    with pytest.raises(ConfigError, match="does not exist here"):
        resolve_device("cuda:7")
    assert resolve_device("auto") == torch.device("cuda" if torch.cuda.is_available() else "cpu")
