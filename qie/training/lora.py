"""LoRA adapters on the transformer (peft), and their export in diffusers and ComfyUI key formats."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file

LORA_FILE = "pytorch_lora_weights.safetensors"
COMFYUI_FILE = "comfyui_lora.safetensors"


def _init_value(init: str) -> bool | str:
    return {"true": True, "false": False}.get(init.lower(), init)


def add_lora(
    transformer: torch.nn.Module,
    rank: int,
    alpha: int,
    target_modules: Sequence[str],
    dropout: float = 0.0,
    init: str = "true",
) -> list[torch.nn.Parameter]:
    """Add a trainable LoRA adapter to `transformer` (whose own weights stay frozen).

    Returns:
        The LoRA parameters, in float32 whatever the base dtype (an optimizer needs full precision).
    """
    from peft import LoraConfig

    dead = dead_modules(transformer)
    # Exclude only what would be targeted (peft warns about unused exclusions), submodules included.
    exclude = [
        name
        for name, _ in transformer.named_modules()
        if any(name == d or name.startswith(f"{d}.") for d in dead)
        and any(name == t or name.endswith(f".{t}") for t in target_modules)
    ]
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        lora_dropout=dropout,
        init_lora_weights=_init_value(init),
        target_modules=list(target_modules),
        exclude_modules=exclude or None,
    )
    transformer.add_adapter(config)
    params = [p for n, p in transformer.named_parameters() if "lora_" in n]
    for p in params:
        p.data = p.data.float()
        p.requires_grad_(True)
    return params


def dead_modules(transformer: torch.nn.Module) -> list[str]:
    """Modules whose output never reaches the loss: the last block's text queries and text outputs.

    The transformer returns image tokens only, and in joint attention text queries only make text outputs,
    so in the last block these get no (or an all-zero) gradient. Trained weights without a gradient stop
    DDP ("parameters that were not used in producing loss"); a LoRA on them would stay at its initial
    value, and weight decay would shrink them for nothing.
    """
    blocks = getattr(transformer, "transformer_blocks", None)
    if not blocks:
        return []
    last = f"transformer_blocks.{len(blocks) - 1}"
    dead = ("attn.add_q_proj", "attn.norm_added_q", "attn.to_add_out", "txt_mlp")
    names = dict(transformer.named_modules())
    return [f"{last}.{n}" for n in dead if f"{last}.{n}" in names]


def lora_state_dict(transformer: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's weights with peft's keys (`transformer_blocks.0.attn.to_q.lora_A.weight`, ...)."""
    from peft.utils import get_peft_model_state_dict

    return {k: v.detach().cpu().clone().contiguous() for k, v in get_peft_model_state_dict(transformer).items()}


def load_lora_state(transformer: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Put saved adapter weights back (resume)."""
    from peft.utils import set_peft_model_state_dict

    result = set_peft_model_state_dict(transformer, state)
    unexpected = getattr(result, "unexpected_keys", None)
    if unexpected:
        raise KeyError(f"LoRA weights do not fit the model: unexpected key {unexpected[0]!r}")


def save_lora(
    transformer: torch.nn.Module, folder: Path, comfyui: bool = False, dtype: torch.dtype | None = None
) -> Path:
    """Write the adapter as `pytorch_lora_weights.safetensors` (loads with `load_lora_weights`)."""
    from diffusers import QwenImageEditPipeline

    state = lora_state_dict(transformer)
    if dtype is not None:
        state = {k: v.to(dtype) for k, v in state.items()}
    folder.mkdir(parents=True, exist_ok=True)
    QwenImageEditPipeline.save_lora_weights(
        folder,
        transformer_lora_layers=state,
        safe_serialization=True,
        transformer_lora_adapter_metadata=adapter_metadata(transformer),
    )
    if comfyui:
        rank_alpha = _alpha_of(transformer)
        save_file(comfyui_state(state, rank_alpha), str(folder / COMFYUI_FILE))
    return folder / LORA_FILE


def adapter_metadata(transformer: torch.nn.Module) -> dict | None:
    """Rank, alpha and targets saved with the weights: without them a loader assumes alpha == rank."""
    config = getattr(transformer, "peft_config", {}).get("default")
    if config is None:
        return None
    return {
        "r": int(config.r),
        "lora_alpha": float(config.lora_alpha),
        "lora_dropout": float(config.lora_dropout),
        "target_modules": sorted(config.target_modules),
        "rank_pattern": dict(config.rank_pattern or {}),
        "alpha_pattern": dict(config.alpha_pattern or {}),
    }


def _alpha_of(transformer: torch.nn.Module) -> float | None:
    config = getattr(transformer, "peft_config", {}).get("default")
    return float(config.lora_alpha) if config is not None else None


def comfyui_state(state: dict[str, torch.Tensor], alpha: float | None) -> dict[str, torch.Tensor]:
    """ComfyUI's LoRA keys: `diffusion_model.<module>.lora_down/lora_up.weight` and `.alpha` per module."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        module, _, rest = key.partition(".lora_")
        kind = "lora_down" if rest.startswith("A") else "lora_up"
        out[f"diffusion_model.{module}.{kind}.weight"] = value
        if alpha is not None and kind == "lora_down":
            out[f"diffusion_model.{module}.alpha"] = torch.tensor(alpha)
    return out
