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

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from qie.cache.base import CacheBackend
from qie.cache.failures import update_failures
from qie.checks import Checked, check
from qie.components import prepare_model
from qie.config.backend import build_backend
from qie.config.groups import Groups
from qie.data.fields import SampleField, run_fields, with_defaults
from qie.data.formats import DataSource
from qie.data.samples import DataProblem, Dataset, Sample, without_controls
from qie.embedding.encode import Encoder, ImageSizes
from qie.errors import ConfigError, DataError, check_writable
from qie.progress import progress
from qie.stages.auto_caption import CAPTION_TYPE, AutoCaptions, CaptionSettings, auto_captions, caption_settings
from qie.stages.datasets import read_data, sample_range, write_failures
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
from qie.stages.processes import leave_process_group, warn_single_process
from qie.stages.recipe import Recipe
from qie.stages.settings import (
    Regularization,
    SourceSettings,
    data_source,
    file_hasher,
    regularization,
    source_settings,
)
from qie.stages.sources import build_encoder, model_key_context
from qie.stages.teacher_fill import check_processes, fill_teachers
from qie.stages.train_extras import regularization_samples
from qie.stages.train_setup import TrainSetup, train_setup
from qie.training.objectives import objective_class, trains_on_targets

__all__ = ["PrecomputeRecipe", "PrecomputeSummary", "TypeSummary", "format_summary", "run", "share", "start"]


@dataclass(frozen=True, kw_only=True)
class Settings:
    """The precompute stage's own settings, read from the config once."""

    batch_size: int
    raise_errors: bool
    start: int
    end: int | None
    model: Any  # the ModelSpec: which control-image counts it takes
    backend: CacheBackend  # `cache`'s backend; with `cache.repair`, it checks every entry's checksum on reads
    repair: bool
    sizes: ImageSizes  # the target and condition sizes images are encoded at
    make_encoder: Callable[[], Encoder]  # builds the encoders (on the first batch that needs them)
    source: SourceSettings  # the model, sizes, cache folder and encoder devices (cache keys, captions)
    samples: DataSource  # where `data.path`'s samples come from
    dropout: float  # `data.control_dropout_rate`: the text-only prompts are cached too
    regularization: Regularization | None  # cached like the main set
    captions: CaptionSettings | None  # `data.auto_caption`
    # Whether the training run's objective trains on targets: else rows without one are filled (their prompt and
    # control entries) instead of skipped.
    targets: bool = True


def run(cfg: DictConfig, run_dir: Path) -> PrecomputeSummary:
    """Fill the cache for `cfg.data` with `cfg.model` (the stage from code: `cfg` checked once, `qie.checks.check`,
    then `start`); returns (and writes) the summary.

    Raises:
        ConfigError: no data.path, no persistent cache.
        DataError: no usable sample, or none could be encoded; with on_error=raise, the first unreadable sample.
        StorageError: a cache or run folder that cannot be written (found before any model is built).
    """
    return start(check(cfg), run_dir)


def start(checked: Checked, run_dir: Path) -> PrecomputeSummary:
    """The stage's edge: a checked config's typed groups read into its settings (`read_settings`), then run by the
    `PrecomputeRecipe`. See `run`."""
    groups, command = checked.groups, checked.precompute_command
    if not groups.data.path:
        raise ConfigError("data.path is not set: point it at a data set folder or manifest")
    objective = objective_class(groups.train.objective)
    fields = with_defaults(run_fields(objective.requires))  # the sample fields encoded: every one it requires
    settings = read_settings(groups, functools.partial(build_backend, groups.cache), command, fields)
    settings = replace(settings, targets=trains_on_targets(objective))
    teachers = None  # `precompute.teachers`: the training run's setup, checked before anything is encoded
    if groups.precompute.teachers:
        teachers = train_setup(settings.model, groups, command, {})
    return PrecomputeRecipe(settings, Path(run_dir), teachers).execute()


