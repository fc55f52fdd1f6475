"""Model parts: the registry, the offline tiny model, and building parts from the `model` config."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
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
from qie.models import ModelSpec, model_spec


def prepare_model(model_cfg: Any) -> ModelSpec:
    """The model's description, once its checkpoint is there and checked: what a stage calls first, once.

    Builds qie's tiny model at `model.pretrained_model_name_or_path` when `model.tiny` names a preset and it is
    not there yet, then compares the checkpoint with the config (`check_checkpoint`, reading JSON files only).

    Raises:
        ConfigError: the checkpoint is not the model `model_cfg` describes.
    """
    spec = model_spec(model_cfg)
    check_checkpoint(spec, model_cfg, ensure_model(model_cfg))
    own = getattr(model_cfg, "transformer_path", None)
    if own and getattr(model_cfg, "check", True) and is_single_file(own):
        check_transformer_file(spec, str(own))
    return spec


def ensure_model(model_cfg: Any) -> str:
    """The model's source, after building qie's tiny model there when `model.tiny` names a preset and it is
    not there yet (what loading parts needs; nothing is read or checked)."""
    source = model_source(model_cfg)
    if getattr(model_cfg, "tiny", None):
        from qie.components.tiny import ensure_tiny_model

        ensure_tiny_model(source, variant=str(model_cfg.tiny))
    return source


def model_source(model_cfg: Any) -> str:
    """Hub id or folder of the model (nothing is built or read: see `prepare_model`)."""
    return str(model_cfg.pretrained_model_name_or_path)


def load_parts(
    model_cfg: Any,
    names: Iterable[str],
    devices: Mapping[str, str] | None = None,
    spec: ModelSpec | None = None,
    compiled: bool = False,
    fuse: Callable[[Any], None] | None = None,
) -> Parts:
    """Build the named parts from a `model` config, each weight-holding part on `devices[name]`.

    Args:
        model_cfg: the `model` config node (pretrained_model_name_or_path, dtype, quantize, ...).
        names: parts to build.
        devices: device name per part ("auto", "cpu", "cuda:1"); missing parts use "auto".
        spec: the model's description (`prepare_model`); made from `model_cfg` when not given.
        compiled: whether the transformer's blocks will be compiled (`model.fp8_compute=auto` computes fp8
            weights in fp8 only then).
        fuse: applied to the transformer once loaded, before it is quantized and placed: the stage's
            `FusedBase.fuse_into` (`model.fuse_loras`), which every stage that builds a transformer passes.
    """
    spec = spec or model_spec(model_cfg)
    devices = devices or {}
    names = list(names)
    if "transformer" in names and getattr(model_cfg, "fuse_loras", None) and fuse is None:
        from qie.errors import ConfigError

        raise ConfigError(
            "model.fuse_loras is set, but the transformer is being built without fusing them: pass "
            "fuse=FusedBase.of(...).fuse_into (qie.adapters.fused_base) to load_parts"
        )
    dtype = resolve_dtype(str(model_cfg.dtype))
    placements = {name: Placement(resolve_device(devices.get(name, "auto")), dtype) for name in MODULE_PARTS}
    own = getattr(model_cfg, "transformer_path", None)
    folders = {"transformer": transformer_folder(own)} if own and "transformer" in names else {}
    source = ensure_model(model_cfg)
    parts = build_parts(
        source,
        names,
        classes=spec.part_classes,
        placements=placements,
        revision=model_cfg.revision,
        quantize=str(model_cfg.quantize),
        folders=folders,
        keep_full_precision=spec.family.keep_full_precision,
        text_encoder_quantize=str(getattr(model_cfg, "text_encoder_quantize", "none")),
        single_file_fp8=str(getattr(model_cfg, "single_file_fp8", "upcast")),
        fp8_compute=str(getattr(model_cfg, "fp8_compute", "auto")),
        compiled=compiled,
        fuse=fuse,
    )
    parts.pipeline_config = pipeline_config(source, model_cfg.revision)
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
    "Parts",
    "Placement",
    "build_parts",
    "load_parts",
    "model_source",
    "prepare_model",
    "resolve_device",
    "resolve_dtype",
    "transformer_folder",
]
