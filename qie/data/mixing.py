"""Regularisation data mixed into training: whole optimizer steps drawn from a second data set.

Step s (its `accumulation` batches) comes from the regularisation set with probability `ratio`, decided from
(seed, s) alone, so a resumed run replays the same choice, and each set's own sampler resumes where it was.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

from qie.data.buckets import BucketBatchSampler

REG_PREFIX = "reg/"  # ids of regularisation samples (apart from the main set's, and logged apart)


class MixedBatchSampler:
    """(batch number, indices) of `main`'s batches and of `extra`'s, whose indices are shifted by `offset` (the
    main set's size: the dataset holds main samples, then extra ones)."""

    def __init__(
        self,
        main: BucketBatchSampler,
        extra: BucketBatchSampler,
        offset: int,
        ratio: float,
        seed: int = 0,
        accumulation: int = 1,
        start: int = 0,
    ) -> None:
        self.main, self.extra, self.offset = main, extra, offset
        self.ratio, self.seed, self.accumulation, self.start = ratio, seed, max(1, accumulation), start

    def is_extra(self, number: int) -> bool:
        """Whether batch `number` comes from the regularisation set (the same for a whole optimizer step)."""
        return random.Random(f"{self.seed}:regularization:{number // self.accumulation}").random() < self.ratio

    def __iter__(self) -> Iterator[tuple[int, list[int]]]:
        extra_before = sum(self.is_extra(n) for n in range(self.start))
        self.main.start, self.extra.start = self.start - extra_before, extra_before
        main, extra = iter(self.main), iter(self.extra)
        n = self.start
        while True:
            if self.is_extra(n):
                yield n, [i + self.offset for i in next(extra)[1]]
            else:
                yield n, next(main)[1]
            n += 1

    def summary(self) -> str:
        return f"{self.main.summary()}; regularisation: {self.extra.summary()}, ratio {self.ratio}"
