"""Adapter files that every tool applies at the trained strength.

peft scales a LoRA pair by `alpha / rank`. diffusers reads that scale from the file's metadata; ComfyUI,
ai-toolkit and musubi-tuner read only per-module `alpha` tensors and apply 1.0 without them; kohya-style
trainers (musubi-tuner) read only `lora_unet_…` keys. So every file written here holds weights with the
scale folded into `lora_B` (the up matrix): the diffusers file says alpha = rank in its metadata, the
ComfyUI and kohya files carry `alpha` = rank tensors. Any tool, whether it honours alpha or not, then
applies exactly the weight change the model was trained with.

Files (beside `pytorch_lora_weights.safetensors`, the diffusers one):
- `comfyui_lora.safetensors`: `diffusion_model.<module>.lora_down.weight / .lora_up.weight / .alpha`
  (ComfyUI; DiffSynth-Studio).
- `kohya_lora.safetensors`: `lora_unet_<module with dots as underscores>.lora_down.weight / …` (musubi-tuner,
  kohya sd-scripts style loaders).
LoHa and LoKr keep their LyCORIS names (`.hada_w1_a`, `.lokr_w1`, ...) under the same prefixes; DoRA adds
`.dora_scale` (ComfyUI's name for the magnitude, converted to ComfyUI's formula).

Each file qie trains also names, in its safetensors header (`qie.fused_base`, JSON), the LoRAs fused into the base
it was trained on (`model.fuse_loras`: file name, content fingerprint, scale; `[]` for the plain base), so that
the file itself says which base it belongs to wherever it is copied. Other tools ignore the key.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from qie.adapters.kinds import folded_lycoris_metadata, split_key

COMFYUI_FILE = "comfyui_lora.safetensors"
KOHYA_FILE = "kohya_lora.safetensors"
EXPORT_FILES = {"comfyui": COMFYUI_FILE, "kohya": KOHYA_FILE}
BASE_KEY = "qie.fused_base"


def base_header(record: Sequence[dict] | None) -> dict[str, str] | None:
    """The safetensors header entry naming the fused base `record` (None: none written)."""
    return None if record is None else {BASE_KEY: json.dumps(list(record), sort_keys=True)}


def stamp_base(file: Path, record: Sequence[dict] | None) -> None:
    """Add the fused base `record` to the header of the safetensors `file` (kept as it is when None)."""
    from safetensors import safe_open

    if record is None:
        return
    with safe_open(str(file), "pt") as f:
        metadata = f.metadata() or {}
    save_file(load_file(str(file)), str(file), metadata={**metadata, **base_header(record)})


def recorded_base(file: Path) -> list[dict] | None:
    """The fused base a LoRA `file` names in its header (`[]`: the plain base), or None when it names none (a file
    from another tool, or from before qie kept the record)."""
    from safetensors import safe_open

    if file.suffix != ".safetensors":
        return None
    try:
        with safe_open(str(file), "pt") as f:
            text = (f.metadata() or {}).get(BASE_KEY)
        return None if text is None else list(json.loads(text))
    except Exception:  # an unreadable header: the LoRA reader proper says why, where it reads the file
        return None


def lora_scales(transformer: torch.nn.Module, adapter: str = "default") -> dict[str, float]:
    """Per adapted module, the factor peft multiplies its adapter's output by (alpha / rank, rank patterns and
    rsLoRA included; the same for LoHa and LoKr)."""
    return {
        name: float(m.scaling[adapter])
        for name, m in transformer.named_modules()
        if isinstance(getattr(m, "scaling", None), dict) and adapter in m.scaling
    }


# The one factor of each kind that carries the scale: multiplying it scales the weight change linearly.
_FOLD_INTO = ("lora_B.weight", "lora_B.bias", "hada_w1_a", "lokr_w1", "lokr_w1_a")


def fold_scales(state: dict[str, torch.Tensor], scales: dict[str, float]) -> dict[str, torch.Tensor]:
    """`state` (peft names) with each module's scale multiplied into one factor of its weight change (LoRA's
    up matrix and bias, LoHa's `hada_w1_a`, LoKr's `lokr_w1`), so that it applied at 1.0 gives the trained
    change. DoRA magnitudes are unchanged (DoRA normalises the scaled change, which folding keeps)."""
    out = {}
    for key, value in state.items():
        module, part = split_key(key) or (key, "")
        scale = scales.get(module, 1.0)
        out[key] = (value * scale).to(value.dtype) if part in _FOLD_INTO and scale != 1.0 else value
    return out


def folded_metadata(metadata: dict | None) -> dict | None:
    """The adapter metadata of a folded file: alpha equal to each module's rank (scale 1)."""
    if metadata is None:
        return None
    if "lora_alpha" not in metadata:
        return folded_lycoris_metadata(metadata)
    ranks = dict(metadata.get("rank_pattern") or {})
    alphas = {k: ranks.get(k, metadata["r"]) for k in metadata.get("alpha_pattern") or {}}
    return {**metadata, "lora_alpha": float(metadata["r"]), "alpha_pattern": {**alphas, **ranks}}