class PrecomputeRecipe(Recipe):
    """The precompute stage: `setup()` checks where it writes, joins the processes and keys this process's share
    of the samples; `run()` encodes what is missing (and the teacher outputs), gathers and writes the summary;
    `cleanup()` has nothing to give back (the processes leave their group once the run is done).

    Args:
        settings: the stage's settings (`read_settings`).
        run_dir: where the summary and failure list are written (hydra.run.dir).
        teachers: the training run's setup where `precompute.teachers` asks for its targets, else None.
    """

    def __init__(self, settings: Settings, run_dir: Path, teachers: TrainSetup | None = None) -> None:
        self.settings, self.run_dir, self.teachers = settings, run_dir, teachers

    def setup(self) -> None:
        self._setup_processes()
        self._setup_samples()

    def run(self) -> PrecomputeSummary:
        settings, summary, state = self.settings, self.summary, self.state
        backend, main = settings.backend, state.is_main_process
        groups = plan(self.mine, backend, summary, settings.repair)
        desc = f"precompute[{state.process_index}]" * (state.num_processes > 1)
        encode(groups, summary, settings, desc)
        self.hasher.save()
        if self.teachers is not None:  # this process's share is encoded: its embeddings are in the cache
            mine = [s for s, _ in self.mine]
            filled, counts = fill_teachers(self.teachers, mine, backend, self.run_dir, desc)
            summary.types[filled] = counts
        totals = {k: sum(getattr(s, k) for s in summary.types.values()) for k in ("new", "bytes_written")}
        summary.processes = [{"process": state.process_index, "samples": summary.samples, **totals}]
        if self.captions is not None and main:  # the main process wrote them (the others read them afterwards)
            c = self.captions.counts
            summary.types[CAPTION_TYPE] = TypeSummary(c.new, c.cached, c.failed, c.bytes_written)
        summary = finish(state, summary, backend, self.run_dir)
        leave_process_group(state)
        if main:
            refuse_if_none_encoded(summary, self.run_dir)
        return summary

    def _setup_processes(self) -> None:
        """Check the cache and run folder can be written, before any model is built, and join the processes."""
        from accelerate import PartialState

        self.settings.backend.check_access(write=True)
        check_writable(self.run_dir, "the run directory (hydra.run.dir)")
        # Without CUDA, accelerate only sees the processes of torchrun / `accelerate launch` when told it is on
        # the CPU; otherwise each would think it is alone and encode everything.
        self.state = PartialState(cpu=not torch.cuda.is_available())
        warn_single_process(self.state.num_processes, "qie.precompute")
        if self.teachers is not None:
            check_processes(self.teachers, self.state.num_processes)

    def _setup_samples(self) -> None:
        """The range's samples (captions written where `data.auto_caption` asks), keyed; this process's share."""
        settings, state, backend = self.settings, self.state, self.settings.backend
        self.hasher = hasher = file_hasher(settings.source.state_dir)
        self.captions = auto_captions(settings.captions, settings.source, settings.model, True, backend, hasher)
        with state.main_process_first():  # the main process writes the missing captions, the others read them
            items = dataset_range(settings, self.captions)
        self.summary = summary = PrecomputeSummary.of(items)
        main = state.is_main_process
        if main:  # what every process finds alike, the main one reports
            summary.temp_files_removed = backend.sweep_temp()
        context = model_key_context(settings.source.model, settings.model, settings.sizes)
        keyed = key_samples(items, context, hasher, settings, summary, report=main)
        self.mine = share(keyed, state.num_processes, state.process_index)
        # Samples in the range: this process's share, plus (main) those that failed before it was dealt.
        summary.samples = len(self.mine) + (len(items) - len(keyed) if main else 0)


def refuse_if_none_encoded(summary: PrecomputeSummary, run_dir: Path) -> None:
    """Raise DataError when every sample of the run failed (nothing of it can train), after the summary and the
    failure list are written: the run exits non-zero."""
    failed = {p.id for p in summary.failures}
    if summary.samples and len(failed) >= summary.samples:
        first = summary.failures[0]
        raise DataError(
            f"none of the {summary.samples} samples could be encoded (all listed in "
            f"{run_dir / 'failures.jsonl'}); the first, {first.id!r}: {first.reason}"
        )


