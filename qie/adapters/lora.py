"""LoRA adapters on the transformer (peft): adding, saving (diffusers format; the ComfyUI and kohya files are
in `qie.adapters.lora_files`), loading, fusing.

Loading goes through diffusers' own `lora_state_dict` (which also converts ComfyUI / kohya key formats)
and the transformer's `load_lora_adapter`, so a LoRA behaves here exactly as in a diffusers pipeline.
Before that, every key is checked against the model: diffusers silently ignores a LoRA with no
transformer keys and fails deep inside peft on a shape mismatch, both unhelpful to a user.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from qie.adapters.kinds import (
    is_adapter_param,
    kind_of,
    load_lycoris,
    lycoris_metadata,
    peft_config,
    refuse_exported_kinds,
    split_key,
)
from qie.adapters.lora_files import dora_scales, fold_scales, folded_metadata, lora_scales, stamp_base, write_exports
from qie.adapters.lora_keys import key_in_file
from qie.errors import ModelLoadError
from qie.models import family_of

LORA_FILE = "pytorch_lora_weights.safetensors"
PREFIX = "transformer."


def _init_value(init: str) -> bool | str:
    return {"true": True, "false": False}.get(init.lower(), init)


def check_lora_file(path: str | Path, loader: type) -> Path:
    """Read the LoRA file `path` names (any format `load_lora` reads, through the model family's `loader`) and
    check it holds transformer weights.

    Raises:
        ModelLoadError: a missing or unreadable file, or one without transformer weights.
    """
    state, _, file = read_lora(path, loader)
    if not any(k.startswith(PREFIX) for k in state):
        first = next(iter(state), None)
        raise ModelLoadError(
            f"LoRA {str(file)!r} holds no transformer weights (first key {first!r}): is it a Qwen-Image LoRA?"
        )
    return file


def lora_parameters(transformer: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The adapter's parameters made trainable in float32 (an optimizer needs full precision); those of modules
    whose output never reaches the loss (`dead_modules`) stay frozen."""
    dead = tuple(f"{d}." for d in dead_modules(transformer))
    params = []
    for name, p in transformer.named_parameters():
        if is_adapter_param(name):
            p.data = p.data.float()
            p.requires_grad_(not name.startswith(dead))
            params += [p] if p.requires_grad else []
    return params


def add_lora(
    transformer: torch.nn.Module,
    rank: int,
    alpha: int,
    target_modules: Sequence[str],
    dropout: float = 0.0,
    init: str = "true",
    adapter: str = "lora",
    use_dora: bool = False,
) -> list[torch.nn.Parameter]:
    """Add a trainable adapter to `transformer` (whose own weights stay frozen): a LoRA (DoRA with `use_dora`),
    or with `adapter` "loha" / "lokr" a LoHa / LoKr of the same rank and alpha.

    Returns:
        The adapter's parameters, in float32 whatever the base dtype (an optimizer needs full precision).
    """
    dead = dead_modules(transformer)
    # Exclude only what would be targeted (peft warns about unused exclusions), submodules included.
    exclude = [
        name
        for name, _ in transformer.named_modules()
        if any(name == d or name.startswith(f"{d}.") for d in dead)
        and any(name == t or name.endswith(f".{t}") for t in target_modules)
    ]
    config = peft_config(
        adapter,
        rank=rank,
        alpha=alpha,
        target_modules=target_modules,
        exclude=exclude,
        dropout=dropout,
        init=_init_value(init),
        use_dora=use_dora,
    )
    transformer.add_adapter(config)
    return lora_parameters(transformer)


def continue_lora(transformer: torch.nn.Module, path: str | Path) -> list[torch.nn.Parameter]:
    """Load the LoRA file `path` (any format `load_lora` reads) as the adapter to train on: its rank, alpha and
    modules are the file's. Returns its parameters, as `add_lora` does.

    Raises:
        ModelLoadError: the file does not fit the transformer.
    """
    load_lora(transformer, path)
    return lora_parameters(transformer)


def dead_modules(transformer: torch.nn.Module) -> list[str]:
    """Modules whose output never reaches the loss: the last block's text queries and text outputs.

    The transformer returns image tokens only, and in joint attention text queries only make text outputs,
    so in the last block these get no (or an all-zero) gradient. Trained weights without a gradient stop
    DDP ("parameters that were not used in producing loss"); a LoRA on them would stay at its initial
    value, and weight decay would shrink them for nothing.
    """
    family = family_of(transformer)
    blocks = getattr(transformer, family.blocks, None)
    if not blocks:
        return []
    last = f"{family.blocks}.{len(blocks) - 1}"
    names = dict(transformer.named_modules())
    return [f"{last}.{n}" for n in family.unused_in_last_block if f"{last}.{n}" in names]


def lora_state_dict(transformer: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's weights with peft's keys (`transformer_blocks.0.attn.to_q.lora_A.weight`, ...)."""
    from peft.utils import get_peft_model_state_dict

    from qie.runtime.memory import full_tensor  # FSDP2 shards: gathered, so every process must call this

    return {
        k: full_tensor(v.detach()).cpu().clone().contiguous() for k, v in get_peft_model_state_dict(transformer).items()
    }


def load_lora_state(transformer: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Put saved adapter weights back (resume)."""
    from peft.utils import set_peft_model_state_dict

    result = set_peft_model_state_dict(transformer, state)
    unexpected = getattr(result, "unexpected_keys", None)
    if unexpected:
        raise KeyError(f"LoRA weights do not fit the model: unexpected key {unexpected[0]!r}")


def save_lora(
    transformer: torch.nn.Module,
    folder: Path,
    exports: Sequence[str] = (),
    dtype: torch.dtype | None = None,
    state: dict[str, torch.Tensor] | None = None,
    base: Sequence[dict] | None = None,
) -> Path:
    """Write the adapter as `pytorch_lora_weights.safetensors` (loads with `load_lora_weights`), and the files
    `exports` names ("comfyui", "kohya"; `qie.adapters.lora_files`), all with alpha / rank folded into the
    weights so that every tool applies the trained strength.

    Args:
        state: the adapter's weights when already gathered (`lora_state_dict`), else read from `transformer`.
        base: the LoRAs fused into the base it was trained on (`FusedBase.record()`, `[]` for the plain base),
            named in every file's header; None names nothing.
    """
    state = lora_state_dict(transformer) if state is None else state
    if dtype is not None:
        state = {k: v.to(dtype) for k, v in state.items()}
    folded = fold_scales(state, lora_scales(transformer))
    dora = dora_scales(transformer, folded) if "comfyui" in exports or "kohya" in exports else None
    folder.mkdir(parents=True, exist_ok=True)
    family_of(transformer).lora_loader_class().save_lora_weights(
        folder,
        transformer_lora_layers=folded,
        safe_serialization=True,
        transformer_lora_adapter_metadata=folded_metadata(adapter_metadata(transformer)),
    )
    stamp_base(folder / LORA_FILE, base)
    write_exports(folder, folded, exports, dora, base)
    return folder / LORA_FILE


def adapter_metadata(transformer: torch.nn.Module) -> dict | None:
    """Rank, alpha and targets saved with the weights: without them a loader assumes alpha == rank."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    config = getattr(transformer, "peft_config", {}).get("default")
    if config is None:
        return None
    if not hasattr(config, "lora_alpha"):  # LoHa / LoKr
        modules = [n for n, m in transformer.named_modules() if isinstance(m, BaseTunerLayer)]
        return lycoris_metadata(config, modules)
    return {
        "r": int(config.r),
        "lora_alpha": float(config.lora_alpha),
        "lora_dropout": float(config.lora_dropout),
        # Module names, not the short patterns: a loader then adds the adapter exactly where weights exist
        # (not to the last block's excluded text side, which would make peft warn).
        "target_modules": sorted(n for n, m in transformer.named_modules() if hasattr(m, "lora_A")),
        "rank_pattern": dict(config.rank_pattern or {}),
        "alpha_pattern": dict(config.alpha_pattern or {}),
        "use_dora": bool(config.use_dora),
    }


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


def read_lora(path: str | Path, loader: type) -> tuple[dict[str, torch.Tensor], dict | None, Path]:
    """The LoRA state dict in diffusers format (keys `transformer.<module>.lora_A.weight`), its metadata, file,
    read by the model family's diffusers LoRA `loader` (`ModelFamily.lora_loader`: it converts other tools' key
    layouts).

    Raises:
        ModelLoadError: a missing or unreadable file, or one holding NaN or infinite values.
    """
    file = lora_file(path)
    refuse_exported_kinds(file)
    try:
        state, metadata = loader.lora_state_dict(str(file.parent), weight_name=file.name, return_lora_metadata=True)
    except Exception as e:  # safetensors, json and conversion errors all mean "cannot read this LoRA"
        raise ModelLoadError(f"cannot read LoRA {str(file)!r}: {e}") from None
    # A NaN adapter would turn every output black without an error: refuse it here, where every loader reads.
    bad = next((k for k, v in state.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())), None)
    if bad is not None:
        raise ModelLoadError(
            f"LoRA {str(file)!r} holds NaN or infinite values (first in {bad!r}): it was saved from a diverged "
            "run; use an earlier checkpoint's LoRA"
        )
    return state, metadata, file


def match_flattened_names(transformer: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` with module names guessed from kohya keys put right by the model's own names.

    A kohya key (`lora_unet_transformer_blocks_0_img_mlp_gate_layer`) flattens dots to underscores; diffusers
    turns them back with a list of known names and guesses wrong for others (`img_mlp.gate.layer`). The name
    whose flattened form is the same, and unique, in this transformer is the one meant.
    """
    modules = {n for n, _ in transformer.named_modules()}
    flat: dict[str, list[str]] = {}
    for name in modules:
        flat.setdefault(name.replace(".", "_"), []).append(name)
    out = {}
    for key, value in state.items():
        module, part = split_key(key[len(PREFIX) :]) or ("", "")
        candidates = flat.get(module.replace(".", "_"), [])
        if key.startswith(PREFIX) and part and module not in modules and len(candidates) == 1:
            key = f"{PREFIX}{candidates[0]}.{part}"
        out[key] = value
    return out


def check_lora_fits(
    transformer: torch.nn.Module, state: dict[str, torch.Tensor], file: str | Path, loader: type | None = None
) -> None:
    """Check that every LoRA key names a linear layer of `transformer` with matching sizes and one rank.

    Args:
        loader: the diffusers LoRA loader that read `state` from `file`: a key that does not fit is named as the
            file writes it (`key_in_file`), not as the loader converted it.

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
        base = getattr(module, "base_layer", module)  # a module that already carries a LoRA wraps its base
        if module is None:
            fault = f"names module {module_name!r}, which the transformer does not have (a LoRA for another model?)"
        elif not hasattr(base, "in_features"):
            fault = f"targets {module_name!r}, a {type(base).__name__}, not a linear layer"
        else:
            fault = _shape_fault(tuple(state[key].shape), rest, base, ranks, module_name)
        if fault:
            shown = key_in_file(file, loader, key) if loader is not None else key
            if module is None and shown != key:  # the module name is the loader's guess, not the file's
                fault = "names a module the transformer does not have (a LoRA for another model?)"
            verb = "is inconsistent" if fault.startswith("has rank") else "does not fit this model"
            raise ModelLoadError(f"LoRA {str(file)!r} {verb}: key {shown!r} {fault}")


def _shape_fault(shape: tuple[int, ...], rest: str, base: Any, ranks: dict[str, int], module_name: str) -> str | None:
    """Why a LoRA half of `shape` (`rest`: "A.weight", "B.weight", "B.bias") does not fit the linear layer `base`
    (`ranks`: the rank each module's other half had), or None."""
    where = f"has shape {shape}"
    if rest == "B.bias":
        return None if shape == (base.out_features,) else f"{where}, expected ({base.out_features},)"
    if len(shape) != 2:
        return f"{where}, expected a matrix"
    # lora_A is (rank, in_features), lora_B is (out_features, rank).
    if rest == "A.weight":
        rank, size, side, expected = shape[0], shape[1], "in", base.in_features
    else:
        rank, size, side, expected = shape[1], shape[0], "out", base.out_features
    if size != expected:
        return (
            f"{where}, but {module_name} has {expected} {side}put features "
            f"(in={base.in_features}, out={base.out_features})"
        )
    other = ranks.setdefault(module_name, rank)
    if other != rank:
        return f"has rank {rank}, the other half of {module_name} has rank {other}"
    return None


def load_lora(transformer: Any, path: str | Path, scale: float = 1.0, adapter_name: str = "default") -> Path:
    """Load a diffusers-format LoRA (file or folder) into `transformer` as `adapter_name`, weighted `scale`.

    An adapter already loaded under the same name is replaced.

    Returns:
        The file loaded.

    Raises:
        ModelLoadError: a missing or unreadable file, or a LoRA that does not fit the transformer.
    """
    loader = family_of(transformer).lora_loader_class()
    state, metadata, file = read_lora(path, loader)
    state = match_flattened_names(transformer, state)
    if kind_of(list(state)) != "lora":
        if adapter_name in getattr(transformer, "peft_config", {}):
            transformer.delete_adapters(adapter_name)
        load_lycoris(transformer, state, metadata, adapter_name, file)
        transformer.set_adapters([adapter_name], weights=[float(scale)])
        return file
    check_lora_fits(transformer, state, file, loader)
    if adapter_name in getattr(transformer, "peft_config", {}):
        transformer.delete_adapters(adapter_name)
    if metadata and f"{PREFIX}target_modules" in metadata:
        # The saved targets are short names ("to_q"); modules they match that the file has no weights for
        # (the last block's text side, left out in training) would get an idle adapter and a peft warning.
        modules = {k[len(PREFIX) :].partition(".lora_")[0] for k in state if k.startswith(PREFIX)}
        metadata = {**metadata, f"{PREFIX}target_modules": sorted(modules)}
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
