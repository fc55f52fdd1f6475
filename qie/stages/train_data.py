"""The train stage's data: the samples a model can take, those whose cache entries are ready, and the batch
stream (bucketed by latent shapes, mixed with the regularisation set)."""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import replace
from operator import attrgetter
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from qie.data.buckets import BucketBatchSampler, ImageSizeIndex, bucket_keys
from qie.data.fields import SampleField, missing_problem
from qie.data.formats import DataSource
from qie.data.mixing import MixedBatchSampler
from qie.data.pairs import PairCheck
from qie.data.samples import DataProblem, Sample, without_controls
from qie.embedding.readiness import ready_samples
from qie.embedding.sources import EmbeddingSource
from qie.errors import CacheMissError, DataError
from qie.evaluation.rows import reference_row
from qie.evaluation.scoring import Row
from qie.models import ModelSpec
from qie.stages.datasets import read_data
from qie.stages.settings import file_hasher
from qie.stages.sources import check_masks
from qie.stages.train_extras import regularization_samples

if TYPE_CHECKING:
    from qie.stages.train_setup import TrainSetup


def load_samples(
    data: DataSource,
    spec: ModelSpec,
    report: bool,
    captions: Any = None,
    fields: tuple[SampleField, ...] = (),
    on_missing: str = "stop",
    targets: bool = True,
) -> list[Sample]:
    """The samples of `data` the model can take; the first problems found are printed when `report`.
    `captions` (`data.auto_caption`) gives samples without a caption theirs; a sample needs the image of each of
    `fields` (the objective's: `REJECTED` for preference pairs), and keeps no other field's; `on_missing` is
    `cache.on_missing`; without `targets` (an objective that samples its own results) a sample needs no target.

    Raises:
        DataError: no sample is usable with this model (e.g. an edit data set for a text-to-image model).
        CacheMissError: a caption the cache lacks (cache-only captions, `cache.on_missing=stop`).
    """
    dataset = read_data(data, require_target=targets, captions=captions)
    if captions is not None and captions.misses and on_missing == "stop":
        first = captions.misses[0]
        raise CacheMissError(
            f"{len(captions.misses)} samples have no cached caption, the first {first.id!r} "
            f"({first.path}): {first.reason.split(': ', 1)[-1]} "
            "(or cache.on_missing=skip trains on the rest)"
        )
    # Whether the model can take a sample depends on its kind only (control and layer counts, the fields' images
    # it has): judged once per kind, a million samples looked at column by column.
    samples, n = dataset.samples, len(dataset.samples)
    images = list(map(attrgetter("field_images"), samples))
    has = np.fromiter(map(_has_bits(fields), images), np.int64, n) if any(images) else np.zeros(n, np.int64)
    columns = [
        np.fromiter(map(len, map(attrgetter("controls"), samples)), np.int64, n),
        np.fromiter(map(len, map(attrgetter("layers"), samples)), np.int64, n),
        has,
    ]
    code = (columns[0] << 40) | (columns[1] << 20) | columns[2]  # one number per kind
    _, first, inverse = np.unique(code, return_index=True, return_inverse=True)
    why = [
        spec.control_problem(len(samples[i].controls))
        or spec.layers_problem(len(samples[i].layers))
        or field_problem(samples[i], fields)
        for i in first.tolist()
    ]
    problems = []
    if any(why):
        problems = [
            DataProblem(samples[i].id, str(samples[i].target), why[k])
            for i, k in enumerate(inverse.reshape(-1).tolist())
            if why[k]
        ]
        skipped = {p.id for p in problems}
        samples = [s for s in samples if s.id not in skipped]
    names = {f.name for f in fields}
    if any(images) and any(name not in names for x in images for name, _ in x):  # not read: the objective's only
        samples = [_only(s, names) if s.field_images else s for s in samples]
    problems = dataset.problems + problems
    if not samples:
        raise DataError(f"no sample of {data.path} can train model={spec.name}: {problems[0].reason}")
    for p in problems[:5] if report else []:
        print(f"qie: skipping sample {p.id!r}: {p.path}: {p.reason}")
    return samples


def _has_bits(fields: tuple[SampleField, ...]):
    """A function of a sample's field images: bit j set when it has the image of `fields[j]`."""
    names = [f.name for f in fields]

    def bits(images: tuple) -> int:
        have = {name for name, _ in images}
        return sum(1 << j for j, name in enumerate(names) if name in have)

    return bits


def _only(sample: Sample, names: set[str]) -> Sample:
    """`sample` with the images of the fields `names` only."""
    return replace(sample, field_images=tuple((n, p) for n, p in sample.field_images if n in names))


def field_problem(sample: Sample, fields: tuple[SampleField, ...]) -> str | None:
    """Why `sample` cannot train an objective that requires `fields`: it has no image of one of them."""
    have = sample.fields
    missing = [f for f in fields if f.name not in have]
    return missing_problem(missing[0]) if missing else None


