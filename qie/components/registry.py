"""The component registry: a name per pipeline part, and how to build each from a hub id or folder.

A stage asks for the parts it needs and gets only those; each part is placed on its own device and
dtype once, here, when it is built. Each part built is logged (DEBUG, logger `qie.components.registry`,
the part's name in the record's `part` attribute), so a tool can see what a stage builds.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from qie.components.single_file import is_single_file, load_transformer_file
from qie.errors import ConfigError, ModelLoadError
from qie.models.family import import_named

log = logging.getLogger(__name__)

PART_NAMES = ("vae", "text_encoder", "tokenizer", "processor", "transformer", "scheduler")
# Parts that hold weights; the others have no device or dtype.
MODULE_PARTS = ("vae", "text_encoder", "transformer")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class Parts:
    """The built parts of one model; a part not asked for stays None."""

    vae: Any = None
    text_encoder: Any = None
    tokenizer: Any = None
    processor: Any = None
    transformer: Any = None
    scheduler: Any = None
    # The checkpoint's model_index.json: settings the pipeline takes besides its parts (2.1's sample_sigmas).
    pipeline_config: dict = field(default_factory=dict)

    def built(self) -> list[str]:
        return [f.name for f in fields(self) if f.name in PART_NAMES and getattr(self, f.name) is not None]


@dataclass(frozen=True)
class Placement:
    device: torch.device
    dtype: torch.dtype


# Devices that compute, and how to tell whether this machine has one.
COMPUTE_DEVICES = {
    "cpu": lambda: True,
    "cuda": lambda: torch.cuda.is_available(),
    "mps": lambda: torch.backends.mps.is_available(),
    "xpu": lambda: hasattr(torch, "xpu") and torch.xpu.is_available(),
}


def resolve_device(name: str | torch.device) -> torch.device:
    """`auto` is the first CUDA device when there is one, else the CPU; a device that is not there fails.

    Only devices that compute are taken: `meta` (shapes without data) and the like are refused here, before
    a model is built on them.

    Raises:
        ConfigError: naming the device and the devices this machine has.
    """
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = name if isinstance(name, torch.device) else torch.device(name)
    except RuntimeError as e:
        raise ConfigError(f"device {name!r} is not a device name (try cpu, cuda, cuda:1): {e}") from None
    if device.type == "meta":
        raise ConfigError(
            f"device {str(name)!r} holds no data (tensor shapes only), so nothing can run on it: use cpu or cuda[:N]"
        )
    if device.type not in COMPUTE_DEVICES:
        raise ConfigError(f"device {str(name)!r} is not supported: use cpu, cuda[:N], mps or xpu")
    if device.type == "cuda":
        count = torch.cuda.device_count()
        if count == 0 or (device.index or 0) >= count:
            raise ConfigError(f"device {str(name)!r} does not exist here: this machine has {count} CUDA device(s)")
    elif not COMPUTE_DEVICES[device.type]():
        raise ConfigError(f"device {str(name)!r} is not available on this machine: use cpu")
    return device


def resolve_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[str(name)]
    except KeyError:
        raise ConfigError(f"dtype {name!r} is not one of {', '.join(DTYPES)}") from None


def _load_diffusers_model(
    cls: type, source: str, subfolder: str | None, revision: str | None, dtype: torch.dtype, **quantized: Any
):
    return cls.from_pretrained(source, subfolder=subfolder, revision=revision, torch_dtype=dtype, **quantized)


def _load_text_encoder(cls: type, source: str, subfolder: str | None, revision: str | None, dtype: torch.dtype):
    return cls.from_pretrained(source, subfolder=subfolder, revision=revision, dtype=dtype)


def _load_plain(cls: type, source: str, subfolder: str | None, revision: str | None, dtype: torch.dtype) -> Any:
    return cls.from_pretrained(source, subfolder=subfolder, revision=revision)


def _load_processor(cls: type, source: str, subfolder: str | None, revision: str | None, dtype: torch.dtype):
    from qie.models.processor import load_processor

    return load_processor(source, subfolder=subfolder or "", revision=revision, processor_class=cls)


# Each loader takes (class, source, subfolder or None, revision, dtype).
LOADERS: dict[str, Callable[..., Any]] = {
    "vae": _load_diffusers_model,
    "text_encoder": _load_text_encoder,
    "tokenizer": _load_plain,
    "processor": _load_processor,
    "transformer": _load_diffusers_model,
    "scheduler": _load_plain,
}


def build_parts(
    source: str,
    names: Iterable[str],
    classes: Mapping[str, str],
    placements: dict[str, Placement] | None = None,
    revision: str | None = None,
    quantize: str = "none",
    folders: Mapping[str, str] | None = None,
    keep_full_precision: Sequence[str] = (),
    text_encoder_quantize: str = "none",
    single_file_fp8: str = "upcast",
    fp8_compute: str = "never",
    compiled: bool = False,
    fuse: Callable[[Any], None] | None = None,
) -> Parts:
    """Build the named parts of the model at `source` (hub id or diffusers-format folder).

    Args:
        source: hub id or local folder with model_index.json and one subfolder per part.
        names: parts to build, a subset of PART_NAMES.
        classes: "module:Class" of each part (the model family's `part_classes`).
        placements: device and dtype per weight-holding part; missing ones go to the CPU in float32.
        revision: hub revision (branch, tag or commit).
        quantize: "none", "fp8", "int8", "int4" (optimum-quanto, after loading) or "nf4" (bitsandbytes, while
            loading; CUDA only): weight quantization of the transformer.
        folders: a part's own folder, replacing `source/<part>` (a merged or fully trained transformer); for the
            transformer also a single safetensors file (`qie.components.single_file`).
        keep_full_precision: transformer module patterns `quantize` leaves alone (the family's).
        text_encoder_quantize: "none", "fp8" or "int8": weight quantization of the text encoder.
        single_file_fp8: "upcast" or "keep": the fp8 weights of a transformer file (`load_transformer_file`).
        fp8_compute: "auto", "always" or "never": whether `quantize="fp8"` also computes in fp8 (torchao), decided
            for the transformer's device and whether its blocks will be `compiled` (`qie.components.fp8_compute`).
        fuse: changes the transformer's weights once it is loaded, before it is quantized and placed (the stages
            pass `FusedBase.fuse_into`, which fuses `model.fuse_loras` into it).

    Returns:
        Parts with exactly the requested parts set; weight-holding parts are frozen and in eval mode.

    Raises:
        ConfigError: an unknown part name.
        ModelLoadError: a part that cannot be loaded, naming the part and the source.
    """
    names = list(dict.fromkeys(names))
    unknown = [n for n in names if n not in LOADERS]
    if unknown:
        raise ConfigError(f"unknown model part(s) {unknown}: parts are {', '.join(PART_NAMES)}")
    placements, folders = placements or {}, folders or {}
    parts = Parts()
    for name in names:
        place = placements.get(name, Placement(torch.device("cpu"), torch.float32))
        own = folders.get(name)
        cls = import_named(classes[name])
        # nf4 is bitsandbytes', applied by diffusers while loading, straight onto the part's GPU.
        nf4 = name == "transformer" and quantize == "nf4"
        extra = _nf4_load_arguments(place, keep_full_precision) if nf4 else {}
        try:
            if own and name == "transformer" and is_single_file(own):
                part = load_transformer_file(cls, own, source, revision, place.dtype, single_file_fp8, **extra)
            elif own:
                part = LOADERS[name](cls, own, None, None, place.dtype, **extra)
            else:
                part = LOADERS[name](cls, source, name, revision, place.dtype, **extra)
        except (OSError, ValueError, KeyError) as e:
            where = f"folder {own!r}" if own else repr(source)
            expected = (
                f"a diffusers {name} folder" if own else f"a hub id or a diffusers-format folder with {name}/ inside"
            )
            raise ModelLoadError(f"cannot load the {name} of {where}: {e}\nExpected {expected}.") from None
        if name in MODULE_PARTS:
            part.requires_grad_(False)
            part.eval()
            if name == "transformer" and fuse is not None:
                fuse(part)
            quantized = "none" if nf4 else quantize
            fp8 = (fp8_compute, place.device, compiled)
            _quantize(name, part, quantized, text_encoder_quantize, keep_full_precision, fp8)
            part.to(place.device)
        setattr(parts, name, part)
        log.debug("built the %s of %s", name, source, extra={"part": name})
    return parts


def _nf4_load_arguments(place: Placement, keep: Sequence[str]) -> dict[str, Any]:
    from qie.components.quantize import nf4_config

    if place.device.type != "cuda":
        raise ConfigError(
            f"model.quantize=nf4 (bitsandbytes) puts the transformer on a CUDA device, but its device is "
            f"{place.device}: place it on cuda (predict.devices.transformer / the training process's GPU) or use "
            "model.quantize=int4"
        )
    return {"quantization_config": nf4_config(place.dtype, keep), "device_map": {"": str(place.device)}}


def _quantize(
    name: str, part: Any, transformer: str, text_encoder: str, keep: Sequence[str], fp8: tuple[str, torch.device, bool]
) -> None:
    """Quantize a part on the CPU before it moves to its device, so the device never holds its full weights
    (fp8 compute casts layer by layer on the device itself: its fp8 weights cannot move between devices)."""
    from qie.components import quantize

    if name == "transformer" and transformer != "none":
        quantize.quantize_transformer(part, transformer, keep, *fp8)
    elif name == "text_encoder" and text_encoder != "none":
        quantize.quantize_text_encoder(part, text_encoder)
