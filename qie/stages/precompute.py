"""The precompute stage: encode a data set (or a range of it) once into the cache.

Each process of an `accelerate launch` / `torchrun` takes a disjoint share. Samples that share any entry
(one control image with several instructions, one target with several controls) land on one process, so
no entry is encoded twice; the shares are balanced by sample count. Independent runs on one cache claim
each entry (a lock file) before encoding it, so they do not encode anything twice either. Entries already
present and intact (judged by the header; with `cache.repair=true` the checksum of every entry's bytes is
read too) are skipped, as are duplicates within the run; samples are grouped by which types they
miss, so exactly the missing entries are computed. A sample that cannot be read, or whose values are not
finite, is recorded (summary, failures.jsonl, and the cache's failure list that training reads) and the
run goes on, unless `precompute.on_error=raise`. `precompute.start`/`end` slice the usable samples in id
order; problems found while scanning the data set are reported by every run.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from qie.cache import build_backend
from qie.cache.base import CacheBackend
from qie.cache.failures import update_failures
from qie.components import prepare_model
from qie.data.samples import DataProblem, Dataset, Sample, without_controls
from qie.errors import ConfigError, DataError, check_writable
from qie.progress import progress
from qie.stages import common
from qie.stages.auto_caption import CAPTION_TYPE, AutoCaptions
from qie.stages.common import build_encoder, control_dropout, file_hasher, image_sizes, model_key_context, value
from qie.stages.precompute_work import (
    Keyed,
    PrecomputeSummary,
    TypeSummary,
    encode_groups,
    keys_of,
    plan,
    record_failure,
    share,
)
from qie.stages.recipes import regularization_samples

__all__ = ["PrecomputeSummary", "TypeSummary", "format_summary", "run", "share"]


@dataclass(frozen=True)
class Settings:
    """The precompute stage's own settings, read from the config once."""

    batch_size: int
    raise_errors: bool
    start: int
    end: int | None
    model: Any  # the ModelSpec: which control-image counts it takes


def run(cfg: DictConfig, run_dir: Path) -> PrecomputeSummary:
    """Fill the cache for `cfg.data` with `cfg.model`; returns (and writes) the summary.

    Raises:
        ConfigError: no data.path, no persistent cache, a bad batch size.
        DataError: no usable sample; with on_error=raise, the first unreadable sample.
        StorageError: a cache or run folder that cannot be written (found before any model is built).
    """
    from accelerate import PartialState

    settings = read_settings(cfg)
    repair = bool(cfg.cache.get("repair", False))
    backend = build_backend(cfg.cache._target_, cfg.cache.dir, verify_reads=repair, settings=cfg.cache)
    backend.check_access(write=True)
    check_writable(Path(run_dir), "the run directory (hydra.run.dir)")
    # Without CUDA, accelerate only sees the processes of torchrun / `accelerate launch` when told it is on
    # the CPU; otherwise each would think it is alone and encode everything.
    state = PartialState(cpu=not torch.cuda.is_available())
    common.warn_single_process(state.num_processes, "qie.precompute")
    hasher = file_hasher(cfg)
    captions = common.auto_captions(cfg, settings.model, True, backend, hasher)
    with state.main_process_first():  # the main process writes the missing captions, the others read them
        items = dataset_range(cfg, settings, captions)
    summary = PrecomputeSummary.of(items)
    main = state.is_main_process
    if main:  # what every process finds alike, the main one reports
        summary.temp_files_removed = backend.sweep_temp()
    keyed = key_samples(items, model_key_context(cfg, settings.model), hasher, settings, summary, report=main)
    mine = share(keyed, state.num_processes, state.process_index)
    # Samples in the range: this process's share, plus (main) those that failed before it was dealt.
    summary.samples = len(mine) + (len(items) - len(keyed) if main else 0)
    checked = Repairing(backend) if repair else backend
    groups = plan(mine, checked, summary)
    encode(cfg, groups, checked, summary, settings, f"precompute[{state.process_index}]" * (state.num_processes > 1))
    hasher.save()
    totals = {k: sum(getattr(s, k) for s in summary.types.values()) for k in ("new", "bytes_written")}
    summary.processes = [{"process": state.process_index, "samples": summary.samples, **totals}]
    if captions is not None and main:  # the main process wrote them (the others read them afterwards)
        c = captions.counts
        summary.types[CAPTION_TYPE] = TypeSummary(c.new, c.cached, c.failed, c.bytes_written)
    summary = finish(state, summary, backend, cfg.cache.dir, Path(run_dir))
    common.leave_process_group(state)
    return summary


class Repairing:
    """A backend whose `intact` also reads the entry and checks its checksum (`cache.repair=true`): precompute
    then re-encodes entries whose bytes changed, not only those that are missing or cut short."""

    def __init__(self, backend: CacheBackend) -> None:
        self.backend = backend

    def intact(self, type: str, key: str) -> bool:
        return self.backend.intact(type, key) and self.backend.get(type, key) is not None

    def __getattr__(self, name: str):
        return getattr(self.backend, name)


