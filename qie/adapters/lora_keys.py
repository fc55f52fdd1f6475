"""A LoRA key as its file writes it.

diffusers' loaders convert other tools' layouts (ComfyUI, kohya, ai-toolkit) to diffusers' keys, and guess a
module name from a flattened one: a kohya file for another model (`lora_unet_double_blocks_0_img_attn_qkv`)
becomes `transformer_blocks..attn.qkv`, a name the file never held. A message about a key that does not fit
names the file's own key, found by converting the file's modules one at a time until one gives the key.
"""

from __future__ import annotations

from pathlib import Path

# The role of a converted key's half and the names other layouts give it.
_ROLES = {
    "lora_A.weight": ("lora_A.", "lora_down."),
    "lora_B.weight": ("lora_B.", "lora_up."),
    "lora_B.bias": ("lora_B.", "lora_up."),
}


def _module_of(key: str) -> str:
    """The module part of a file's key: before `.lora_`, else before its last dot (`.alpha`, `.dora_scale`)."""
    if ".lora_" in key:
        return key.partition(".lora_")[0]
    return key.rpartition(".")[0] or key


def key_in_file(file: str | Path, loader: type, key: str) -> str:
    """The key of LoRA `file` that `loader` (a diffusers LoRA loader) reads as `key`; `key` itself when the file
    holds it or no module of the file converts to it (an unreadable file included)."""
    from safetensors import safe_open

    try:
        with safe_open(str(file), "pt") as f:
            names = list(f.keys())
            if key in names:
                return key
            modules: dict[str, list[str]] = {}
            for name in names:
                modules.setdefault(_module_of(name), []).append(name)
            for group in modules.values():
                try:
                    converted = loader.lora_state_dict({name: f.get_tensor(name) for name in group})
                except Exception:  # a module another layout's converter cannot take alone: not this one
                    continue
                if key in converted:
                    return _same_role(group, key)
    except Exception:  # the key as read is still the best that can be said
        return key
    return key


def _same_role(group: list[str], key: str) -> str:
    """The key of `group` (one module's keys) in the role `key` has (the down or up half), else its first."""
    roles = next((names for end, names in _ROLES.items() if key.endswith(end)), ())
    return next((name for name in group for role in roles if role in name), group[0])
