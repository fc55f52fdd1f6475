"""Training batches: sample indices in, collated embedding batches out, through a DataLoader."""

from __future__ import annotations

import os
import random
import signal
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch

from qie.data.collate import collate
from qie.data.prefetch import OrderedReadAhead, Prefetcher
from qie.data.samples import Sample, without_controls
from qie.embedding.sources import EmbeddingSource
from qie.errors import QieError
from qie.types import Batch


@dataclass
class BatchFailure:
    """A user-facing error raised while loading a batch, carried out of a loader worker as a value.

    torch re-raises worker exceptions with the worker's traceback pasted into the message; carrying the
    error out and raising it in the main process keeps the message the user reads clean.
    """

    error: QieError


class EmbeddingDataset:
    """Maps (batch number, indices) from a BucketBatchSampler to (batch number, Batch).

    Caption dropout swaps in a sample's own empty-prompt embedding; control dropout trains a whole batch on its
    samples' text-only prompts, without control images. The choices depend only on (seed, batch number,
    position), so they are the same for every source and on resume.
    """

    def __init__(
        self,
        samples: Sequence[Sample],
        source: EmbeddingSource,
        caption_dropout_rate: float = 0.0,
        seed: int = 0,
        control_dropout_rate: float = 0.0,
        weighted_from: int | None = None,
        weight: float = 1.0,
        negatives: bool = False,
    ) -> None:
        """`weighted_from`, `weight`: batches of samples from that index on (the regularisation set) have their
        loss multiplied by `weight`. `negatives`: batches carry each sample's empty-prompt embedding (`collate`)."""
        self.samples, self.source = list(samples), source
        self.caption_dropout_rate, self.seed = caption_dropout_rate, seed
        self.control_dropout_rate = control_dropout_rate
        self.weighted_from, self.weight = weighted_from, weight
        self.negatives = negatives

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, item: tuple[int, list[int]]) -> tuple[int, Batch | BatchFailure]:
        number, indices = item
        batch = [self.samples[i] for i in indices]
        # A whole batch drops its controls or none does (a batch shares its latent shapes); its own draw, so
        # caption dropout draws the same with or without it.
        if self.control_dropout_rate and random.Random(f"{self.seed}:{number}:controls").random() < (
            self.control_dropout_rate
        ):
            batch = [without_controls(s) for s in batch]
        try:
            embeds = self.source.get(batch)
        except QieError as e:
            return number, BatchFailure(e)
        rng = random.Random(f"{self.seed}:{number}")
        drop = [rng.random() < self.caption_dropout_rate for _ in indices]
        out = collate(embeds, drop, self.negatives)
        if self.weighted_from is not None and indices[0] >= self.weighted_from:
            out.loss_weight = self.weight
        return number, out


def _worker_signals(worker_id: int) -> None:
    # Ctrl-C reaches the whole process group; the main process turns it into a clean stop and needs its
    # workers until then. SIGTERM (a scheduler's, or multiprocessing ending its workers at exit) must end a
    # worker, and quietly: torch raises in the main process, mid-step, for a worker killed by a signal.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _exit_quietly)


def _exit_quietly(signum: int, frame: object) -> None:
    os._exit(0)


def make_loader(
    dataset: EmbeddingDataset,
    sampler: Iterable[tuple[int, list[int]]],
    num_workers: int,
    seed: int,
    prefetch: int = 0,
    parallel_reads: bool = False,
) -> torch.utils.data.DataLoader:
    """A DataLoader over `sampler`'s (number, indices) items, one Batch each.

    It has its own generator, so creating its iterator draws nothing from the global RNG that a resumed
    run restores (LoRA dropout draws from that). With `prefetch` > 0 its iterator runs in a background
    thread, that many batches ahead: taking a batch from a worker (unpickling, receiving its shared-memory
    tensors) or reading it (num_workers=0) then overlaps the training step instead of stalling it. Order
    and content of the stream are unchanged. (The train stage prefetches for sources that only read.) With
    `parallel_reads` as well (a cache whose reads are round trips to a remote store) and no workers, the next
    `prefetch` batches are each read on a thread of their own (`OrderedReadAhead`), in the same order.
    """
    loader = (_PrefetchingLoader if prefetch > 0 else torch.utils.data.DataLoader)(
        dataset,
        sampler=sampler,
        batch_size=None,
        num_workers=num_workers,
        collate_fn=_identity,
        prefetch_factor=4 if num_workers else None,
        worker_init_fn=_worker_signals if num_workers else None,
        generator=torch.Generator().manual_seed(seed),
    )
    loader.prefetch_depth, loader.parallel_reads = prefetch, parallel_reads and not num_workers
    return loader


class _PrefetchingLoader(torch.utils.data.DataLoader):
    """A DataLoader whose iterator is driven by a background thread (see `Prefetcher`)."""

    def __iter__(self) -> Iterator:
        if self.parallel_reads:  # each item a function of itself alone: read out of turn, handed out in turn
            return OrderedReadAhead(self.sampler, self.dataset.__getitem__, self.prefetch_depth)
        # The DataLoader iterator is made here, in the caller's thread: it starts the worker processes and
        # sets a SIGCHLD handler, which only the main thread may do.
        return Prefetcher(super().__iter__(), self.prefetch_depth)


def _identity(x: tuple) -> tuple:
    return x


def raise_failures(stream: Iterable[tuple[int, Batch | BatchFailure]]) -> Iterator[tuple[int, Batch]]:
    """Pass batches through; raise a carried BatchFailure's error here, in the main process."""
    for number, item in stream:
        if isinstance(item, BatchFailure):
            raise item.error
        yield number, item
