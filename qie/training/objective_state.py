"""What an objective keeps in a checkpoint besides the trained weights (`ObjectiveContext.keep`: DiffusionNFT's frozen
copy of the sampling policy, its step count), written as `state/objective.safetensors` and restored in place when a
run resumes, so that a resumed run goes on as if it had never stopped."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import safetensors.torch
import torch

from qie.errors import ModelLoadError
from qie.training.checkpoint import STATE_DIR

FILE = "objective.safetensors"


def write_kept(folder: Path, kept: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
    """Write what the objective keeps into the checkpoint `folder` (nothing when it keeps nothing)."""
    if not kept:
        return
    tensors = {
        f"{name}/{key}": t.detach().to("cpu").contiguous().clone() for name, ts in kept.items() for key, t in ts.items()
    }
    safetensors.torch.save_file(tensors, str(folder / STATE_DIR / FILE))


def restore_kept(folder: Path, kept: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
    """Put what the checkpoint `folder` kept of the objective back into `kept`'s tensors (in place).

    Raises:
        ModelLoadError: the checkpoint keeps no such state, or other tensors, or non-finite ones (naming it).
    """
    if not kept:
        return
    path = folder / STATE_DIR / FILE
    if not path.is_file():
        raise ModelLoadError(
            f"checkpoint {folder} keeps no state of the objective ({STATE_DIR}/{FILE}), which train.objective keeps "
            "to resume exactly: it was saved by a run of another objective; resume with that objective, or start "
            "without train.resume"
        )
    try:
        saved = safetensors.torch.load_file(str(path))
    except Exception as e:  # a damaged file: safetensors' own errors
        raise ModelLoadError(f"checkpoint {path} cannot be read ({e}): resume from another checkpoint") from None
    wanted = {f"{name}/{key}": t for name, ts in kept.items() for key, t in ts.items()}
    if set(saved) != set(wanted) or any(saved[k].shape != t.shape for k, t in wanted.items()):
        raise ModelLoadError(
            f"checkpoint {path} keeps another objective state than this run's objective (other settings or another "
            "model): resume with the settings it was saved with, or start without train.resume"
        )
    if not all(torch.isfinite(t).all() for t in saved.values()):
        raise ModelLoadError(f"checkpoint {path} holds NaN or infinite values: resume from an earlier checkpoint")
    with torch.no_grad():
        for key, t in wanted.items():
            t.copy_(saved[key])


__all__ = ["FILE", "restore_kept", "write_kept"]
