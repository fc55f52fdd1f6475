"""Checkpoints: the LoRA in diffusers format beside the full accelerate state, for exact resume.

A checkpoint folder `checkpoints/step-000100/` holds `pytorch_lora_weights.safetensors` (and the
ComfyUI copy when asked), `accelerate/` (optimizer, LR scheduler, RNG states of every process, trainable
weights) and `trainer_state.json` (step, batches consumed). It is written under a temporary name and
renamed, so a kill while saving never leaves a checkpoint that looks complete but is not.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from qie.errors import ConfigError
from qie.training.lora import load_lora_state, lora_state_dict, save_lora
from qie.training.quiet import quiet_loggers

STATE_FILE = "trainer_state.json"
LORA_STATE_FILE = "lora_state.safetensors"


def checkpoint_dir(root: Path, step: int) -> Path:
    return root / "checkpoints" / f"step-{step:06d}"


def temp_dir(folder: Path) -> Path:
    """Where `folder` is written before it is renamed into place."""
    return folder.with_name(f".{folder.name}.tmp")


def write_state(folder: Path, state: dict) -> None:
    (folder / STATE_FILE).write_text(json.dumps(state, indent=2))


def read_state(folder: Path) -> dict:
    return json.loads((folder / STATE_FILE).read_text())


def complete_checkpoints(root: Path) -> list[Path]:
    """Finished checkpoints under `root/checkpoints`, oldest first."""
    folder = root / "checkpoints"
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if p.name.startswith("step-") and (p / STATE_FILE).is_file())


def resolve_resume(resume: str | None, run_dir: Path) -> Path | None:
    """The checkpoint folder that `train.resume` names: None, "latest" (in this run dir) or a path.

    A path may be a checkpoint folder or a run directory (its newest checkpoint is taken).

    Raises:
        ConfigError: a path that is not a complete checkpoint.
    """
    if not resume:
        return None
    if resume == "latest":
        found = complete_checkpoints(run_dir)
        return found[-1] if found else None
    path = Path(resume).expanduser()
    if (path / "checkpoints").is_dir() and not (path / STATE_FILE).exists():
        found = complete_checkpoints(path)
        path = found[-1] if found else path
    if not (path / STATE_FILE).is_file():
        raise ConfigError(
            f"train.resume={resume!r} is not a complete checkpoint (no {STATE_FILE} in {path}): "
            "name a checkpoints/step-NNNNNN folder, a run directory, or 'latest'"
        )
    return path


def begin(folder: Path) -> Path:
    """A fresh temporary sibling to write the checkpoint into."""
    tmp = temp_dir(folder)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def commit(tmp: Path, folder: Path) -> Path:
    if folder.exists():
        shutil.rmtree(folder)
    os.replace(tmp, folder)
    return folder


def prune(root: Path, keep: int | None) -> None:
    """Delete the oldest checkpoints beyond `keep` (None keeps all)."""
    if not keep:
        return
    for old in complete_checkpoints(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def register_lora_state(accelerator: Any) -> None:
    """Make accelerate save only the LoRA weights of its models (not the frozen base), as safetensors."""
    from safetensors.torch import load_file, save_file

    def save_hook(models: list, weights: list, output_dir: str) -> None:
        if accelerator.is_main_process:
            for m in models:
                save_file(lora_state_dict(accelerator.unwrap_model(m)), str(Path(output_dir) / LORA_STATE_FILE))
        weights.clear()  # accelerate would otherwise write the whole base model

    def load_hook(models: list, input_dir: str) -> None:
        while models:
            m = models.pop()
            load_lora_state(accelerator.unwrap_model(m), load_file(str(Path(input_dir) / LORA_STATE_FILE)))

    accelerator.register_save_state_pre_hook(save_hook)
    accelerator.register_load_state_pre_hook(load_hook)


def save_checkpoint(
    accelerator: Any,
    model: torch.nn.Module,
    run_dir: Path,
    state: dict,
    lora: bool,
    comfyui: bool = False,
    keep: int | None = None,
) -> Path:
    """Write `checkpoints/step-NNNNNN` for `state["step"]` from every process; returns the folder.

    Args:
        state: what `read_state` gives back on resume (step, batches_consumed, ...).
        lora: also export the LoRA in diffusers format (and ComfyUI's with `comfyui`).
        keep: `train.checkpoints_total_limit`.
    """
    folder = checkpoint_dir(run_dir, int(state["step"]))
    tmp = temp_dir(folder)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        begin(folder)
    accelerator.wait_for_everyone()
    with quiet_loggers():  # accelerate's line per file; one qie line below says it all
        accelerator.save_state(str(tmp / "accelerate"))  # every process writes its own RNG state
    weights = lora_state_dict(accelerator.unwrap_model(model)) if lora else None  # every process: FSDP gathers
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        if lora:
            save_lora(accelerator.unwrap_model(model), tmp, comfyui=comfyui, state=weights)
        write_state(tmp, state)
        commit(tmp, folder)
        prune(run_dir, keep)
        print(f"qie: checkpoint at step {state['step']}: {folder}", flush=True)
    accelerator.wait_for_everyone()
    return folder


def load_checkpoint(accelerator: Any, folder: Path) -> dict:
    """Restore weights, optimizer, LR scheduler and RNG from `folder`; returns its trainer state."""
    state = read_state(folder)
    saved_procs = int(state.get("num_processes", accelerator.num_processes))
    if saved_procs != accelerator.num_processes:
        accelerator.print(
            f"qie: warning: {folder} was saved by {saved_procs} processes, resuming with "
            f"{accelerator.num_processes}: the data order from here on differs from the original run's"
        )
    with quiet_loggers():
        accelerator.load_state(str(folder / "accelerate"))
    return state
