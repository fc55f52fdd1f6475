"""Checkpoints: the LoRA in diffusers format beside the full training state, for exact resume, with no pickle.

A checkpoint folder `checkpoints/step-000100/` holds `pytorch_lora_weights.safetensors` (and the ComfyUI
copy when asked), `trainer_state.json` (step, batches consumed) and `state/`: the trained weights
(`model.safetensors`), the optimizer and LR scheduler state (`optimizer.*`, `lr_scheduler.*`, safetensors +
JSON, see `state_io`), the mixed-precision scaler (`grad_scaler.json`) and each process's RNG state
(`rng_state_<rank>.*`). An FSDP-sharded model's weights and optimizer state are gathered whole into the same
files. Everything is read with `json` and `safetensors`; a checkpoint holding any file that would need
unpickling (accelerate's `*.pkl`, `*.bin`, torch's `*.pt` ...) is refused, as unpickling runs whatever code
the file names. It is written under a temporary name and renamed, so a kill while saving never leaves a
checkpoint that looks complete but is not; a failed write (a full disk, an I/O or permission error) removes
the temporary folder and stops the run with one line, leaving every earlier checkpoint as it was.
`trainer_state.json` also records the model and data set it was trained on (`run_record`).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import safetensors.torch
from safetensors import SafetensorError

from qie.adapters.kinds import is_adapter_param
from qie.adapters.lora import load_lora_state
from qie.errors import ConfigError, ModelLoadError, StorageError
from qie.runtime.guards import state_is_finite
from qie.training.state_io import load_tree, rng_state, save_tree, set_rng_state

STATE_FILE = "trainer_state.json"
STATE_DIR = "state"
MODEL_FILE = "model.safetensors"
# Files that only a pickle loader reads (and the magic bytes of pickles and torch's zip format).
PICKLE_SUFFIXES = {".pkl", ".pickle", ".bin", ".pt", ".pth", ".ckpt", ".pyc", ".npy", ".npz", ".joblib"}
_PICKLE_MAGIC = (b"\x80\x02", b"\x80\x03", b"\x80\x04", b"\x80\x05", b"PK\x03\x04")


def checkpoint_dir(root: Path, step: int) -> Path:
    return root / "checkpoints" / f"step-{step:06d}"


def temp_dir(folder: Path) -> Path:
    """Where `folder` is written before it is renamed into place."""
    return folder.with_name(f".{folder.name}.tmp")


def write_state(folder: Path, state: dict) -> None:
    (folder / STATE_FILE).write_text(json.dumps(state, indent=2))


def read_state(folder: Path) -> dict:
    """The trainer state of checkpoint `folder`.

    Raises:
        ModelLoadError: the file is unreadable or not a JSON object of whole-number step counts (naming it).
    """
    path = folder / STATE_FILE
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(state, dict):
            raise ValueError("not a JSON object")
        for key in ("step", "batches_consumed", "num_processes"):
            number = state.get(key, 1 if key == "num_processes" else None)
            if isinstance(number, bool) or not isinstance(number, int) or not 0 <= number < 2**53:
                raise ValueError(f"{key} is {number!r}, not a whole number >= 0")
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ModelLoadError(
            f"checkpoint state {path} is damaged ({e.__class__.__name__}: {e}): resume from another checkpoint "
            "of checkpoints/, or start without train.resume"
        ) from None
    return state


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
        if found:
            refuse_pickles(found[-1])
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
    refuse_pickles(path)  # before any model is built
    return path


def begin(folder: Path) -> Path:
    """A fresh temporary sibling to write the checkpoint into."""
    tmp = temp_dir(folder)
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / STATE_DIR).mkdir(parents=True)
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


def save_checkpoint(
    train: Any,
    run_dir: Path,
    state: dict,
    mode: Any,
    exports: Sequence[str] = (),
    keep=None,
    extra: Callable[[Path], None] | None = None,
) -> Path:
    """Write `checkpoints/step-NNNNNN` for `state["step"]` from every process; returns the folder.

    Args:
        train: the TrainState (accelerator, model, optimizer, lr_scheduler).
        state: what `read_state` gives back on resume (step, batches_consumed, ...).
        mode: the TrainMode (`qie.training.modes`): what the checkpoint keeps of the model (a LoRA keeps its own
            weights, exported in diffusers format too with the other tools' files `exports` names: "comfyui",
            "kohya"; a full fine-tune the whole transformer).
        keep: `train.checkpoints_total_limit`.
        extra: writes more into the checkpoint folder before it is committed (main process; the EMA).
    """
    accelerator = train.accelerator
    folder = checkpoint_dir(run_dir, int(state["step"]))
    tmp = temp_dir(folder)
    accelerator.wait_for_everyone()
    try:
        if accelerator.is_main_process:
            begin(folder)
        accelerator.wait_for_everyone()
        save_tree(rng_state(), tmp / STATE_DIR, f"rng_state_{accelerator.process_index}")  # every process its own
    except BaseException as e:  # a second stop signal included
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, (OSError, SafetensorError)):
            raise save_error(e, folder) from None
        raise
    sharded = is_sharded(accelerator)
    weights = mode.checkpoint_weights(accelerator.unwrap_model(train.model))  # FSDP: every process
    gathered = gather_state(train, not mode.saves_whole_model) if sharded else None  # collectives: every process
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        try:
            _write(
                train,
                tmp,
                folder=folder,
                state=state,
                mode=mode,
                exports=exports,
                weights=weights,
                gathered=gathered,
                extra=extra,
            )
        except BaseException as e:
            shutil.rmtree(tmp, ignore_errors=True)  # the earlier checkpoints are untouched
            if isinstance(e, (OSError, SafetensorError)):
                raise save_error(e, folder) from None
            raise
        prune(run_dir, keep)
        print(f"qie: checkpoint at step {state['step']}: {folder}", flush=True)
    accelerator.wait_for_everyone()
    return folder


def _write(
    train: Any,
    tmp: Path,
    folder: Path,
    state: dict,
    mode: Any,
    exports: Sequence[str],
    weights,
    gathered,
    extra: Callable[[Path], None] | None,
) -> None:
    """Write the checkpoint's files into `tmp` and rename it to `folder` (main process)."""
    accelerator = train.accelerator
    model = accelerator.unwrap_model(train.model)
    mode.write_checkpoint(model, tmp, exports, weights, None if gathered is not None else tmp / STATE_DIR / MODEL_FILE)
    if gathered is not None:
        safetensors.torch.save_file(gathered[0], str(tmp / STATE_DIR / MODEL_FILE))
        save_tree(gathered[1], tmp / STATE_DIR, "optimizer")
    else:
        save_tree(train.optimizer.state_dict(), tmp / STATE_DIR, "optimizer")
    save_tree(train.lr_scheduler.state_dict(), tmp / STATE_DIR, "lr_scheduler")
    if extra is not None:
        extra(tmp)
    if getattr(accelerator, "scaler", None) is not None:
        (tmp / STATE_DIR / "grad_scaler.json").write_text(json.dumps(accelerator.scaler.state_dict()))
    write_state(tmp, state)
    commit(tmp, folder)


