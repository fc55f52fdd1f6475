"""The train stage's data: the samples a model can take, those whose cache entries are ready, and the batch
stream (bucketed by latent shapes, mixed with the regularisation set)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from qie.data.buckets import BucketBatchSampler, bucket_keys
from qie.data.mixing import MixedBatchSampler
from qie.data.samples import DataProblem, Sample, without_controls
from qie.embeddings import EmbeddingSource
from qie.errors import CacheMissError, DataError
from qie.models import ModelSpec
from qie.readiness import ready_samples
from qie.stages.common import check_masks, control_dropout, precompute_command, read_data, value
from qie.stages.recipes import regularization_samples
from qie.training.objectives import objective_requires


def load_samples(cfg: DictConfig, spec: ModelSpec, report: bool, captions: Any = None) -> list[Sample]:
    """The samples of `data.path` the model can take; the first problems found are printed when `report`.
    `captions` (`data.auto_caption`) gives samples without a caption theirs.

    Raises:
        DataError: no sample is usable with this model (e.g. an edit data set for a text-to-image model).
        CacheMissError: a caption the cache lacks (cache-only captions, `cache.on_missing=stop`).
    """
    data, dataset = cfg.data, read_data(cfg, captions=captions)
    if captions is not None and captions.misses and str(value(cfg.cache.on_missing)) == "stop":
        first = captions.misses[0]
        raise CacheMissError(f"{len(captions.misses)} samples have no cached caption, the first {first.id!r} "
                             f"({first.path}): {first.reason.split(': ', 1)[-1]} "
                             "(or cache.on_missing=skip trains on the rest)")  # fmt: skip
    pairs = "rejected" in objective_requires(str(cfg.train.objective))
    problems = [
        DataProblem(s.id, str(s.target), why)
        for s in dataset.samples
        if (why := spec.control_problem(len(s.controls)) or spec.layers_problem(len(s.layers))
            or pair_problem(s, pairs))  # fmt: skip
    ]
    skipped = {p.id for p in problems}
    samples = [s for s in dataset.samples if s.id not in skipped]
    if not pairs and any(s.rejected is not None for s in samples):  # not read: no rejected latent is asked for
        samples = [replace(s, rejected=None) if s.rejected is not None else s for s in samples]
    problems = dataset.problems + problems
    if not samples:
        raise DataError(f"no sample of {data.path} can train model={spec.name}: {problems[0].reason}")
    for p in problems[:5] if report else []:
        print(f"qie: skipping sample {p.id!r}: {p.path}: {p.reason}")
    return samples


def pair_problem(sample: Sample, pairs: bool) -> str | None:
    """Why `sample` cannot train an objective of preference pairs (`pairs`): it has no rejected result."""
    if pairs and sample.rejected is None:
        return ("it has no rejected result, which train.objective=dpo trains on: give one (a manifest row's "
                "'rejected', rejected_images/<stem>.png, data.columns.rejected)")  # fmt: skip
    return None


def ready_data(cfg: DictConfig, spec: ModelSpec, source: EmbeddingSource, samples: list[Sample], run_dir: Path,
               report: bool, captions: Any = None) -> tuple[list[Sample], list[Sample]]:  # fmt: skip
    """The `samples` and the regularisation set's samples whose cache entries are all there (`ready_samples`;
    with reference dropout, their text-only entries too)."""
    on_missing, cache_dir, command = str(value(cfg.cache.on_missing)), cfg.cache.get("dir"), precompute_command(cfg)
    samples = ready_samples(source, samples, run_dir, on_missing, cache_dir, report, command)
    reg = regularization_samples(cfg, spec, captions)
    reg = ready_samples(source, reg, run_dir, on_missing, cache_dir, False, command) if reg else []
    if control_dropout(cfg):  # the text-only entries too
        kept = {s.id for s in ready_samples(source, [without_controls(s) for s in samples + reg], run_dir,
                                            on_missing, cache_dir, False, command)}  # fmt: skip
        samples, reg = [s for s in samples if s.id in kept], [s for s in reg if s.id in kept]
    return check_masks(source, samples, report), reg  # each loss mask read and checked at start


def loader_settings(data: DictConfig, source: EmbeddingSource) -> tuple[int, int, bool]:
    """(worker processes, prefetched batches, whether they are read in parallel) of the training loader:
    `data.num_workers` and `data.prefetch` for a source that only reads, none for one that encodes (encoders may
    sit on a GPU, which forked workers cannot use, and are not run ahead of the step); prefetched batches are read
    in parallel from a cache whose every read is a round trip (`CacheBackend.remote_reads`)."""
    if source.encodes:
        return 0, 0, False
    remote = source.cache is not None and source.cache.backend.remote_reads
    return int(data.num_workers), int(data.prefetch), remote


def make_sampler(
    cfg: DictConfig, samples: list[Sample], accelerator: Any, start: int, extra: list[Sample] | None = None
) -> BucketBatchSampler | MixedBatchSampler:
    """The resumable batch stream of this process, bucketed by latent shapes when batches hold several samples;
    with `extra` (regularisation samples, after `samples` in the dataset) mixed in by `data.regularization.ratio`."""
    if extra:
        main, other = make_sampler(cfg, samples, accelerator, 0), make_sampler(cfg, extra, accelerator, 0)
        ratio, accumulation = float(cfg.data.regularization.ratio), int(cfg.train.gradient_accumulation_steps)
        return MixedBatchSampler(main, other, len(samples), ratio, int(cfg.train.seed), accumulation, start)
    batch_size = int(cfg.data.batch_size)
    # Batches of one never mix shapes: skip reading every image header.
    keys: list = [0] * len(samples)
    if batch_size > 1:
        index = Path(cfg.cache.dir) / "image_sizes.json" if cfg.cache.get("dir") else None
        areas = (int(cfg.data.target_pixels), int(cfg.model.vae_image_pixels), int(cfg.data.multiple_of))
        keys = bucket_keys(samples, *areas, index=index)
    sampler = BucketBatchSampler(keys, [len(s.prompt) for s in samples], batch_size, int(cfg.train.seed),
                                 bool(cfg.data.shuffle), accelerator.num_processes, accelerator.process_index,
                                 start=start)  # fmt: skip
    accelerator.print(f"qie: data: {sampler.summary()}")
    return sampler
