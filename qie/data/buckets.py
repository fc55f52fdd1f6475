"""Deterministic, resumable batches grouped by latent shape (aspect-ratio buckets) and prompt length.

Batch n of the stream is a pure function of (seed, n): resuming at batch k needs only k, and every
process of a distributed run sees the same stream and takes its own slice of each global batch.

No sample is dropped: a bucket smaller than a global batch is trained as one smaller batch per epoch, and
the samples left over when a bigger bucket is cut into full batches are carried into the next epoch's first
batch of that bucket. Epoch e thus depends on epoch e-1's leftovers; the stream is still a function of
(seed, n), computed epoch by epoch from the start (a shuffle of the data set's indices per epoch).
"""

from __future__ import annotations

import bisect
import gc
import itertools
import json
import os
import random
from collections.abc import Hashable, Iterator, Sequence
from pathlib import Path

from qie.data.images import fit_area, upright_size
from qie.data.samples import Sample
from qie.errors import DataError


class BucketBatchSampler:
    """An endless stream of (batch_number, sample indices).

    Args:
        bucket_keys: per sample, a key equal for samples whose latents share shapes.
        lengths: per sample, a proxy for prompt length (e.g. caption characters): batches are cut from
            runs of similar length to limit padding.
        batch_size: samples per batch and process.
        num_replicas, rank: distributed slicing; each global batch holds batch_size * num_replicas samples.
            A smaller batch (of a small bucket) is split evenly between the processes, repeating samples of
            its bucket where it does not divide (as torch's DistributedSampler pads).
    """

    def __init__(
        self,
        bucket_keys: Sequence[Hashable],
        lengths: Sequence[int],
        batch_size: int,
        seed: int = 0,
        shuffle: bool = True,
        num_replicas: int = 1,
        rank: int = 0,
        start: int = 0,
    ) -> None:
        """Raises DataError when there is no sample."""
        self.keys, self.lengths = list(bucket_keys), list(lengths)
        self.batch_size, self.seed, self.shuffle = batch_size, seed, shuffle
        self.num_replicas, self.rank, self.start = num_replicas, rank, start
        if not self.keys:
            raise DataError("no samples to make batches of")
        buckets: dict[Hashable, list[int]] = {}
        for i, key in enumerate(self.keys):
            buckets.setdefault(key, []).append(i)
        # Grouped once, in the order every epoch visits them (each epoch shuffles its own copies).
        self.bucket_order = sorted(buckets, key=repr)
        self._buckets = [buckets[key] for key in self.bucket_order]
        # Per epoch computed so far: its first batch number and the leftovers it starts with (bucket -> indices).
        self._starts: list[int] = [0]
        self._carried: list[dict[int, list[int]]] = [{}]
        # The last epoch's batches: one epoch is computed once, however many iterators read it.
        self._epoch: tuple[int, _Batches] | None = None

    @property
    def global_size(self) -> int:
        return self.batch_size * self.num_replicas

    def bucket_sizes(self) -> list[tuple[Hashable, int]]:
        """(bucket key, number of samples) per bucket, in the stream's bucket order."""
        return [(key, len(idx)) for key, idx in zip(self.bucket_order, self._buckets)]

    def epoch_batches(self, epoch: int) -> Sequence[list[int]]:
        """Global batches of one epoch (full ones hold batch_size * num_replicas indices), each a new list."""
        if self._epoch is not None and self._epoch[0] == epoch:
            return self._epoch[1]
        while len(self._carried) <= epoch:  # the epochs before: their leftovers start this one
            self.epoch_batches(len(self._carried) - 1)
        batches, carry = self._no_gc(epoch, self._carried[epoch])
        if len(self._carried) == epoch + 1:
            self._carried.append(carry)
            self._starts.append(self._starts[epoch] + len(batches))
        self._epoch = (epoch, batches)
        return batches

    def _no_gc(self, epoch: int, carried: dict[int, list[int]]) -> tuple[_Batches, dict[int, list[int]]]:
        # No garbage collection passes while the epoch's lists of indices are made (a GC pass each few hundred
        # objects would walk every object of the process); none of them is cyclic.
        gc_was_on = gc.isenabled()
        gc.disable()
        try:
            return self._make_epoch(epoch, carried)
        finally:
            if gc_was_on:
                gc.enable()

    def _make_epoch(self, epoch: int, carried: dict[int, list[int]]) -> tuple[_Batches, dict[int, list[int]]]:
        rng = random.Random(self.seed * 1_000_003 + epoch)
        size = self.global_size
        parts, leftovers = [], {}  # (run, batch size, batches cut from it) in batch order
        for b, bucket in enumerate(self._buckets):
            idx = list(bucket)
            if self.shuffle:
                rng.shuffle(idx)
            if len(idx) < size:  # one smaller batch, split evenly between the processes
                per_process = -(-len(idx) // self.num_replicas)
                batch = (idx * self.num_replicas)[: per_process * self.num_replicas]
                parts.append((batch, len(batch), 1))
                continue
            first = []
            held = carried.get(b, [])
            if held:  # last epoch's leftovers, filled up with samples that are not among them
                held_set = set(held)
                fill = [i for i in idx if i not in held_set][: size - len(held)]
                first, taken = held + fill, set(fill)
                idx = [i for i in idx if i not in taken]
            if size > 1:
                # Similar lengths next to each other, in chunks, so batches still vary between epochs.
                chunk = size * 8
                idx = [
                    i
                    for c in range(0, len(idx), chunk)
                    for i in sorted(idx[c : c + chunk], key=self.lengths.__getitem__)
                ]
            run = first + idx
            full = len(run) - len(run) % size
            if full:
                parts.append((run, size, full // size))
            if full < len(run):
                leftovers[b] = run[full:]
        order = None
        if self.shuffle:  # the permutation a shuffle of the list of batches makes (it depends on the length only)
            order = list(range(sum(count for _, _, count in parts)))
            rng.shuffle(order)
        return _Batches(parts, order), leftovers

    def __iter__(self) -> Iterator[tuple[int, list[int]]]:
        n = self.start
        while self._starts[-1] <= n:  # the epochs before n: where n's epoch starts
            self.epoch_batches(len(self._starts) - 1)
        epoch = bisect.bisect_right(self._starts, n) - 1
        while True:
            batches = self.epoch_batches(epoch)
            pos = n - self._starts[epoch]
            if pos >= len(batches):
                epoch += 1
                continue
            batch = batches[pos]
            per_process = len(batch) // self.num_replicas
            yield n, batch[self.rank * per_process : (self.rank + 1) * per_process]
            n += 1

    def summary(self, describe=None) -> str:
        """Bucket sizes and how batches are cut, for the start-up log; `describe` names a bucket key."""
        size, describe = self.global_size, describe or describe_key
        sizes = ", ".join(f"{describe(key)}: {count}" for key, count in self.bucket_sizes())
        small = [count for _, count in self.bucket_sizes() if count < size]
        lines = [f"{len(self.keys)} samples in {len(self._buckets)} bucket(s) ({sizes})"]
        if small:
            lines.append(f"{len(small)} bucket(s) smaller than a batch of {size}: each trains as one smaller batch")
        if any(count >= size and count % size for _, count in self.bucket_sizes()):
            lines.append("samples left over by a bucket's full batches start its next epoch")
        return "; ".join(lines)


class _Batches(Sequence):
    """One epoch's batches without a list object per batch (a million batches of one would take a second to
    make): runs of indices cut into batches of a size, in the order `order` gives (the shuffled batch order)."""

    def __init__(self, parts: list[tuple[list[int], int, int]], order: list[int] | None) -> None:
        self._parts, self._order = parts, order
        self._ends = list(itertools.accumulate(count for _, _, count in parts))

    def __len__(self) -> int:
        return self._ends[-1] if self._ends else 0

    def __getitem__(self, i: int) -> list[int]:  # type: ignore[override]
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        j = self._order[i] if self._order is not None else i % len(self)
        p = bisect.bisect_right(self._ends, j)
        run, size, _ = self._parts[p]
        k = j - (self._ends[p - 1] if p else 0)
        return run[k * size : (k + 1) * size]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and list(self) == list(other)


def describe_key(key: Hashable) -> str:
    """A `bucket_keys` key as its image sizes in pixels, target first (`64x64+64x64`); 0 is one bucket for all."""
    if not isinstance(key, tuple):
        return "any shape (batches of one)" if key == 0 else str(key)
    return "+".join(f"{size[0]}x{size[1]}" + (f" ({size[2]} frames)" if len(size) > 2 else "") for size in key)


def bucket_keys(
    samples: Sequence[Sample], target_pixels: int, vae_pixels: int, multiple: int, index: Path | None = None
) -> list[tuple]:
    """Per sample, the sizes its target and control latents will have (read from image headers only).

    Mirrors `prepare_target` (target area, `multiple`) and `condition_images` (VAE area, multiple of 32). A
    layered sample's target is its image and its layers, frames of one size: their count joins its size.

    Args:
        index: a JSON file remembering image sizes against (path, size, mtime_ns): with it a warm start
            only stats the images (reading 200k PNG headers takes seconds).
    """
    sizes = ImageSizeIndex(index)
    keys = []
    for s in samples:
        # A sample without a target (an objective that samples its results) is sized by its controls alone.
        pairs = [(s.target, target_pixels, multiple)] if s.target is not None else []
        pairs += [(c, vae_pixels, 32) for c in s.controls]
        key = [fit_area(*sizes.size(path), area, mult) for path, area, mult in pairs]
        if s.layers:
            key[0] = (*key[0], 1 + len(s.layers))
        keys.append(tuple(key))
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
        # A fifth item marks sizes taken upright (EXIF orientation applied); older entries are measured again.
        if known is not None and len(known) == 5 and known[:2] == [st.st_size, st.st_mtime_ns]:
            return known[2], known[3]
        width, height = upright_size(key)  # as the encoder sees it
        self.entries[key] = [st.st_size, st.st_mtime_ns, width, height, 1]
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
