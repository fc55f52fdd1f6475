"""Training metrics and images: metrics.jsonl in the run directory, TensorBoard or wandb beside it.

metrics.jsonl gets one line per logged optimizer step (step, loss, lr, grad_norm, seconds, peak memory); the
tracker gets the same scalars. Image grids show the training and control images of recent samples,
read from the original files when logged and dropped right after, so cached training holds no pixels.
"""

from __future__ import annotations

import json
import logging
import math
import os
import queue
import resource
import threading
import time
from collections import deque
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from qie.data.images import open_image
from qie.data.samples import Sample
from qie.types import Batch

log = logging.getLogger(__name__)

# The training steps' scalars reach the tracker's thread in batches: every HAND_OVER_STEPS steps, or sooner once
# HAND_OVER_SECONDS have passed (a slow model's steps show in TensorBoard as they come), and whenever anything else
# is logged or the logger is flushed or closed.
HAND_OVER_STEPS = 25
HAND_OVER_SECONDS = 2.0


def memory_gib() -> dict[str, float]:
    """Peak memory so far: the CUDA allocator's on a GPU, else the process's peak resident set."""
    if torch.cuda.is_available():
        return {
            "memory/max_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
            "memory/max_reserved_gib": torch.cuda.max_memory_reserved() / 2**30,
        }
    return {"memory/max_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}  # KiB on Linux


class MetricsLogger:
    """Writes one JSON line per logged step and mirrors scalars and images to a tracker.

    Args:
        run_dir: where metrics.jsonl and tensorboard/ go.
        report_to: "tensorboard", "wandb" or "none" (metrics.jsonl is written in every case).
        enabled: False on non-main processes (they log nothing).
        config: the run's config, for wandb.
        resume_step: the step a resumed run continues after: what was logged past it (steps the run made
            after its last checkpoint) is dropped from metrics.jsonl and TensorBoard, so each step appears once.

    Raises:
        ConfigError: report_to=wandb without wandb installed.
    """

    def __init__(
        self,
        run_dir: Path,
        report_to: str = "tensorboard",
        enabled: bool = True,
        config: dict | None = None,
        resume_step: int | None = None,
    ) -> None:
        self.enabled = enabled
        self.path = run_dir / "metrics.jsonl"
        self.tb = None
        self.wandb = None
        self._file = None
        self._tracker: _TrackerThread | None = None
        self._steps: list[tuple[dict[str, float], int]] = []  # each step's scalars, handed over in batches
        self._handed = time.monotonic()
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        if resume_step is not None:
            drop_steps_after(self.path, resume_step)
        if report_to == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter

            purge = None if resume_step is None else resume_step + 1
            self.tb = SummaryWriter(str(run_dir / "tensorboard"), purge_step=purge)
        elif report_to == "wandb":
            try:
                import wandb
            except ImportError:
                from qie.errors import ConfigError

                raise ConfigError("logging.report_to=wandb needs wandb: pip install 'qie[wandb]'") from None
            self.wandb = wandb.init(dir=str(run_dir), config=config or {})
        if self.tb is not None or self.wandb is not None:
            self._tracker = _TrackerThread()

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """Append `metrics` to metrics.jsonl; send them and the memory figures to the tracker."""
        if not self.enabled:
            return
        if self._file is None:  # opened once, line-buffered: each step's line reaches the file as it is logged
            self._file = open(self.path, "a", buffering=1)
        memory = memory_gib()  # in the line too: the run's report draws it
        self._file.write(json.dumps({"step": step, **metrics, **memory}) + "\n")
        scalars = {f"train/{k}": v for k, v in metrics.items() if isinstance(v, (int, float))}
        scalars.update(memory)
        if self._tracker is None:
            return
        # Handed to the tracker's thread in batches: waking it every step cost the step a thread switch, a large
        # share of a small model's step on a busy machine.
        self._steps.append((scalars, step))
        if len(self._steps) >= HAND_OVER_STEPS or time.monotonic() - self._handed >= HAND_OVER_SECONDS:
            self._hand_over()

    def _hand_over(self) -> None:
        if self._steps and self._tracker is not None:
            self._tracker.submit(self._send_steps, self._steps)
        self._steps, self._handed = [], time.monotonic()

    def _send_steps(self, steps: list[tuple[dict[str, float], int]]) -> None:
        for scalars, step in steps:
            self._send_scalars(scalars, step)

    def log_file(self, name: str, step: int, scalars: dict[str, float]) -> None:
        """Append `scalars` (full tags) with the step to the run directory's file `name` (a JSON line each call)
        and send them to the tracker: measures made beside training, as the held-out samples'."""
        if not self.enabled:
            return
        with open(self.path.parent / name, "a") as f:
            f.write(json.dumps({"step": step, **scalars}) + "\n")
        self.log_scalars(scalars, step)

    def log_scalars(self, scalars: dict[str, float], step: int) -> None:
        """Send scalars (full tags, e.g. "validation/psnr_keep") to the tracker only, not to metrics.jsonl."""
        if self.enabled and self._tracker is not None:
            self._hand_over()  # the steps logged before these go first
            self._tracker.submit(self._send_scalars, dict(scalars), step)

    def _send_scalars(self, scalars: dict[str, float], step: int) -> None:
        if self.tb is not None:
            for key, value in scalars.items():
                self.tb.add_scalar(key, value, step)
        if self.wandb is not None:
            self.wandb.log(scalars, step=step)

    def log_image(self, tag: str, image: Image.Image, step: int) -> None:
        if self.enabled and self._tracker is not None:
            self._hand_over()
            self._tracker.submit(self._send_image, tag, image, step)

    def _send_image(self, tag: str, image: Image.Image, step: int) -> None:
        if self.tb is not None:
            self.tb.add_image(tag, np.asarray(image.convert("RGB")), step, dataformats="HWC")
        if self.wandb is not None:
            import wandb

            self.wandb.log({tag: wandb.Image(image)}, step=step)

    def log_images(self, tag: str, images: list[Image.Image], step: int) -> None:
        """Log images side by side, as one grid (validation samples, for instance)."""
        if images:
            self.log_image(tag, image_grid([list(images)], height=max(im.height for im in images)), step)

    def flush(self) -> None:
        """Wait until everything logged so far has reached the tracker."""
        if self._tracker is not None:
            self._hand_over()
            self._tracker.wait()
        if self.tb is not None:
            self.tb.flush()

    def close(self) -> None:
        if self._tracker is not None:
            self._hand_over()
            self._tracker.wait()
            self._tracker = None
        if self._file is not None:
            self._file.close()
            self._file = None
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


class _TrackerThread:
    """Runs tracker calls in order in a daemon thread, off the training step: building TensorBoard's events
    cost about a sixth of a tiny cached step. `wait` returns once every call submitted so far has run; a call's
    error is logged, never raised into training."""

    def __init__(self) -> None:
        self._calls: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="qie-tracker", daemon=True)
        self._thread.start()

    def submit(self, fn: Any, *args: Any) -> None:
        self._calls.put((fn, args))

    def wait(self) -> None:
        self._calls.join()

    def _run(self) -> None:
        while True:
            fn, args = self._calls.get()
            try:
                fn(*args)
            except Exception as e:  # a tracker's failure must not stop training
                log.warning("the tracker could not log (%s)", e)
            finally:
                self._calls.task_done()