def kept_after_interrupt(run_dir: Path, resumed_from: Path | None) -> str:
    """What a training stopped at once (a second stop signal, before its stop save finished) keeps: the newest
    complete checkpoint and how to go on (an unfinished save's temporary folder is removed as it stops)."""
    found = complete_checkpoints(run_dir)
    if found:
        kept = f"{len(found)} checkpoint(s) saved before it are kept in {run_dir / 'checkpoints'}"
        kept, how = f"{kept}, the last {found[-1].name}", f"train.resume=latest hydra.run.dir={run_dir}"
    elif resumed_from is not None:
        kept = f"this run saved no checkpoint; the one it resumed from is kept: {resumed_from}"
        how = f"train.resume={resumed_from}"
    else:
        return "a second signal stopped training before any checkpoint was saved: nothing to resume from"
    return f"a second signal stopped training without its stop save; {kept}: continue with {how}"


def save_error(e: Exception, folder: Path) -> StorageError:
    """One line for a checkpoint that could not be written: what failed, and that nothing earlier was lost."""
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT) or "No space left" in str(e):
        why, fix = "the disk is full", "free space on that disk (or set train.checkpoints_total_limit)"
    elif isinstance(e, OSError) and e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        why, fix = "permission denied", "make the run folder writable"
    else:
        why, fix = f"{e.__class__.__name__}: {e}", "check the disk of the run folder"
    return StorageError(
        f"cannot write checkpoint {folder} ({why}): {fix}, then resume with train.resume=latest; "
        "the earlier checkpoints are kept"
    )


def refuse_pickles(folder: Path) -> None:
    """Raise ModelLoadError if any file under `folder` would need unpickling to be read."""
    for path in sorted(p for p in folder.rglob("*") if p.is_file() or p.is_symlink()):
        with open(path, "rb") as f:
            head = f.read(4)
        if path.suffix.lower() in PICKLE_SUFFIXES or head.startswith(_PICKLE_MAGIC):
            raise ModelLoadError(
                f"checkpoint {folder} holds {path.relative_to(folder)}, a file only a pickle loader reads (which "
                "runs any code the file names): qie checkpoints hold safetensors and JSON only, so this one was "
                "not written by this qie. Resume from a checkpoint qie wrote, or start without train.resume."
            )


