"""The model-family interface: every piece required and checked, one registry of names, family rules checked
before anything is built, and a library that names no family outside `qie/models`."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path

import pytest
from helpers import small_config

from qie.checks import compose
from qie.config import typed
from qie.errors import ConfigError
from qie.models import FamilyError, families, model_spec, tiny_presets, variants
from qie.models.family import ModelFamily

QIE = Path(__file__).resolve().parents[1] / "qie"
# Where no family may be named: the seam is the ModelFamily object.
FAMILY_FREE = [
    "stages",
    "training",
    "cache",
    "data",
    "demo",
    "embedding",
    "adapters",
    "runtime",
    "models/sampling.py",
    "models/flow_family.py",
    "api.py",
]
FAMILY_NAMES = re.compile(r"QwenImage|Qwen2_5|Qwen3|Qwen2VL|qwen_image|TransformerBlock")


def test_the_library_names_no_family_outside_the_models_package() -> None:
    hits = []
    for entry in FAMILY_FREE:
        for path in sorted((QIE / entry).rglob("*.py")) if (QIE / entry).is_dir() else [QIE / entry]:
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                if FAMILY_NAMES.search(line):
                    hits.append(f"{path.relative_to(QIE)}:{number}: {line.strip()}")
    assert hits == []


def test_every_family_registers_with_every_piece() -> None:
    assert set(families()) == {"qwen_image", "qwen_image_21", "qwen_image_layered"}
    assert set(variants()) == {"edit", "edit_plus", "text_to_image", "qwen_image_21", "layered"}
    assert {name for name, (family, _) in tiny_presets().items() if family.name == "qwen_image_21"} == {"qwen_image_21"}
    for family in families().values():
        assert family.block_classes(), family.name  # what FSDP wraps: the transformer's own _no_split_modules


def test_a_transformer_resolves_to_one_family_with_or_without_an_adapter() -> None:
    """A Layered transformer is Qwen-Image's class with one more module: its signature, the longer, names it."""
    import torch
    from peft import LoraConfig

    from qie.models import family_of

    for name, family in families().items():
        config = next(iter(family.tiny_flavours.values())).transformer
        with torch.device("meta"):
            transformer = family.part_class("transformer")(**config)
        assert family_of(transformer) is family, name
        transformer.add_adapter(LoraConfig(r=2, target_modules=["to_q", "txt_mlp.net.0.proj"]))
        assert family_of(transformer) is family, name
    with pytest.raises(FamilyError, match="Linear is the transformer of no model family"):
        family_of(torch.nn.Linear(1, 1))


def test_flavours_hold_one_published_size_and_the_tiny_presets() -> None:
    for family in families().values():
        assert family.published.tiny is None and family.tiny_flavours, family.name
        with pytest.raises(FamilyError, match="published size"):
            ModelFamily(**_without(family, flavours=family.tiny_flavours))


def test_the_model_schema_and_the_spec_default_the_sampling_options_alike() -> None:
    from qie.config.model import ModelConfig
    from qie.models import ModelSpec

    spec = {f.name: f.default for f in dataclasses.fields(ModelSpec) if f.default is not dataclasses.MISSING}
    assert spec == {key: getattr(ModelConfig(), key) for key in spec}


def _without(family: ModelFamily, **changes) -> dict:
    fields = {f.name: getattr(family, f.name) for f in dataclasses.fields(family)}
    return {**fields, **changes}


def test_a_missing_or_misspelt_piece_fails_when_the_family_registers() -> None:
    family = families()["qwen_image"]
    fields = _without(family)
    del fields["sample"]
    with pytest.raises(TypeError, match="sample"):
        ModelFamily(**fields)

    def predict(transformer, batch, noise, sigma):  # "sigma": not the interface's name
        return 0

    with pytest.raises(FamilyError, match="predict.*must take"):
        ModelFamily(**_without(family, predict=predict))
    with pytest.raises(FamilyError, match="part_classes lacks"):
        ModelFamily(**_without(family, part_classes={"vae": "x:Y"}))


def test_the_variant_and_tiny_preset_come_from_the_families() -> None:
    with pytest.raises(ConfigError, match="model.variant='flux' is not known: choose one of edit, edit_plus"):
        compose("train", ["model.variant=flux"])
    with pytest.raises(ConfigError, match="model.tiny='huge' is not a tiny preset"):
        compose("train", ["model.tiny=huge"])


@pytest.mark.parametrize(
    "override", ["+train.lora.use_rslora=true", "+data.columns.masks=m", "+predict.devices.foo=cpu", "+model.foo=1"]
)
def test_nested_unknown_keys_are_refused_like_top_level_ones(override: str) -> None:
    key = override.lstrip("+").split("=")[0]
    with pytest.raises(ConfigError, match=f"unknown key {re.escape(key)}: valid keys of"):
        compose("train", [override])


def test_qwen_image_21_needs_one_resize_for_both_encoders_when_composed() -> None:
    with pytest.raises(ConfigError, match="model.vl_image_pixels=8192 and model.vae_image_pixels=4096 differ"):
        compose("infer", ["model=tiny_qwen_image_21", "model.vl_image_pixels=8192"])


def test_a_processor_that_resizes_again_is_refused_before_anything_is_built(
    tiny21_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from qie.components import prepare_model

    folder = tmp_path / "q21"
    shutil.copytree(tiny21_path, folder)
    config = folder / "processor" / "preprocessor_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "max_pixels": 32 * 32}))
    cfg = compose("infer", ["model=qwen_image_21", f"model.pretrained_model_name_or_path={folder}",
                            "model.vae_image_pixels=4096", "model.vl_image_pixels=4096"])  # fmt: skip
    with pytest.raises(ConfigError, match="max_pixels=1024 pixels, below the condition area"):
        prepare_model(typed(cfg.model))


def test_a_step_count_the_checkpoint_fixes_is_named(
    tiny21_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    from qie.stages import infer

    cfg = small_config("infer", "model=tiny_qwen_image_21", "predict.prompt=a cat", "predict.num_inference_steps=2")
    infer.run(cfg, tmp_path)
    out = capsys.readouterr().out
    assert "num_inference_steps=2 is not used: the checkpoint's model_index.json fixes 4 sampling steps" in out


def test_fsdp_and_swap_take_the_familys_blocks() -> None:
    from qie.runtime.memory import MemorySettings

    for name, block in (("tiny", "QwenImageTransformerBlock"), ("tiny_qwen_image_21", "QwenImage21TransformerBlock")):
        cfg = compose("train", [f"model={name}", "train.fsdp=true", "validation.every=0"])
        settings = MemorySettings.of(cfg.train, model_spec(typed(cfg.model)).family)
        plugin = settings.accelerator_kwargs()["fsdp_plugin"]
        assert plugin.transformer_cls_names_to_wrap == [block] and settings.blocks == "transformer_blocks"


def test_computing_cache_keys_builds_nothing(tmp_path: Path) -> None:
    from stage_edges import key_context_for

    cfg = compose("precompute", [f"model.pretrained_model_name_or_path={tmp_path / 'not-built'}"])
    with pytest.raises(Exception):  # noqa: B017 - whatever reading a missing checkpoint raises, it builds nothing
        key_context_for(cfg)
    assert not (tmp_path / "not-built").exists()
