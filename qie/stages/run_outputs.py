"""Where a training run's outputs go besides its run folder (`run.output_url`), and where `train.resume=latest`
resumes from: the object store when one is set (every node of every restart sees the same checkpoints), the
run folder otherwise. The store is opened and taken for the run (its lease: one writer per output URL) before
anything loads.

The writing process uploads each checkpoint once it is saved, every process waiting for the upload (a worker
that dies right after a save leaves that checkpoint complete in the store); on resume the newest complete
checkpoint of the store is copied into each node's run folder (by its first process) and checked as a local one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qie.config.train import RunConfig
from qie.errors import StorageError
from qie.training import checkpoint as ckpt
from qie.training.run_store import RunStore


@dataclass(frozen=True)
class RunOutputs:
    """The run's object store (`run.output_url`), or None: the run folder alone."""

    store: RunStore | None = None

    @classmethod
    def of(cls, run: RunConfig) -> RunOutputs:
        """The outputs `run` names; opens the store now, so that a bad URL is named before anything loads.

        Raises:
            ConfigError: a URL that cannot be opened.
        """
        if not run.output_url:
            return cls()
        return cls(RunStore(str(run.output_url), run.endpoint_url, run.storage_options))

    @property
    def run_id(self) -> str | None:
        """This run's id in the store (in each checkpoint's marker and trainer state); None without a store."""
        return None if self.store is None else self.store.run_id

    def claim(self, resume: str | None, accelerator: Any) -> None:
        """Open and check the store before anything loads: its writer process takes the store's lease (one run writes
        an output URL at a time), which reaches the store; every process raises when it could not.

        Raises:
            StorageError: the store is down, refuses the credentials, has no bucket, is written by another run, or
                holds another run's checkpoints while this run does not resume (`RunStore.claim`).
        """
        if self.store is None:
            return
        error = None
        if accelerator.is_main_process:
            try:
                self.store.claim(resuming=bool(resume))
            except StorageError as e:
                error = e
        failed = _agree(accelerator, int(error is not None))
        if error is not None:
            raise error
        if failed:
            raise StorageError(f"run.output_url={self.store.url}: the first process could not take it (it says why)")

    def release(self) -> None:
        """Let other runs write the store (the writing process's lease)."""
        if self.store is not None:
            self.store.release()

    def where(self, run_dir: Path) -> str:
        """Where checkpoints are looked for: the store's checkpoints/ or the run folder."""
        return f"{self.store.url}/checkpoints" if self.store else str(run_dir)

    def resume_from(self, resume: str | None, run_dir: Path, accelerator: Any) -> Path | None:
        """The local checkpoint folder `train.resume` names (`ckpt.resolve_resume`); with a store, "latest" is the
        store's newest complete checkpoint, copied into `run_dir` first (None when the store holds none).

        Raises:
            ConfigError, ModelLoadError: as `ckpt.resolve_resume`; StorageError: the store cannot be read.
        """
        if self.store is None or resume != "latest":
            return ckpt.resolve_resume(resume, run_dir)
        names = self.store.checkpoints() if accelerator.is_main_process else []
        step = _agree(accelerator, int(names[-1].split("-")[1]) if names else -1)  # one choice for every node
        if step < 0:
            return None
        folder = ckpt.checkpoint_dir(run_dir, step)
        if accelerator.is_local_main_process:
            self.store.download_checkpoint(folder.name, run_dir)
        if accelerator.is_main_process:
            self.store.download_metrics(run_dir)  # the steps logged before: the logger keeps those up to `step`
        accelerator.wait_for_everyone()
        accelerator.print(f"qie: train.resume=latest: {self.store.url}/checkpoints/{folder.name} copied to {folder}")
        ckpt.refuse_pickles(folder)
        return folder

    def saving(self, save: Callable[[int, int], Path], accelerator: Any, run_dir: Path, keep: int | None) -> Callable:
        """`save(step, batches_consumed)`, then (with a store) the checkpoint uploaded by the writing process and
        `keep` (`train.checkpoints_total_limit`) applied in the store; every process returns once it is stored."""
        if self.store is None:
            return save
        store = self.store

        def save_and_store(step: int, consumed: int) -> Path:
            folder = save(step, consumed)
            if accelerator.is_main_process:
                store.publish_checkpoint(folder, run_dir)
                store.prune(keep)
                print(f"qie: checkpoint at step {step} stored: {store.url}/checkpoints/{folder.name}", flush=True)
            accelerator.wait_for_everyone()
            return folder

        return save_and_store

    def publish(self, run_dir: Path, accelerator: Any) -> None:
        """Upload the finished run folder but its checkpoints (the writing process)."""
        if self.store is not None and accelerator.is_main_process:
            count = self.store.publish_run(run_dir)
            print(f"qie: run outputs stored: {self.store.url} ({count} files)", flush=True)


def _agree(accelerator: Any, value: int) -> int:
    """The main process's `value`, on every process."""
    if accelerator.num_processes == 1:
        return value
    import torch
    from accelerate.utils import broadcast

    return int(broadcast(torch.tensor([value], device=accelerator.device)).item())


__all__ = ["RunOutputs"]
