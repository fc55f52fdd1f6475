"""Model parts: the registry, the offline tiny model, and building parts from the `model` config."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from qie.components.check import check_checkpoint, pipeline_config
from qie.components.registry import (
    MODULE_PARTS,
    PART_NAMES,
    Parts,
    Placement,
    build_parts,
    resolve_device,
    resolve_dtype,
)
from qie.components.single_file import check_transformer_file, is_single_file
from qie.config.model import ModelConfig
from qie.models import ModelSpec, model_spec


@dataclass(frozen=True, kw_only=True)
class LoadSettings:
    """What building a model's parts reads of its `model` group (`LoadSettings.of`): where the checkpoint is and how
    its weights are loaded, quantized and computed."""

    source: str  # hub id or folder (`model.pretrained_model_name_or_path`)
    revision: str | None = None
    dtype: str = "bfloat16"
    quantize: str = "none"
    transformer_path: str | None = None  # a transformer file or folder of its own
    text_encoder_quantize: str = "none"
    single_file_fp8: str = "upcast"
    fp8_compute: str = "auto"
    tiny: str | None = None  # a tiny preset qie builds at `source` when it is not there
    fuses: bool = False  # `model.fuse_loras` is set: a transformer is built only with them fused
    check: bool = True  # check a transformer file against the model before loading it

    @classmethod
    def of(cls, model: ModelConfig) -> LoadSettings:
        """The settings of a `model` group (its schema's dataclass)."""
        return cls(
            source=model.pretrained_model_name_or_path,
            revision=model.revision,
            dtype=model.dtype,
            quantize=model.quantize,
            transformer_path=model.transformer_path,
            text_encoder_quantize=model.text_encoder_quantize,
            single_file_fp8=model.single_file_fp8,
            fp8_compute=model.fp8_compute,
            tiny=model.tiny,
            fuses=bool(model.fuse_loras),
            check=model.check,
        )


def prepare_model(model: ModelConfig) -> ModelSpec:
    """The model's description, once its checkpoint is there and checked: what a stage calls first, once.

    Builds qie's tiny model at `model.pretrained_model_name_or_path` when `model.tiny` names a preset and it is
    not there yet, then compares the checkpoint with the config (`check_checkpoint`, reading JSON files only).

    Raises:
        ConfigError: the checkpoint is not the model `model` describes.
    """
    spec = model_spec(model)
    load = LoadSettings.of(model)
    check_checkpoint(spec, model, ensure_model(load))
    if load.transformer_path and load.check and is_single_file(load.transformer_path):
        check_transformer_file(spec, load.transformer_path)
    return spec


def ensure_model(load: LoadSettings) -> str:
    """The model's source, after building qie's tiny model there when `model.tiny` names a preset and it is
    not there yet (what loading parts needs; nothing is read or checked)."""
    if load.tiny:
        from qie.components.tiny import ensure_tiny_model

        ensure_tiny_model(load.source, variant=load.tiny)
    return load.source


def load_parts(
    load: LoadSettings,
    spec: ModelSpec,
    names: Iterable[str],
    devices: Mapping[str, str] | None = None,
    compiled: bool = False,
    fuse: Callable[[Any], None] | None = None,
) -> Parts:
    """Build the named parts of the model `spec` describes, each weight-holding part on `devices[name]`.

    Args:
        load: where the checkpoint is and how its weights load (`LoadSettings.of(model)`).
        spec: the model's description (`prepare_model`).
        names: parts to build.
        devices: device name per part ("auto", "cpu", "cuda:1"); missing parts use "auto".
        compiled: whether the transformer's blocks will be compiled (`model.fp8_compute=auto` computes fp8
            weights in fp8 only then).
        fuse: applied to the transformer once loaded, before it is quantized and placed: the stage's
            `FusedBase.fuse_into` (`model.fuse_loras`), which every stage that builds a transformer passes.
    """
    devices = devices or {}
    names = list(names)
    if "transformer" in names and load.fuses and fuse is None:
        from qie.errors import ConfigError

        raise ConfigError(
            "model.fuse_loras is set, but the transformer is being built without fusing them: pass "
            "fuse=FusedBase.of(...).fuse_into (qie.adapters.fused_base) to load_parts"
        )
    dtype = resolve_dtype(load.dtype)
    placements = {name: Placement(resolve_device(devices.get(name, "auto")), dtype) for name in MODULE_PARTS}
    own = load.transformer_path
    folders = {"transformer": transformer_folder(own)} if own and "transformer" in names else {}
    source = ensure_model(load)
    parts = build_parts(
        source,
        names,
        classes=spec.family.part_classes,
        placements=placements,
        revision=load.revision,
        quantize=load.quantize,
        folders=folders,
        keep_full_precision=spec.family.keep_full_precision,
        text_encoder_quantize=load.text_encoder_quantize,
        single_file_fp8=load.single_file_fp8,
        fp8_compute=load.fp8_compute,
        compiled=compiled,
        fuse=fuse,
    )
    parts.pipeline_config = pipeline_config(source, load.revision)
    return parts


def transformer_folder(path: str) -> str:
    """The transformer `model.transformer_path` names: a single safetensors file (diffusers' or ComfyUI's
    layout), the diffusers folder itself (with config.json) or one holding `transformer/` (what
    `predict.merge_to` and `train.mode=full` write).

    Raises:
        ModelLoadError: none of these is there.
    """
    from pathlib import Path

    from qie.errors import ModelLoadError

    root = Path(path).expanduser()
    if root.is_file():
        if root.suffix != ".safetensors":
            raise ModelLoadError(
                f"model.transformer_path={path!r} is not a .safetensors file: give a safetensors transformer file "
                "or a diffusers transformer folder"
            )
        return str(root)
    for folder in (root, root / "transformer"):
        if (folder / "config.json").is_file():
            return str(folder)
    if not root.exists():
        raise ModelLoadError(
            f"model.transformer_path={path!r} does not exist: give a .safetensors transformer file "
            "or a diffusers transformer folder"
        )
    raise ModelLoadError(
        f"model.transformer_path={path!r} holds no diffusers transformer (no config.json in it or in its "
        "transformer/): give the folder that predict.merge_to or train.mode=full wrote, or a .safetensors file"
    )


__all__ = [
    "MODULE_PARTS",
    "PART_NAMES",
    "LoadSettings",
    "Parts",
    "Placement",
    "build_parts",
    "load_parts",
    "prepare_model",
    "resolve_device",
    "resolve_dtype",
    "transformer_folder",
]