def read_settings(
    groups: Groups, make_backend: Callable[..., CacheBackend], command: str, fields: tuple[SampleField, ...]
) -> Settings:
    """The stage's settings, and the cache backend built (`make_backend`, given the stage's `verify_reads`):
    ConfigError for a cache that does not outlive the process, or a caption prompt that cannot be read.

    Args:
        groups: the config's groups (`qie.checks.read_groups`): model, data, cache and precompute are read.
        command: the precompute command that fills this cache (what a training run's miss names).
        fields: the sample fields whose images are read and encoded (`qie.data.fields`).
    """
    model, data, cache, p = groups.model, groups.data, groups.cache, groups.precompute
    # `cache.repair`: every existing entry is read once, and those whose checksum fails are encoded again.
    repair = cache.repair
    backend = make_backend(verify_reads=repair)
    if not backend.persists:
        raise ConfigError(
            f"precompute needs a persistent cache, and {backend!r} keeps nothing once the process "
            "ends: use cache=ssd cache.dir=FOLDER"
        )
    raise_errors = p.on_error == "raise"
    spec = prepare_model(model)
    source = source_settings(model, data, cache, spec, None, command)
    captions = caption_settings(data.auto_caption_prompt, spec) if data.auto_caption else None
    return Settings(
        batch_size=p.batch_size,
        raise_errors=raise_errors,
        start=p.start,
        end=p.end,
        model=spec,
        backend=backend,
        repair=repair,
        sizes=source.sizes,
        make_encoder=functools.partial(build_encoder, model, spec, source.devices),
        source=source,
        samples=replace(data_source(data, cache.state_folder()), fields=fields),
        dropout=data.control_dropout_rate,
        regularization=regularization(data),
        captions=captions,
    )


def dataset_range(settings: Settings, captions: AutoCaptions | None = None) -> list[Sample | DataProblem]:
    """The samples and scan problems of `precompute.start`..`end`, in id order (see `sample_range`), with what
    training also reads: the regularisation set and, with reference dropout, the text-only variants.
    `captions` (`data.auto_caption`) gives the samples without a caption theirs."""
    data = read_data(settings.samples, require_target=settings.targets, captions=captions)
    # Reference dropout trains samples on their text-only prompts too: those are entries of their own.
    text_only = [without_controls(s, "#text_only") for s in data.samples if s.controls] if settings.dropout else []
    # cached like the main set
    reg = regularization_samples(settings.regularization, settings.samples, settings.model, captions)
    reg_text_only = [without_controls(s, "#text_only") for s in reg if s.controls] if text_only else []
    everything = Dataset([*data.samples, *text_only, *reg, *reg_text_only], data.problems)
    return sample_range(everything, settings.start, settings.end, settings.raise_errors, "precompute.on_error")


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


def encode(groups: dict, summary, settings: Settings, desc: str) -> None:
    """Encode the planned groups; the encoders are built on the first batch that needs them, never when
    everything is cached."""
    encoder = []

    def get_encoder():
        if not encoder:
            encoder.append(settings.make_encoder())
        return encoder[0]

    todo = sum(len(g) for g in groups.values())
    with progress(todo, desc or "precompute", unit="sample", disable=not todo) as bar:
        encode_groups(
            get_encoder,
            groups,
            backend=settings.backend,
            sizes=settings.sizes,
            summary=summary,
            batch_size=settings.batch_size,
            raise_errors=settings.raise_errors,
            progress=bar.update,
            repair=settings.repair,
        )


def finish(state, summary: PrecomputeSummary, backend, run_dir: Path) -> PrecomputeSummary:
    """Gather the processes' summaries; the main process writes them, the failure list and the report."""
    from accelerate.utils import gather_object

    if state.num_processes > 1:
        total = PrecomputeSummary(types={})
        for part in gather_object([summary]):
            total.merge(part)
        summary = total
    if state.is_main_process:
        update_failures(backend, summary.failed_entries, summary.written)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "precompute_summary.json").write_text(json.dumps(summary.to_dict(), indent=2))
        write_failures(run_dir, summary.failures)
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