def _by_module(folded: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """Module name -> {part: tensor} of a folded peft state."""
    by_module: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in folded.items():
        if found := split_key(key):
            by_module.setdefault(found[0], {})[found[1]] = value
    return by_module


def _module_tensors(parts: dict[str, torch.Tensor], dora_scale: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """One module's tensors under ComfyUI / LyCORIS / kohya names (without the module prefix)."""
    if "lora_A.weight" in parts:
        out = {"lora_down.weight": parts["lora_A.weight"], "lora_up.weight": parts["lora_B.weight"]}
        # alpha = rank: the folded pair is applied at 1.0 by tools that read alpha and by those that do not.
        rank = parts["lora_A.weight"].shape[0]
        if "lora_B.bias" in parts:
            out["diff_b"] = parts["lora_B.bias"]  # ComfyUI's name for a bias change
        if dora_scale is not None:
            out["dora_scale"] = dora_scale
    else:  # LoHa / LoKr: peft's names are LyCORIS' names
        out = dict(parts)
        # ComfyUI divides alpha by the inner size of the last decomposed factor (LoKr: none, then 1.0).
        inner = next((parts[p].shape[0] for p in ("hada_w1_b", "lokr_w2_b", "lokr_w1_b") if p in parts), None)
        rank = inner
    if rank is not None:
        out["alpha"] = torch.tensor(float(rank))
    return out


def _named_state(folded, name, dora_scales) -> dict[str, torch.Tensor]:
    return {
        f"{name(module)}.{part}": value
        for module, parts in _by_module(folded).items()
        for part, value in _module_tensors(parts, dora_scales.get(module)).items()
    }


def dora_scales(transformer: torch.nn.Module, folded: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per DoRA module, the `dora_scale` that makes ComfyUI's DoRA give peft's weight.

    peft's DoRA weight is m * (W + dW) / ||W + dW|| (norms per output row); ComfyUI, given a per-output
    `dora_scale` d, computes d * (W + dW) / ||W||. So d = m * ||W|| / ||W + dW||, with W this base model's.
    """
    from qie.runtime.memory import full_tensor  # FSDP2 shards the base weights

    out = {}
    modules = dict(transformer.named_modules())
    for module, parts in _by_module(folded).items():
        magnitude = parts.get("lora_magnitude_vector", parts.get("lora_magnitude_vector.weight"))
        if magnitude is None:
            continue
        base = modules[module].get_base_layer().weight
        weight = full_tensor(base.dequantize() if hasattr(base, "dequantize") else base).detach().float().cpu()
        change = parts["lora_B.weight"].float() @ parts["lora_A.weight"].float()
        norm, new_norm = weight.norm(dim=1), (weight + change).norm(dim=1)
        out[module] = (magnitude.float() * norm / new_norm).reshape(-1, 1).to(magnitude.dtype)
    return out


def comfyui_state(folded: dict[str, torch.Tensor], dora: dict | None = None) -> dict[str, torch.Tensor]:
    """ComfyUI's keys: `diffusion_model.<module>.lora_down.weight`, `.lora_up.weight`, `.alpha` (LoHa / LoKr:
    `.hada_w1_a`, ..., `.lokr_w1`, ...; DoRA: `.dora_scale`)."""
    return _named_state(folded, lambda module: f"diffusion_model.{module}", dora or {})


def kohya_state(folded: dict[str, torch.Tensor], dora: dict | None = None) -> dict[str, torch.Tensor]:
    """kohya / musubi-tuner keys: `lora_unet_<module, dots as underscores>.lora_down.weight`, ... `.alpha`."""
    return _named_state(folded, lambda module: "lora_unet_" + module.replace(".", "_"), dora or {})


def write_exports(
    folder: Path,
    folded: dict[str, torch.Tensor],
    exports: Sequence[str],
    dora: dict | None = None,
    base: Sequence[dict] | None = None,
) -> list[Path]:
    """Write the files `exports` names ("comfyui", "kohya") of a folded state into `folder`, naming the fused
    `base` (`stamp_base`) in their headers."""
    builders = {"comfyui": comfyui_state, "kohya": kohya_state}
    written = []
    for name in exports:
        path = folder / EXPORT_FILES[name]
        save_file(builders[name](folded, dora), str(path), metadata=base_header(base))
        written.append(path)
    return written
