"""Where the model's weights come from and how they are held: what can be refused when the config is composed.

Plain checks of config values (and of this machine: a GPU for nf4, whether a path is a file); nothing is read or
built, and no model library is imported.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from qie.config.groups import Groups
from qie.config.model import ModelConfig

# Why a part cannot come from one file (`model.vae_path`, `model.text_encoder_path`).
UNREADABLE_PARTS = {
    "vae_path": "diffusers 0.42.1's single-file loader (from_single_file) has no Qwen-Image VAE class",
    "text_encoder_path": "transformers has no single-file loader; it reads a text encoder from its folder",
}
# The largest scale a LoRA is fused at, either sign: far beyond any LoRA's useful strength (about 0 to 2).
FUSE_SCALE_MAX = 100.0
# Quantizations whose weights are packed 4-bit tensors inside tensors, which block swap does not move.
FOUR_BIT = ("int4", "nf4")


def weight_problem(groups: Groups) -> str | None:
    """The first reason the weights of a composed config's `groups` cannot be had as asked, as one line; None when
    they can (and for a stage without a `model` group)."""
    model = groups.model
    if model is None:
        return None
    return (
        _source_file(model)
        or _part_files(model)
        or _kept_fp8(groups, model)
        or _fused(model)
        or _nf4(model)
        or _four_bit_swap(groups, model)
    )


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


def _source_file(model: ModelConfig) -> str | None:
    source = model.pretrained_model_name_or_path
    if not source or not Path(source).expanduser().is_file():
        return None
    return (
        f"model.pretrained_model_name_or_path={source!r} is one file: give a hub id or a diffusers folder "
        "(model_index.json and one folder per part); a transformer file goes in model.transformer_path"
    )


def _part_files(model: ModelConfig) -> str | None:
    parts = {"vae_path": model.vae_path, "text_encoder_path": model.text_encoder_path}
    for key, path in parts.items():
        if path:
            part, why = key.removesuffix("_path"), UNREADABLE_PARTS[key]
            return (
                f"model.{key}={path!r}: the {part.replace('_', ' ')} cannot be read from one file ({why}): "
                f"leave model.{key} unset; the {part} comes from model.pretrained_model_name_or_path="
                f"{model.pretrained_model_name_or_path!r} (a hub id or a diffusers folder with {part}/ inside); only "
                "the transformer may be one file (model.transformer_path)"
            )
    return None


def _kept_fp8(groups: Groups, model: ModelConfig) -> str | None:
    """fp8 weights kept from a transformer file are optimum-quanto tensors, like `model.quantize`'s: refuse a
    second quantization and what needs plain weights (sharding, full training, merging a LoRA into them)."""
    if model.single_file_fp8 != "keep":
        return None
    if model.quantize != "none":
        return (
            f"model.single_file_fp8=keep holds the file's fp8 weights as they are; model.quantize={model.quantize} "
            "would quantize them again: set model.quantize=none, or model.single_file_fp8=upcast"
        )
    if not model.transformer_path:
        return None
    train, predict = groups.train, groups.predict
    needs = {
        "train.fsdp=true": train is not None and train.fsdp,
        "train.mode=full": train is not None and train.mode == "full",
        "predict.merge_to": predict is not None and predict.merge_to,
    }
    for key, on in needs.items():
        if on:
            return (
                f"{key} needs plain transformer weights; model.single_file_fp8=keep holds the file's fp8 weights "
                "as they are: set model.single_file_fp8=upcast"
            )
    return None


def _fused(model: ModelConfig) -> str | None:
    """`model.fuse_loras`: set, one scale per file (or none), each file there, and weights it can fuse into."""
    files, scales = model.fuse_loras, model.fuse_lora_scales
    if scales and len(scales) != len(files):
        return (
            f"model.fuse_lora_scales has {len(scales)} entries and model.fuse_loras {len(files)}: give one scale "
            "per file, or none (each file fused at 1.0)"
        )
    for i, scale in enumerate(scales):
        if not -FUSE_SCALE_MAX <= scale <= FUSE_SCALE_MAX:  # NaN and inf too
            return (
                f"model.fuse_lora_scales[{i}]={scale} is out of range: give a scale from {-FUSE_SCALE_MAX:g} to "
                f"{FUSE_SCALE_MAX:g} (1.0: the LoRA as trained; below 0 subtracts it)"
            )
    for i, file in enumerate(files):
        if not Path(file).expanduser().exists():
            return f"model.fuse_loras[{i}]={file!r} does not exist: give a LoRA file (any format qie reads)"
    if not files:
        return None
    if model.quantize == "nf4":
        return (
            "model.fuse_loras fuses into plain weights, but model.quantize=nf4 quantizes the transformer while it "
            "loads: use model.quantize=int4 (fused, then quantized), or save a fused transformer once (python -m "
            "qie.infer predict.lora=FILE predict.merge_to=DIR) and give it as model.transformer_path=DIR"
        )
    if model.single_file_fp8 == "keep" and model.transformer_path:
        return (
            "model.fuse_loras fuses into plain weights; model.single_file_fp8=keep holds the file's fp8 weights "
            "as they are: set model.single_file_fp8=upcast"
        )
    return None


def _nf4(model: ModelConfig) -> str | None:
    if model.quantize != "nf4":
        return None
    import torch

    return nf4_problem(torch.cuda.is_available(), importlib.util.find_spec("bitsandbytes") is not None)


def _four_bit_swap(groups: Groups, model: ModelConfig) -> str | None:
    if model.quantize not in FOUR_BIT:
        return None
    swapped = {
        "train.blocks_to_swap": 0 if groups.train is None else groups.train.blocks_to_swap,
        "predict.blocks_to_swap": 0 if groups.predict is None else groups.predict.blocks_to_swap,
    }
    for key, blocks in swapped.items():
        if blocks:
            return (
                f"{key} moves plain and 8-bit weights only; model.quantize={model.quantize} packs 4-bit ones: set "
                f"{key}=0 (4-bit weights already quarter the transformer), or model.quantize=fp8 with block swap"
            )
    return None