def ready_data(
    s: TrainSetup, source: EmbeddingSource, samples: list[Sample], run_dir: Path, report: bool, captions: Any = None
) -> tuple[list[Sample], list[Sample]]:
    """The `samples` and the regularisation set's samples whose cache entries are all there (`ready_samples`;
    with reference dropout, their text-only entries too)."""
    on_missing, command = s.on_missing, s.source.precompute_command
    samples = ready_samples(source, samples, run_dir, on_missing, report, command)
    reg = regularization_samples(s.regularization, s.samples, s.spec, captions)
    reg = (
        ready_samples(
            source,
            reg,
            run_dir=run_dir,
            on_missing=on_missing,
            report=False,
            precompute_command=command,
            remember=report,
        )
        if reg
        else []
    )
    if s.dropout:  # the text-only entries too
        kept = {
            x.id
            for x in ready_samples(
                source,
                [without_controls(x) for x in samples + reg],
                run_dir=run_dir,
                on_missing=on_missing,
                report=False,
                precompute_command=command,
                remember=report,
            )
        }
        samples, reg = [x for x in samples if x.id in kept], [x for x in reg if x.id in kept]
    samples = check_pairs(s, source, samples, report)  # each pair judged at start
    return check_masks(source, samples, report), reg  # each loss mask read and checked at start


def size_index_path(state_dir: str | None) -> Path | None:
    """Where the remembered image sizes are kept in the state folder; None without one."""
    return Path(state_dir) / "image_sizes.json" if state_dir else None


def check_pairs(s: TrainSetup, source: EmbeddingSource, samples: list[Sample], report: bool) -> list[Sample]:
    """The `samples` whose preference pairs can train (`qie.data.pairs`: a rejected image that is its target
    trains nothing; a source that encodes reads each rejected image's header now); the others are skipped with a
    warning, as unreadable images and masks that train nothing are.

    Raises:
        DataError: no pair left.
    """
    if not any(x.field_images for x in samples):
        return samples
    state_dir, sizes = s.source.state_dir, s.source.sizes
    index = ImageSizeIndex(size_index_path(state_dir)) if source.encodes else None
    check = PairCheck(file_hasher(state_dir), index, sizes.target_pixels, sizes.multiple_of)
    kept, problems = [], []
    for sample in samples:
        found = check.problem(sample)
        if found is None:
            kept.append(sample)
        else:
            problems.append(DataProblem(sample.id, *found))
    if index is not None and report:
        index.save()
    for p in problems[:5] if report else []:
        print(f"qie: warning: skipping sample {p.id!r}: {p.path}: {p.reason}")
    if len(problems) > 5 and report:
        print(f"qie: ... and {len(problems) - 5} more preference pairs that cannot train")
    if not kept:
        first = problems[0]
        raise DataError(f"no preference pair can train; the first, {first.id!r}: {first.reason}")
    return kept


def loader_settings(num_workers: int, prefetch: int, source: EmbeddingSource) -> tuple[int, int, bool]:
    """(worker processes, prefetched batches, whether they are read in parallel) of the training loader:
    `data.num_workers` and `data.prefetch` for a source that only reads, none for one that encodes (encoders may
    sit on a GPU, which forked workers cannot use, and are not run ahead of the step); prefetched batches are read
    in parallel from a cache whose every read is a round trip (`CacheStore.remote_reads`)."""
    if source.encodes:
        return 0, 0, False
    remote = source.cache is not None and source.cache.backend.remote_reads
    return num_workers, prefetch, remote


def make_sampler(
    s: TrainSetup, samples: list[Sample], accelerator: Any, start: int, extra: list[Sample] | None = None
) -> BucketBatchSampler | MixedBatchSampler:
    """The resumable batch stream of this process, bucketed by latent shapes when batches hold several samples;
    with `extra` (regularisation samples, after `samples` in the dataset) mixed in by `data.regularization.ratio`."""
    if extra:
        main, other = make_sampler(s, samples, accelerator, 0), make_sampler(s, extra, accelerator, 0)
        ratio, accumulation = s.regularization.ratio, s.train.gradient_accumulation_steps  # type: ignore[union-attr]
        return MixedBatchSampler(
            main, other, offset=len(samples), ratio=ratio, seed=s.train.seed, accumulation=accumulation, start=start
        )
    data, batch_size = s.data, s.data.batch_size
    # Batches of one never mix shapes: skip reading every image header.
    keys: list = [0] * len(samples)
    if batch_size > 1:
        index = size_index_path(s.source.state_dir)
        areas = (data.target_pixels, int(s.spec.vae_image_pixels), data.multiple_of)
        keys = bucket_keys(samples, *areas, index=index)
    sampler = BucketBatchSampler(
        keys,
        [len(x.prompt) for x in samples],
        batch_size,
        seed=s.train.seed,
        shuffle=data.shuffle,
        num_replicas=accelerator.num_processes,
        rank=accelerator.process_index,
        start=start,
    )
    accelerator.print(f"qie: data: {sampler.summary()}")
    return sampler


def sample_rows(
    samples: list[Sample], spec: ModelSpec
) -> Callable[[str, tuple[int, int] | None, Collection[str]], Row]:
    """A sample id's row at an edit's size (width, height), its images read when asked, for an objective that
    scores its own results (`reference_row`: prompt, control images, and the target and edit region where the
    sample has them and the reward `needs` them); an id of a variant (`#text_only`) is its sample's. The samples are
    indexed by id on the first call (a run whose objective reads no rows indexes nothing)."""
    by_id: dict[str, Sample] = {}

    def row(sample_id: str, size: tuple[int, int] | None, needs: Collection[str]) -> Row:
        if not by_id:
            by_id.update((s.id, s) for s in samples)
        return reference_row(by_id.get(sample_id) or by_id[sample_id.split("#")[0]], size, spec, None, needs)

    return row
