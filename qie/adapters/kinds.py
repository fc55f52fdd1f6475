"""The adapter kinds qie trains through peft: LoRA (optionally DoRA), LoHa and LoKr.

`train.adapter` picks the kind; `train.lora.rank` / `alpha` / `target_modules` size it for every kind. A saved
adapter keeps peft's tensor names (`<module>.lora_A.weight`, `.lora_magnitude_vector`, `.hada_w1_a`, `.lokr_w1`,
...), which are also LyCORIS' names for LoHa and LoKr, so one parser serves saving, exporting and loading.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from qie.errors import ModelLoadError

# A parameter of an adapter (what training unfreezes), by peft's attribute names.
PARAM_MARKERS = ("lora_", "hada_", "lokr_")
_PART = re.compile(
    r"^(?P<module>.+?)\.(?P<part>lora_A\.weight|lora_B\.weight|lora_B\.bias|lora_magnitude_vector(?:\.weight)?"
    r"|hada_w[12]_[ab]|hada_t[12]|lokr_w[12](?:_[ab])?|lokr_t2)$"
)


def split_key(key: str) -> tuple[str, str] | None:
    """(module, part) of an adapter tensor name (`a.b.hada_w1_a` -> (`a.b`, `hada_w1_a`)); None for others."""
    found = _PART.match(key)
    return (found["module"], found["part"]) if found else None


def kind_of(keys: Sequence[str]) -> str:
    """ "loha", "lokr" or "lora": the kind whose tensors `keys` hold."""
    parts = [p[1] for k in keys if (p := split_key(k))]
    if any(p.startswith("hada_") for p in parts):
        return "loha"
    if any(p.startswith("lokr_") for p in parts):
        return "lokr"
    return "lora"


def is_adapter_param(name: str) -> bool:
    """True for a parameter of an adapter (of any kind) in `named_parameters()`."""
    return any(marker in name for marker in PARAM_MARKERS)


def peft_config(
    kind: str,
    rank: int,
    alpha: float,
    target_modules: Sequence[str],
    exclude: Sequence[str] | None = None,
    dropout: float = 0.0,
    init: bool | str = True,
    use_dora: bool = False,
) -> Any:
    """The peft config of an adapter of `kind` ("lora", "loha", "lokr")."""
    from peft import LoHaConfig, LoKrConfig, LoraConfig

    common = {"r": rank, "target_modules": list(target_modules), "exclude_modules": list(exclude or []) or None}
    if kind == "lora":
        return LoraConfig(lora_alpha=alpha, lora_dropout=dropout, init_lora_weights=init, use_dora=use_dora, **common)
    cls = LoHaConfig if kind == "loha" else LoKrConfig
    return cls(alpha=alpha, init_weights=bool(init), **common)


def lycoris_metadata(config: Any, modules: Sequence[str]) -> dict:
    """A LoHa / LoKr config as JSON-able metadata, its targets the exact module names adapted."""
    data = {k: v for k, v in config.to_dict().items() if isinstance(v, (str, int, float, bool, list, dict, set))}
    data["target_modules"] = sorted(modules)
    data.pop("exclude_modules", None)
    return json.loads(json.dumps(data, default=list))


def folded_lycoris_metadata(metadata: dict) -> dict:
    """The metadata of a LoHa / LoKr whose scale is folded into its weights: alpha = rank."""
    ranks = dict(metadata.get("rank_pattern") or {})
    alphas = {k: ranks.get(k, metadata["r"]) for k in metadata.get("alpha_pattern") or {}}
    return {**metadata, "alpha": float(metadata["r"]), "alpha_pattern": {**alphas, **ranks}}


def load_lycoris(
    transformer: Any, state: dict[str, torch.Tensor], metadata: dict | None, adapter_name: str, file: Path
) -> None:
    """Load a LoHa / LoKr saved by qie (peft names under `transformer.`, its config in the metadata).

    Raises:
        ModelLoadError: the file has no adapter config, or its weights do not fit the transformer.
    """
    from peft import LoHaConfig, LoKrConfig
    from peft.utils import set_peft_model_state_dict

    kind = kind_of(list(state))
    prefix = "transformer."
    config_fields = dict(metadata or {})
    config_fields = {k.removeprefix(prefix): v for k, v in config_fields.items()}
    if "r" not in config_fields:
        raise ModelLoadError(
            f"{kind} file {str(file)!r} holds no adapter config (rank, alpha) in its metadata: "
            "qie loads the LoHa / LoKr files it wrote"
        )
    cls = LoHaConfig if kind == "loha" else LoKrConfig
    names = {f.name for f in dataclasses.fields(cls)} - {"peft_type"}
    weights = {k.removeprefix(prefix): v for k, v in state.items() if k.startswith(prefix)}
    modules = sorted({p[0] for k in weights if (p := split_key(k))})
    config = cls(**{**{k: v for k, v in config_fields.items() if k in names}, "target_modules": modules})
    try:
        transformer.add_adapter(config, adapter_name=adapter_name)
        result = set_peft_model_state_dict(transformer, weights, adapter_name=adapter_name)
    except (ValueError, RuntimeError, TypeError, KeyError) as e:
        raise ModelLoadError(f"cannot load {kind} {str(file)!r} into the transformer: {e}") from None
    unexpected = [k for k in getattr(result, "unexpected_keys", []) or [] if is_adapter_param(k)]
    if unexpected:
        raise ModelLoadError(f"{kind} {str(file)!r} does not fit the transformer: unexpected key {unexpected[0]!r}")


def refuse_exported_kinds(file: Path) -> None:
    """Raise ModelLoadError for a ComfyUI / kohya file of a DoRA, LoHa or LoKr: diffusers, which reads those
    formats for qie, would drop the DoRA magnitudes (a different model, silently) or fail on LyCORIS names."""
    from safetensors import safe_open

    if file.suffix != ".safetensors":
        return
    try:
        with safe_open(str(file), "pt") as f:
            keys = list(f.keys())
    except Exception:  # not readable here: the reader proper says why
        return
    if any(k.startswith(("transformer.", "base_model.")) for k in keys):
        return
    kind = "DoRA" if any(k.endswith(".dora_scale") for k in keys) else kind_of(keys)
    if kind != "lora":
        raise ModelLoadError(
            f"{str(file)!r} is a {kind} in ComfyUI / kohya form, which qie does not read: load the "
            "pytorch_lora_weights.safetensors written beside it"
        )