def load_checkpoint(train: Any, folder: Path, inexact: bool = False) -> dict:
    """Restore weights, optimizer, LR scheduler and RNG from `folder`; returns its trainer state.

    Args:
        inexact: resume even when this process's RNG state is missing or unreadable (`train.resume_inexact`).

    Raises:
        ModelLoadError: a file that needs unpickling, or missing or damaged state (naming the file).
    """
    accelerator, state_dir = train.accelerator, folder / STATE_DIR
    refuse_pickles(folder)
    state = read_state(folder)
    saved_procs = int(state.get("num_processes", accelerator.num_processes))
    if saved_procs != accelerator.num_processes:  # another global batch and data order: not an exact resume
        detail = f"{folder} was saved by {saved_procs} processes, resuming with {accelerator.num_processes}"
        if not inexact:
            raise ModelLoadError(
                f"cannot resume exactly: {detail}. Resume with {saved_procs} processes, or set "
                "train.resume_inexact=true to continue with another batch and data order"
            )
        accelerator.print(f"qie: warning: {detail}: the data order from here on differs (train.resume_inexact=true)")
    if is_sharded(accelerator):  # every process reads the whole state and keeps its shards
        _load(state_dir / MODEL_FILE, lambda: set_sharded_state(train, state_dir))
    else:
        model = accelerator.unwrap_model(train.model)
        _load(state_dir / MODEL_FILE, lambda: _load_model(model, state_dir / MODEL_FILE))
        _load(state_dir / "optimizer.json", lambda: train.optimizer.load_state_dict(load_tree(state_dir, "optimizer")))
    _load(
        state_dir / "lr_scheduler.json",
        lambda: train.lr_scheduler.load_state_dict(load_tree(state_dir, "lr_scheduler")),
    )
    if getattr(accelerator, "scaler", None) is not None and (state_dir / "grad_scaler.json").is_file():
        accelerator.scaler.load_state_dict(json.loads((state_dir / "grad_scaler.json").read_text()))
    if not state_is_finite(accelerator, train.params, train.optimizer):  # one collective: all refuse alike
        raise ModelLoadError(
            f"checkpoint {folder} holds NaN or infinite trained weights or optimizer state: training from it "
            "would write NaN into the weights. Resume from an earlier checkpoint of checkpoints/"
        )
    rng = f"rng_state_{accelerator.process_index}"
    try:
        set_rng_state(load_tree(state_dir, rng))
    except Exception as e:
        detail = f"{state_dir / rng}.{{json,safetensors}} is missing or unreadable ({e.__class__.__name__}: {e})"
        if not inexact:
            raise ModelLoadError(
                f"cannot resume exactly: {detail}. Without it the random numbers (LoRA dropout and others) differ "
                "from the original run; set train.resume_inexact=true to resume anyway."
            ) from None
        accelerator.print(f"qie: warning: {detail}; resuming without it (train.resume_inexact=true): not exact")
    return state


def is_sharded(accelerator: Any) -> bool:
    """The model is FSDP-sharded (`train.fsdp=true` over several processes)."""
    from accelerate.utils import DistributedType

    return accelerator.distributed_type == DistributedType.FSDP and accelerator.num_processes > 1


def _options(**kw: Any) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kw)


def _raw_optimizer(train: Any) -> Any:
    return getattr(train.optimizer, "optimizer", train.optimizer)  # accelerate's wrapper holds torch's


def gather_state(train: Any, trained_only: bool) -> tuple[dict, dict]:
    """The whole weights (only the trained ones with `trained_only`) and optimizer state of an FSDP-sharded model,
    on the CPU of process 0 (a collective: every process calls it; the others get empty dicts)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    options = _options(cpu_offload=True, ignore_frozen_params=trained_only)
    weights = get_model_state_dict(train.model, options=options)
    optimizer = get_optimizer_state_dict(train.model, _raw_optimizer(train), options=options)
    return {k: v.contiguous() for k, v in weights.items()}, optimizer


def set_sharded_state(train: Any, state_dir: Path) -> None:
    """Load what `gather_state` saved into the FSDP-sharded model and its optimizer (every process)."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    weights = safetensors.torch.load_file(str(state_dir / MODEL_FILE))
    lora = not all(p.requires_grad for p in train.model.parameters())
    set_model_state_dict(train.model, weights, options=_options(strict=not lora))
    optimizer = load_tree(state_dir, "optimizer")
    set_optimizer_state_dict(train.model, _raw_optimizer(train), optimizer, options=_options())


def _load_model(model: Any, path: Path) -> None:
    if path.stat().st_size and _is_lora(path):
        load_lora_state(model, safetensors.torch.load_file(str(path)))
    else:
        safetensors.torch.load_model(model, str(path))


def _is_lora(path: Path) -> bool:
    with safetensors.safe_open(str(path), "pt") as f:
        return any(is_adapter_param(k) for k in f.keys())


def _load(path: Path, load) -> None:
    try:
        load()
    except Exception as e:
        raise ModelLoadError(f"cannot resume from {path}: {e.__class__.__name__}: {e}") from None
