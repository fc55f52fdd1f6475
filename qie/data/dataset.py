"""The training data set: batches of sample indices in, collated embedding batches out."""

from __future__ import annotations

import atexit
import json
import os
import queue
import random
import signal
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from PIL import Image

from qie.data.collate import Batch, collate
from qie.data.images import fit_area
from qie.data.samples import Sample
from qie.embeddings import CachedSource, EmbeddingSource
from qie.errors import QieError


@dataclass
class BatchFailure:
    """A user-facing error raised while loading a batch, carried out of a loader worker as a value.

    torch re-raises worker exceptions with the worker's traceback pasted into the message; carrying the
    error out and raising it in the main process keeps the message the user reads clean.
    """

    error: QieError


class EmbeddingDataset:
    """Maps (batch number, indices) from a BucketBatchSampler to (batch number, Batch).

    Caption dropout swaps in a sample's own empty-prompt embedding; the choice depends only on
    (seed, batch number, position), so it is the same for every source and on resume.
    """

    def __init__(
        self,
        samples: Sequence[Sample],
        source: EmbeddingSource,
        caption_dropout_rate: float = 0.0,
        seed: int = 0,
    ) -> None:
        self.samples, self.source = list(samples), source
        self.caption_dropout_rate, self.seed = caption_dropout_rate, seed

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, item: tuple[int, list[int]]) -> tuple[int, Batch | BatchFailure]:
        number, indices = item
        try:
            embeds = self.source.get([self.samples[i] for i in indices])
        except QieError as e:
            return number, BatchFailure(e)
        rng = random.Random(f"{self.seed}:{number}")
        drop = [rng.random() < self.caption_dropout_rate for _ in indices]
        return number, collate(embeds, drop)


def _worker_signals(worker_id: int) -> None:
    # Ctrl-C reaches the whole process group; the main process turns it into a clean stop and needs its
    # workers until then. SIGTERM (a scheduler's, or multiprocessing ending its workers at exit) must end a
    # worker, and quietly: torch raises in the main process, mid-step, for a worker killed by a signal.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _exit_quietly)


def _exit_quietly(signum: int, frame: object) -> None:
    os._exit(0)


# Batches a background thread of the training process keeps ready (cached sources only; 0 turns it off).
PREFETCH_BATCHES = 4


def make_loader(
    dataset: EmbeddingDataset, sampler: Iterable[tuple[int, list[int]]], num_workers: int, seed: int
) -> torch.utils.data.DataLoader:
    """A DataLoader over `sampler`'s (number, indices) items, one Batch each.

    It has its own generator, so creating its iterator draws nothing from the global RNG that a resumed
    run restores (LoRA dropout draws from that). For a cached source its iterator also runs in a
    background thread, `PREFETCH_BATCHES` ahead: taking a batch from a worker (unpickling, receiving its
    shared-memory tensors) or reading it (num_workers=0) then overlaps the training step instead of
    stalling it. Order and content of the stream are unchanged.
    """
    prefetch = PREFETCH_BATCHES > 0 and isinstance(dataset.source, CachedSource)
    return (_PrefetchingLoader if prefetch else torch.utils.data.DataLoader)(
        dataset,
        sampler=sampler,
        batch_size=None,
        num_workers=num_workers,
        collate_fn=_identity,
        prefetch_factor=4 if num_workers else None,
        worker_init_fn=_worker_signals if num_workers else None,
        generator=torch.Generator().manual_seed(seed),
    )


class _PrefetchingLoader(torch.utils.data.DataLoader):
    """A DataLoader whose iterator is driven by a background thread (see `Prefetcher`)."""

    def __iter__(self) -> Iterator:
        # The DataLoader iterator is made here, in the caller's thread: it starts the worker processes and
        # sets a SIGCHLD handler, which only the main thread may do.
        return Prefetcher(super().__iter__(), PREFETCH_BATCHES)


_END = object()