def read_settings(cfg: DictConfig) -> Settings:
    """The stage's settings, checked: ConfigError for a missing data set, a cache that keeps nothing, or a
    batch size below 1."""
    if not cfg.data.path:
        raise ConfigError("data.path is not set: point it at a data set folder or manifest")
    if cfg.cache.name == "none" or not cfg.cache.get("dir"):
        raise ConfigError("precompute needs a persistent cache: use cache=ssd cache.dir=FOLDER")
    p = cfg.precompute
    if int(p.batch_size) < 1:
        raise ConfigError(f"precompute.batch_size={p.batch_size} is out of range: it must be at least 1")
    raise_errors = str(value(p.on_error)) == "raise"
    return Settings(int(p.batch_size), raise_errors, p.start, p.end, prepare_model(cfg.model))


def dataset_range(
    cfg: DictConfig, settings: Settings, captions: AutoCaptions | None = None
) -> list[Sample | DataProblem]:
    """The samples and scan problems of `precompute.start`..`end`, in id order (see `common.sample_range`), with
    what training also reads: the regularisation set and, with reference dropout, the text-only variants.
    `captions` (`data.auto_caption`) gives the samples without a caption theirs."""
    data = common.read_data(cfg, captions=captions)
    # Reference dropout trains samples on their text-only prompts too: those are entries of their own.
    text_only = [without_controls(s, "#text_only") for s in data.samples if s.controls] if control_dropout(cfg) else []
    reg = regularization_samples(cfg, settings.model, captions)  # cached like the main set
    reg_text_only = [without_controls(s, "#text_only") for s in reg if s.controls] if text_only else []
    everything = Dataset([*data.samples, *text_only, *reg, *reg_text_only], data.problems)
    return common.sample_range(
        cfg, settings.start, settings.end, settings.raise_errors, "precompute.on_error", everything
    )


def key_samples(items: list, ctx, hasher, settings: Settings, summary: PrecomputeSummary, report: bool) -> list[Keyed]:
    """(sample, keys) of the usable samples; the others are recorded as failures (by the `report`ing process)."""
    keyed = []
    for item in items:
        if isinstance(item, DataProblem):
            if report:
                record_failure(summary, None, DataError(item.reason), summary.types, problem=item)
            continue
        try:
            keyed.append((item, keys_of(item, ctx, hasher, settings.model)))
        except DataError as e:
            if settings.raise_errors:
                raise
            if report:
                record_failure(summary, item, e, summary.types)
    return keyed


def encode(cfg: DictConfig, groups: dict, backend: CacheBackend, summary, settings: Settings, desc: str) -> None:
    """Encode the planned groups; the encoders are built on the first batch that needs them, never when
    everything is cached."""
    encoder = []

    def get_encoder():
        if not encoder:
            encoder.append(build_encoder(cfg, settings.model))
        return encoder[0]

    todo = sum(len(g) for g in groups.values())
    with progress(todo, desc or "precompute", unit="sample", disable=not todo) as bar:
        sizes = image_sizes(cfg, settings.model)
        encode_groups(
            get_encoder, groups, backend, sizes, summary, settings.batch_size, settings.raise_errors, bar.update
        )  # fmt: skip


def finish(state, summary: PrecomputeSummary, backend, cache_dir, run_dir: Path) -> PrecomputeSummary:
    """Gather the processes' summaries; the main process writes them, the failure list and the report."""
    from accelerate.utils import gather_object

    if state.num_processes > 1:
        total = PrecomputeSummary(types={})
        for part in gather_object([summary]):
            total.merge(part)
        summary = total
    if state.is_main_process:
        update_failures(cache_dir, summary.failed_entries, summary.written)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "precompute_summary.json").write_text(json.dumps(summary.to_dict(), indent=2))
        common.write_failures(run_dir, summary.failures)
        print(format_summary(summary, run_dir))
    return summary


def format_summary(summary: PrecomputeSummary, run_dir: Path) -> str:
    lines = [f"precompute: {summary.samples} samples"]
    lines.append(f"  {'type':26s}{'new':>8s}{'skipped':>9s}{'failed':>8s}{'MiB written':>13s}")
    for t, s in summary.types.items():
        lines.append(f"  {t:26s}{s.new:8d}{s.skipped:9d}{s.failed:8d}{s.bytes_written / 2**20:13.2f}")
    lines.append("  (prompt_embeds_mask and empty_prompt_embeds_mask are derived from the embeddings: not stored)")
    if len(summary.processes) > 1:
        lines += [f"  process {p['process']}: {p['samples']} samples, {p['new']} new" for p in summary.processes]
    if summary.temp_files_removed:
        lines.append(f"  removed {summary.temp_files_removed} temp files of interrupted writers")
    if summary.claimed_by_others:
        lines.append(f"  {summary.claimed_by_others} entries were written by another run on this cache meanwhile")
    failed = sorted({p.id for p in summary.failures})
    if failed:
        lines.append(f"  {len(failed)} samples could not be encoded; training skips them with a warning:")
    for p in summary.failures[:10]:
        lines.append(f"  failed: {p.id}: {p.path}: {p.reason}")
    if len(summary.failures) > 10:
        lines.append(f"  ... {len(summary.failures) - 10} more in failures.jsonl")
    if summary.failures:
        lines.append(f"  failures: {run_dir / 'failures.jsonl'}")
    lines.append(f"  summary: {run_dir / 'precompute_summary.json'}")
    return "\n".join(lines)
