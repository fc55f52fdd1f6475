"""Loading a saved LoRA into the transformer, fusing it into the base weights, and saving the result.

Loading goes through diffusers' own `lora_state_dict` (which also converts ComfyUI / kohya key formats)
and the transformer's `load_lora_adapter`, so a LoRA behaves here exactly as in a diffusers pipeline.
Before that, every key is checked against the model: diffusers silently ignores a LoRA with no
transformer keys and fails deep inside peft on a shape mismatch, both unhelpful to a user.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from qie.errors import ModelLoadError

LORA_FILE = "pytorch_lora_weights.safetensors"
PREFIX = "transformer."


def lora_file(path: str | Path) -> Path:
    """The LoRA weights file that `path` names: the file itself, or the LoRA file in a folder.

    Raises:
        ModelLoadError: the path does not exist, or the folder holds no single LoRA file.
    """
    path = Path(path).expanduser()
    if path.is_file():
        return path
    if not path.exists():
        raise ModelLoadError(f"LoRA {str(path)!r} does not exist: give a {LORA_FILE} file or its folder")
    if (path / LORA_FILE).is_file():
        return path / LORA_FILE
    found = sorted(path.glob("*.safetensors"))
    if len(found) == 1:
        return found[0]
    listed = ", ".join(p.name for p in found) or "none"
    raise ModelLoadError(f"LoRA folder {str(path)!r} holds no {LORA_FILE} (.safetensors files: {listed})")


def read_lora(path: str | Path) -> tuple[dict[str, torch.Tensor], dict | None, Path]:
    """The LoRA state dict in diffusers format (keys `transformer.<module>.lora_A.weight`), its metadata, file.

    Raises:
        ModelLoadError: a missing or unreadable file.
    """
    from diffusers import QwenImageEditPipeline

    file = lora_file(path)
    try:
        state, metadata = QwenImageEditPipeline.lora_state_dict(
            str(file.parent), weight_name=file.name, return_lora_metadata=True
        )
    except Exception as e:  # safetensors, json and conversion errors all mean "cannot read this LoRA"
        raise ModelLoadError(f"cannot read LoRA {str(file)!r}: {e}") from None
    return state, metadata, file


def check_lora_fits(transformer: torch.nn.Module, state: dict[str, torch.Tensor], file: str | Path) -> None:
    """Check that every LoRA key names a linear layer of `transformer` with matching sizes and one rank.

    Raises:
        ModelLoadError: naming the file and the first key that does not fit, and why.
    """
    keys = [k for k in state if k.startswith(PREFIX)]
    if not keys:
        first = next(iter(state), None)
        raise ModelLoadError(
            f"LoRA {str(file)!r} holds no transformer weights (first key {first!r}; expected keys like "
            f"'{PREFIX}transformer_blocks.0.attn.to_q.lora_A.weight'): is it a Qwen-Image LoRA?"
        )
    modules = dict(transformer.named_modules())
    ranks: dict[str, int] = {}
    for key in keys:
        module_name, sep, rest = key[len(PREFIX) :].partition(".lora_")
        if not sep or rest not in ("A.weight", "B.weight", "B.bias"):
            continue  # DoRA magnitudes and the like: left to diffusers
        module = modules.get(module_name)
        if module is None:
            raise ModelLoadError(
                f"LoRA {str(file)!r} does not fit this model: key {key!r} names module {module_name!r}, "
                "which the transformer does not have (a LoRA for another model?)"
            )
        base = getattr(module, "base_layer", module)  # a module that already carries a LoRA wraps its base
        if not hasattr(base, "in_features"):
            raise ModelLoadError(
                f"LoRA {str(file)!r} does not fit this model: key {key!r} targets {module_name!r}, "
                f"a {type(base).__name__}, not a linear layer"
            )
        _check_shape(key, tuple(state[key].shape), rest, base, ranks, module_name, file)


def _check_shape(key, shape, rest, base, ranks, module_name, file) -> None:
    where = f"LoRA {str(file)!r} does not fit this model: key {key!r} has shape {shape}"
    if rest == "B.bias":
        if shape != (base.out_features,):
            raise ModelLoadError(f"{where}, expected ({base.out_features},)")
        return
    if len(shape) != 2:
        raise ModelLoadError(f"{where}, expected a matrix")
    # lora_A is (rank, in_features), lora_B is (out_features, rank).
    if rest == "A.weight":
        rank, size, side, expected = shape[0], shape[1], "in", base.in_features
    else:
        rank, size, side, expected = shape[1], shape[0], "out", base.out_features
    if size != expected:
        raise ModelLoadError(
            f"{where}, but {module_name} has {expected} {side}put features "
            f"(in={base.in_features}, out={base.out_features})"
        )
    other = ranks.setdefault(module_name, rank)
    if other != rank:
        raise ModelLoadError(
            f"LoRA {str(file)!r} is inconsistent: key {key!r} has rank {rank}, the other half of "
            f"{module_name} has rank {other}"
        )


def load_lora(transformer: Any, path: str | Path, scale: float = 1.0, adapter_name: str = "default") -> Path:
    """Load a diffusers-format LoRA (file or folder) into `transformer` as `adapter_name`, weighted `scale`.

    An adapter already loaded under the same name is replaced.

    Returns:
        The file loaded.

    Raises:
        ModelLoadError: a missing or unreadable file, or a LoRA that does not fit the transformer.
    """
    state, metadata, file = read_lora(path)
    check_lora_fits(transformer, state, file)
    if adapter_name in getattr(transformer, "peft_config", {}):
        transformer.delete_adapters(adapter_name)
    try:
        transformer.load_lora_adapter(state, prefix="transformer", adapter_name=adapter_name, metadata=metadata)
    except (ValueError, RuntimeError, TypeError, KeyError) as e:
        raise ModelLoadError(f"cannot load LoRA {str(file)!r} into the transformer: {e}") from None
    transformer.set_adapters([adapter_name], weights=[float(scale)])
    return file


def merge_lora(transformer: Any) -> Any:
    """Fuse the active LoRA(s), at their set weights, into the base weights and remove the LoRA layers."""
    if not getattr(transformer, "peft_config", None):
        raise ModelLoadError("no LoRA is loaded into the transformer: nothing to merge")
    transformer.fuse_lora(lora_scale=1.0)  # the weight given to load_lora is already in each layer's scaling
    transformer.unload_lora()
    return transformer


def save_transformer(transformer: Any, folder: str | Path) -> Path:
    """Save the (merged) transformer as a diffusers model folder `folder/transformer`."""
    out = Path(folder) / "transformer"
    transformer.save_pretrained(out)
    return out
