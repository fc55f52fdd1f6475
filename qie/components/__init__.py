"""Model parts: the registry, the offline tiny model, and building parts from the `model` config."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from qie.components.registry import (
    MODULE_PARTS,
    PART_NAMES,
    Parts,
    Placement,
    build_parts,
    edit_pipeline,
    resolve_device,
    resolve_dtype,
)


def model_source(model_cfg: Any) -> str:
    """Hub id or folder of the model; builds qie's tiny model there first when `model.tiny` is set."""
    source = str(model_cfg.pretrained_model_name_or_path)
    if model_cfg.tiny:
        from qie.components.tiny import ensure_tiny_model

        preset = str(_value(getattr(model_cfg, "tiny_preset", "default")))
        ensure_tiny_model(source, variant=str(_value(model_cfg.variant)), preset=preset)
    return source


def load_parts(model_cfg: Any, names: Iterable[str], devices: Mapping[str, str] | None = None) -> Parts:
    """Build the named parts from a `model` config, each weight-holding part on `devices[name]`.

    Args:
        model_cfg: the `model` config node (pretrained_model_name_or_path, dtype, quantize, ...).
        names: parts to build.
        devices: device name per part ("auto", "cpu", "cuda:1"); missing parts use "auto".
    """
    devices = devices or {}
    dtype = resolve_dtype(str(_value(model_cfg.dtype)))
    placements = {name: Placement(resolve_device(devices.get(name, "auto")), dtype) for name in MODULE_PARTS}
    return build_parts(
        model_source(model_cfg),
        names,
        placements=placements,
        revision=model_cfg.revision,
        quantize=str(_value(model_cfg.quantize)),
    )


def _value(x: Any) -> Any:
    return getattr(x, "value", x)


__all__ = [
    "MODULE_PARTS",
    "PART_NAMES",
    "Parts",
    "Placement",
    "build_parts",
    "edit_pipeline",
    "load_parts",
    "model_source",
    "resolve_device",
    "resolve_dtype",
]
