"""The training data set: batches of sample indices in, collated embedding batches out."""

from __future__ import annotations

import random
import signal
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch
from PIL import Image

from qie.data.collate import Batch, collate
from qie.data.images import fit_area
from qie.data.samples import Sample
from qie.embeddings import EmbeddingSource
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


def _ignore_stop_signals(worker_id: int) -> None:
    # Ctrl-C and SIGTERM reach the whole process group; the main process turns them into a clean stop and
    # needs its workers alive until then (they exit with it).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def make_loader(
    dataset: EmbeddingDataset, sampler: Iterable[tuple[int, list[int]]], num_workers: int, seed: int
) -> torch.utils.data.DataLoader:
    """A DataLoader over `sampler`'s (number, indices) items, one Batch each.

    It has its own generator, so creating its iterator draws nothing from the global RNG that a resumed
    run restores (LoRA dropout draws from that).
    """
    return torch.utils.data.DataLoader(
        dataset,
        sampler=sampler,
        batch_size=None,
        num_workers=num_workers,
        collate_fn=_identity,
        prefetch_factor=4 if num_workers else None,
        worker_init_fn=_ignore_stop_signals if num_workers else None,
        generator=torch.Generator().manual_seed(seed),
    )


def _identity(x: tuple) -> tuple:
    return x


def raise_failures(stream: Iterable[tuple[int, Batch | BatchFailure]]) -> Iterator[tuple[int, Batch]]:
    """Pass batches through; raise a carried BatchFailure's error here, in the main process."""
    for number, item in stream:
        if isinstance(item, BatchFailure):
            raise item.error
        yield number, item


def bucket_keys(samples: Sequence[Sample], target_pixels: int, vae_pixels: int, multiple: int) -> list[tuple]:
    """Per sample, the sizes its target and control latents will have (read from image headers only).

    Mirrors `prepare_target` (target area, `multiple`) and `condition_images` (VAE area, multiple of 32).
    """
    keys = []
    for s in samples:
        sizes = []
        for path, area, mult in [(s.target, target_pixels, multiple)] + [(c, vae_pixels, 32) for c in s.controls]:
            with Image.open(path) as im:
                sizes.append(fit_area(im.width, im.height, area, mult))
        keys.append(tuple(sizes))
    return keys