def drop_steps_after(path: Path, step: int) -> None:
    """Rewrite the metrics file `path` without the lines of steps after `step` (atomically)."""
    if not path.is_file():
        return
    lines = path.read_text().splitlines(keepends=True)
    kept = [line for line in lines if _step_of(line) <= step]
    if len(kept) != len(lines):
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text("".join(kept))
        os.replace(tmp, path)


def _step_of(line: str) -> float:
    try:
        return float(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return math.inf  # a torn last line of a killed run: dropped too


class ImageLogger:
    """An `on_step_end` hook: every `every` steps, a grid of the last `count` samples trained on.

    Each row is one sample: its control images, then its training (target) image. Batches carry sample
    ids only; the images are read from the samples' files here, so no pixels travel with the batches.

    Args:
        samples: sample id -> Sample (the files to read).
        tag: the image's name in the tracker.
    """

    def __init__(
        self,
        logger: MetricsLogger,
        samples: Mapping[str, Sample],
        every: int,
        count: int,
        tag: str = "images/control_and_target",
        height: int = 128,
    ) -> None:
        self.logger, self.samples, self.every = logger, samples, max(1, every)
        self.recent: deque[str] = deque(maxlen=max(1, count))
        self.tag, self.height = tag, height

    def __call__(self, step: int, batch: Batch) -> None:
        self.recent.extend(batch.ids)
        if step % self.every or not self.logger.enabled:
            return
        rows = []
        for sample_id in self.recent:
            sample = self.samples[sample_id]
            rows.append([open_image(p) for p in (*sample.controls, sample.target) if p is not None])
        grid = image_grid(rows, self.height)
        del rows  # the pixels are not needed beyond the grid
        self.logger.log_image(self.tag, grid, step)


def image_grid(rows: list[list[Image.Image]], height: int = 128) -> Image.Image:
    """Rows of images, each scaled to `height`, on a white canvas as wide as the widest row."""
    scaled = [
        [im.convert("RGB").resize((max(1, round(im.width * height / im.height)), height)) for im in r] for r in rows
    ]
    width = max((sum(im.width for im in r) for r in scaled), default=1)
    grid = Image.new("RGB", (max(1, width), height * max(1, len(scaled))), "white")
    for y, row in enumerate(scaled):
        x = 0
        for im in row:
            grid.paste(im, (x, y * height))
            x += im.width
    return grid
