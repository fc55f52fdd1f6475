"""Training state as safetensors + JSON, never pickle: optimizer and LR scheduler state dicts, RNG states.

A state dict is a tree of dicts, lists, tuples, numbers, strings and tensors. `save_tree` writes its
tensors to `<name>.safetensors` and the rest to `<name>.json`, where each tensor is `{"__tensor__": "3"}`,
a tuple `{"__tuple__": [...]}` and a dict with keys that are not strings (an optimizer's per-parameter
state) `{"__items__": [[key, value], ...]}`. `load_tree` reads them back with `json` and `safetensors`:
nothing on that road can run code.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.torch
import torch


def save_tree(tree: Any, folder: Path, name: str) -> None:
    """Write `tree` as `folder/<name>.json` and `folder/<name>.safetensors`."""
    tensors: dict[str, torch.Tensor] = {}
    doc = _encode(tree, tensors)
    safetensors.torch.save_file(tensors, str(folder / f"{name}.safetensors"))
    (folder / f"{name}.json").write_text(json.dumps(doc))


def load_tree(folder: Path, name: str, device: str = "cpu") -> Any:
    """The tree `save_tree` wrote.

    Raises:
        OSError, ValueError (json, safetensors) or KeyError: a missing or damaged file.
    """
    tensors = safetensors.torch.load_file(str(folder / f"{name}.safetensors"), device=device)
    return _decode(json.loads((folder / f"{name}.json").read_text()), tensors)


def _encode(x: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(x, torch.Tensor):
        key = str(len(tensors))
        tensors[key] = x.detach().cpu().contiguous().clone()
        return {"__tensor__": key}
    if isinstance(x, np.ndarray):
        return {"__ndarray__": _encode(torch.from_numpy(x.copy()), tensors), "dtype": str(x.dtype)}
    if isinstance(x, dict):
        if all(isinstance(k, str) for k in x):
            return {k: _encode(v, tensors) for k, v in x.items()}
        return {"__items__": [[_encode(k, tensors), _encode(v, tensors)] for k, v in x.items()]}
    if isinstance(x, tuple):
        return {"__tuple__": [_encode(v, tensors) for v in x]}
    if isinstance(x, list):
        return [_encode(v, tensors) for v in x]
    if isinstance(x, (np.integer, np.floating)):
        return x.item()
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    raise TypeError(f"training state holds a {type(x).__name__} ({x!r}): not storable as JSON or safetensors")


def _decode(x: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(x, list):
        return [_decode(v, tensors) for v in x]
    if not isinstance(x, dict):
        return x
    if "__tensor__" in x:
        return tensors[x["__tensor__"]]
    if "__ndarray__" in x:
        return _decode(x["__ndarray__"], tensors).numpy().astype(x["dtype"])
    if "__tuple__" in x:
        return tuple(_decode(v, tensors) for v in x["__tuple__"])
    if "__items__" in x:
        return {_decode(k, tensors): _decode(v, tensors) for k, v in x["__items__"]}
    return {k: _decode(v, tensors) for k, v in x.items()}


def rng_state() -> dict:
    """This process's random number generators: Python's, numpy's, torch's (CPU and each CUDA device)."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """Restore what `rng_state` gave.

    Raises:
        KeyError, TypeError, ValueError, RuntimeError: a state that is incomplete or does not fit.
    """
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if torch.cuda.is_available() and "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])
