"""Where the model's weights come from and how they are held: what can be refused when the config is composed.

Plain checks of config values (and of this machine: a GPU for nf4, whether a path is a file); nothing is read or
built, and no model library is imported.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

# Why a part cannot come from one file (`model.vae_path`, `model.text_encoder_path`).
UNREADABLE_PARTS = {
    "vae_path": "diffusers 0.42.1's single-file loader (from_single_file) has no Qwen-Image VAE class",
    "text_encoder_path": "transformers has no single-file loader; it reads a text encoder from its folder",
}
# The largest scale a LoRA is fused at, either sign: far beyond any LoRA's useful strength (about 0 to 2).
FUSE_SCALE_MAX = 100.0
# Quantizations whose weights are packed 4-bit tensors inside tensors, which block swap does not move.
FOUR_BIT = ("int4", "nf4")


def weight_problem(cfg: DictConfig) -> str | None:
    """The first reason the composed `cfg`'s weights cannot be had as asked, as one line; None when they can."""
    if not isinstance(cfg.get("model"), DictConfig):
        return None
    checks = (_source_file, _part_files, _kept_fp8, _fused, _nf4, _four_bit_swap)
    return next((problem for check in checks if (problem := check(cfg))), None)


def nf4_problem(cuda: bool, installed: bool) -> str | None:
    """Why `model.quantize=nf4` (bitsandbytes) cannot run on this machine, or None."""
    if not cuda:
        return (
            "model.quantize=nf4 (bitsandbytes) needs a CUDA GPU and this machine has none: use model.quantize=int4 "
            "(optimum-quanto, 4-bit weights on any device)"
        )
    if not installed:
        return 'model.quantize=nf4 needs bitsandbytes: pip install "qie[bnb]", or use model.quantize=int4'
    return None


def _get(cfg: DictConfig, key: str, default: object = None) -> object:
    return OmegaConf.select(cfg, key, default=default)


def _source(cfg: DictConfig) -> str:
    return (
        ""
        if OmegaConf.is_missing(cfg.model, "pretrained_model_name_or_path")
        else str(cfg.model.pretrained_model_name_or_path)
    )


def _source_file(cfg: DictConfig) -> str | None:
    source = _source(cfg)
    if not source or not Path(source).expanduser().is_file():
        return None
    return (
        f"model.pretrained_model_name_or_path={source!r} is one file: give a hub id or a diffusers folder "
        "(model_index.json and one folder per part); a transformer file goes in model.transformer_path"
    )


def _part_files(cfg: DictConfig) -> str | None:
    for key, why in UNREADABLE_PARTS.items():
        path = _get(cfg, f"model.{key}")
        if path:
            part = key.removesuffix("_path")
            return (
                f"model.{key}={str(path)!r}: the {part.replace('_', ' ')} cannot be read from one file ({why}): "
                f"leave model.{key} unset; the {part} comes from model.pretrained_model_name_or_path="
                f"{_source(cfg)!r} (a hub id or a diffusers folder with {part}/ inside); only the transformer may "
                "be one file (model.transformer_path)"
            )
    return None


def _kept_fp8(cfg: DictConfig) -> str | None:
    """fp8 weights kept from a transformer file are optimum-quanto tensors, like `model.quantize`'s: refuse a
    second quantization and what needs plain weights (sharding, full training, merging a LoRA into them)."""
    if str(_get(cfg, "model.single_file_fp8", "upcast")) != "keep":
        return None
    quantize = str(_get(cfg, "model.quantize", "none"))
    if quantize != "none":
        return (
            f"model.single_file_fp8=keep holds the file's fp8 weights as they are; model.quantize={quantize} would "
            "quantize them again: set model.quantize=none, or model.single_file_fp8=upcast"
        )
    if not _get(cfg, "model.transformer_path"):
        return None
    needs = {
        "train.fsdp=true": bool(_get(cfg, "train.fsdp", False)),
        "train.mode=full": str(_get(cfg, "train.mode", "lora")) == "full",
        "predict.merge_to": bool(_get(cfg, "predict.merge_to")),
    }
    for key, on in needs.items():
        if on:
            return (
                f"{key} needs plain transformer weights; model.single_file_fp8=keep holds the file's fp8 weights "
                "as they are: set model.single_file_fp8=upcast"
            )
    return None


def _fused(cfg: DictConfig) -> str | None:
    """`model.fuse_loras`: set, one scale per file (or none), each file there, and weights it can fuse into."""
    files, scales = list(cfg.model.get("fuse_loras") or []), list(cfg.model.get("fuse_lora_scales") or [])
    if scales and len(scales) != len(files):
        return (
            f"model.fuse_lora_scales has {len(scales)} entries and model.fuse_loras {len(files)}: give one scale "
            "per file, or none (each file fused at 1.0)"
        )
    for i, scale in enumerate(scales):
        if not -FUSE_SCALE_MAX <= float(scale) <= FUSE_SCALE_MAX:  # NaN and inf too
            return (
                f"model.fuse_lora_scales[{i}]={scale} is out of range: give a scale from {-FUSE_SCALE_MAX:g} to "
                f"{FUSE_SCALE_MAX:g} (1.0: the LoRA as trained; below 0 subtracts it)"
            )
    for i, file in enumerate(files):
        if not Path(str(file)).expanduser().exists():
            return f"model.fuse_loras[{i}]={str(file)!r} does not exist: give a LoRA file (any format qie reads)"
    if not files:
        return None
    if str(_get(cfg, "model.quantize", "none")) == "nf4":
        return (
            "model.fuse_loras fuses into plain weights, but model.quantize=nf4 quantizes the transformer while it "
            "loads: use model.quantize=int4 (fused, then quantized), or save a fused transformer once (python -m "
            "qie.infer predict.lora=FILE predict.merge_to=DIR) and give it as model.transformer_path=DIR"
        )
    if str(_get(cfg, "model.single_file_fp8", "upcast")) == "keep" and _get(cfg, "model.transformer_path"):
        return (
            "model.fuse_loras fuses into plain weights; model.single_file_fp8=keep holds the file's fp8 weights "
            "as they are: set model.single_file_fp8=upcast"
        )
    return None


def _nf4(cfg: DictConfig) -> str | None:
    if str(_get(cfg, "model.quantize", "none")) != "nf4":
        return None
    import torch

    return nf4_problem(torch.cuda.is_available(), importlib.util.find_spec("bitsandbytes") is not None)


def _four_bit_swap(cfg: DictConfig) -> str | None:
    quantize = str(_get(cfg, "model.quantize", "none"))
    if quantize not in FOUR_BIT:
        return None
    for key in ("train.blocks_to_swap", "predict.blocks_to_swap"):
        if _get(cfg, key, 0):
            return (
                f"{key} moves plain and 8-bit weights only; model.quantize={quantize} packs 4-bit ones: set "
                f"{key}=0 (4-bit weights already quarter the transformer), or model.quantize=fp8 with block swap"
            )
    return None
