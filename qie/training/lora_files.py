"""LoRA files that every tool applies at the trained strength.

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
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file

COMFYUI_FILE = "comfyui_lora.safetensors"
KOHYA_FILE = "kohya_lora.safetensors"
EXPORT_FILES = {"comfyui": COMFYUI_FILE, "kohya": KOHYA_FILE}


def module_of(key: str) -> tuple[str, str]:
    """(module name, rest) of a peft key: `a.b.lora_A.weight` -> (`a.b`, `A.weight`)."""
    module, _, rest = key.partition(".lora_")
    return module, rest


def lora_scales(transformer: torch.nn.Module, adapter: str = "default") -> dict[str, float]:
    """Per adapted module, the factor peft multiplies its LoRA output by (alpha / rank, rank patterns and
    rsLoRA included)."""
    return {
        name: float(m.scaling[adapter])
        for name, m in transformer.named_modules()
        if isinstance(getattr(m, "scaling", None), dict) and adapter in m.scaling
    }


def fold_scales(state: dict[str, torch.Tensor], scales: dict[str, float]) -> dict[str, torch.Tensor]:
    """`state` (peft keys) with each module's scale multiplied into its `lora_B` weight and bias, so that the
    pair applied at 1.0 gives the trained weight change. Other tensors (DoRA magnitudes) are unchanged."""
    out = {}
    for key, value in state.items():
        module, rest = module_of(key)
        scale = scales.get(module, 1.0)
        out[key] = (value * scale).to(value.dtype) if rest.startswith("B.") and scale != 1.0 else value
    return out


def folded_metadata(metadata: dict | None) -> dict | None:
    """The adapter metadata of a folded file: alpha equal to each module's rank (scale 1)."""
    if metadata is None:
        return None
    ranks = dict(metadata.get("rank_pattern") or {})
    alphas = {k: ranks.get(k, metadata["r"]) for k in metadata.get("alpha_pattern") or {}}
    return {**metadata, "lora_alpha": float(metadata["r"]), "alpha_pattern": {**alphas, **ranks}}


def _pairs(folded: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """Module name -> {"down": A, "up": B, ...} of a folded peft state."""
    by_module: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in folded.items():
        module, rest = module_of(key)
        name = {"A.weight": "down", "B.weight": "up", "B.bias": "up_bias"}.get(rest)
        if name is not None:
            by_module.setdefault(module, {})[name] = value
    return by_module


def _named_state(folded: dict[str, torch.Tensor], name) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for module, parts in _pairs(folded).items():
        base = name(module)
        out[f"{base}.lora_down.weight"] = parts["down"]
        out[f"{base}.lora_up.weight"] = parts["up"]
        # alpha = rank: the folded pair is applied at 1.0 by tools that read alpha and by those that do not.
        out[f"{base}.alpha"] = torch.tensor(float(parts["down"].shape[0]))
        if "up_bias" in parts:
            out[f"{base}.diff_b"] = parts["up_bias"]  # ComfyUI's name for a bias change
    return out


def comfyui_state(folded: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """ComfyUI's keys: `diffusion_model.<module>.lora_down.weight`, `.lora_up.weight` and `.alpha`."""
    return _named_state(folded, lambda module: f"diffusion_model.{module}")


def kohya_state(folded: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """kohya / musubi-tuner keys: `lora_unet_<module, dots as underscores>.lora_down.weight`, ... `.alpha`."""
    return _named_state(folded, lambda module: "lora_unet_" + module.replace(".", "_"))


def write_exports(folder: Path, folded: dict[str, torch.Tensor], exports: Sequence[str]) -> list[Path]:
    """Write the files `exports` names ("comfyui", "kohya") of a folded state into `folder`."""
    builders = {"comfyui": comfyui_state, "kohya": kohya_state}
    written = []
    for name in exports:
        path = folder / EXPORT_FILES[name]
        save_file(builders[name](folded), str(path))
        written.append(path)
    return written