class Prefetcher:
    """Iterates `source` in a daemon thread, up to `depth` items ahead; errors are raised in `__next__`.

    The thread stops once the consumer is done with this object (`close`, or garbage collection), and
    drops `source` itself (for a DataLoader iterator: shuts its workers down) before it ends.
    """

    def __init__(self, source: Iterator, depth: int) -> None:
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._done = False
        # The thread gets the queue, the event and the source (in a list it empties, so that it holds the
        # only reference), never `self`, so `self` can be collected while the thread runs.
        self._thread = threading.Thread(
            target=_fill, args=([source], self._queue, self._stop), name="qie-prefetch", daemon=True
        )
        _LIVE[self._thread] = self._stop
        self._thread.start()

    def __iter__(self) -> Prefetcher:
        return self

    def __next__(self):
        if self._done:
            raise StopIteration
        ok, item = self._queue.get()
        if ok:
            return item
        self._done = True
        if item is _END:
            raise StopIteration
        raise item

    def close(self) -> None:
        """Stop the thread (it finishes the item it is taking) and drop what it read ahead."""
        self._done = True
        self._stop.set()
        try:
            while True:
                self._queue.get_nowait()
        except queue.Empty:
            pass

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass


# Running prefetch threads. At exit they are stopped and joined before the interpreter shuts down: a daemon
# thread still inside torch code (a DataLoader shutting its workers down) when Python finalizes aborts the
# process ("terminate called without an active exception").
_LIVE: dict[threading.Thread, threading.Event] = {}


@atexit.register
def _stop_prefetchers() -> None:
    live = list(_LIVE.items())
    for _, stop in live:
        stop.set()
    for thread, _ in live:
        thread.join(timeout=30.0)


def _fill(holder: list, out: queue.Queue, stop: threading.Event) -> None:
    source = holder.pop()
    try:
        for item in source:
            if not _put(out, stop, (True, item)):
                return
        _put(out, stop, (False, _END))
    except BaseException as e:  # handed to the consumer, raised in its thread
        _put(out, stop, (False, e))
    finally:
        item = None
        del source  # the last reference: a DataLoader iterator shuts its workers down here, in this thread
        _LIVE.pop(threading.current_thread(), None)


def _put(out: queue.Queue, stop: threading.Event, value: tuple) -> bool:
    """Put `value` once there is room; False (nothing put) when the consumer stopped meanwhile."""
    while not stop.is_set():
        try:
            out.put(value, timeout=0.1)
            return True
        except queue.Full:
            continue
    return False


def _identity(x: tuple) -> tuple:
    return x


def raise_failures(stream: Iterable[tuple[int, Batch | BatchFailure]]) -> Iterator[tuple[int, Batch]]:
    """Pass batches through; raise a carried BatchFailure's error here, in the main process."""
    for number, item in stream:
        if isinstance(item, BatchFailure):
            raise item.error
        yield number, item


def bucket_keys(
    samples: Sequence[Sample], target_pixels: int, vae_pixels: int, multiple: int, index: Path | None = None
) -> list[tuple]:
    """Per sample, the sizes its target and control latents will have (read from image headers only).

    Mirrors `prepare_target` (target area, `multiple`) and `condition_images` (VAE area, multiple of 32).

    Args:
        index: a JSON file remembering image sizes against (path, size, mtime_ns): with it a warm start
            only stats the images (reading 200k PNG headers takes seconds).
    """
    sizes = ImageSizeIndex(index)
    keys = []
    for s in samples:
        pairs = [(s.target, target_pixels, multiple)] + [(c, vae_pixels, 32) for c in s.controls]
        keys.append(tuple(fit_area(*sizes.size(path), area, mult) for path, area, mult in pairs))
    sizes.save()
    return keys


class ImageSizeIndex:
    """(width, height) of image files, remembered against (absolute path, size, mtime_ns)."""

    def __init__(self, path: Path | None = None) -> None:
        self.path, self.dirty = path, False
        self.entries: dict[str, list[int]] = {}
        if path is not None and path.is_file():
            try:
                self.entries = json.loads(path.read_text())
            except (OSError, ValueError):  # only a speed-up: start over
                self.entries = {}

    def size(self, image: Path) -> tuple[int, int]:
        key = os.path.abspath(image)
        st = os.stat(key)
        known = self.entries.get(key)
        if known is not None and known[:2] == [st.st_size, st.st_mtime_ns]:
            return known[2], known[3]
        with Image.open(key) as im:
            width, height = im.width, im.height
        self.entries[key] = [st.st_size, st.st_mtime_ns, width, height]
        self.dirty = True
        return width, height

    def save(self) -> None:
        """Write the index atomically (processes that race write the same content; the last one wins)."""
        if self.path is None or not self.dirty:
            return
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(self.entries, separators=(",", ":")))
            os.replace(tmp, self.path)
        except OSError:  # a read-only cache folder: go on without the index
            tmp.unlink(missing_ok=True)
        self.dirty = False
