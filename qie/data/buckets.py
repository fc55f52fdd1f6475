"""Deterministic, resumable batches grouped by latent shape (aspect-ratio buckets) and prompt length.

Batch n of the stream is a pure function of (seed, n): resuming at batch k needs only k, and every
process of a distributed run sees the same stream and takes its own slice of each global batch.
"""

from __future__ import annotations

import gc
import json
import os
import random
from collections.abc import Hashable, Iterator, Sequence
from pathlib import Path

from PIL import Image

from qie.data.images import fit_area
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
        """Raises DataError when no bucket holds one full global batch."""
        self.keys, self.lengths = list(bucket_keys), list(lengths)
        self.batch_size, self.seed, self.shuffle = batch_size, seed, shuffle
        self.num_replicas, self.rank, self.start = num_replicas, rank, start
        global_size = batch_size * num_replicas
        buckets: dict[Hashable, list[int]] = {}
        for i, key in enumerate(self.keys):
            buckets.setdefault(key, []).append(i)
        # Grouped once, in the order every epoch visits them (each epoch shuffles its own copies).
        self._buckets = [buckets[key] for key in sorted(buckets, key=repr)]
        self._per_epoch = sum(len(idx) // global_size for idx in self._buckets)
        # The last epoch's batches: one epoch is computed once, however many iterators read it.
        self._epoch: tuple[int, list[list[int]]] | None = None
        if not self._per_epoch:
            raise DataError(
                f"no full batch: {len(self.keys)} samples cannot fill a batch of {batch_size} x {num_replicas} "
                "processes within one bucket; lower data.batch_size"
            )

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        """Global batches of one epoch (each batch_size * num_replicas indices); do not modify the list."""
        if self._epoch is not None and self._epoch[0] == epoch:
            return self._epoch[1]
        # No garbage collection passes while one small list per batch is made (100k of them: a GC pass
        # each few hundred would walk every object of the process); none of them is cyclic.
        gc_was_on = gc.isenabled()
        gc.disable()
        try:
            batches = self._make_epoch(epoch)
        finally:
            if gc_was_on:
                gc.enable()
        self._epoch = (epoch, batches)
        return batches

    def _make_epoch(self, epoch: int) -> list[list[int]]:
        rng = random.Random(self.seed * 1_000_003 + epoch)
        global_size = self.batch_size * self.num_replicas
        batches = []
        for bucket in self._buckets:
            idx = list(bucket)
            if self.shuffle:
                rng.shuffle(idx)
            if global_size > 1:
                # Similar lengths next to each other, in chunks, so batches still vary between epochs.
                chunk = global_size * 8
                idx = [
                    i
                    for c in range(0, len(idx), chunk)
                    for i in sorted(idx[c : c + chunk], key=self.lengths.__getitem__)
                ]
            batches += [idx[b : b + global_size] for b in range(0, len(idx) - global_size + 1, global_size)]
        if self.shuffle:
            rng.shuffle(batches)
        return batches

    def __iter__(self) -> Iterator[tuple[int, list[int]]]:
        n = self.start
        while True:
            epoch, pos = divmod(n, self._per_epoch)
            batch = self.epoch_batches(epoch)[pos]
            yield n, batch[self.rank * self.batch_size : (self.rank + 1) * self.batch_size]
            n += 1

    def batches_per_epoch(self) -> int:
        return self._per_epoch


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
