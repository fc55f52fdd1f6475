"""The precompute stage: encode a data set (or a range of it) once into the cache.

Each process of an `accelerate launch` / `torchrun` takes a disjoint share. Samples that share any entry
(one control image with several instructions, one target with several controls) land on one process, so
no entry is encoded twice; the shares are balanced by sample count. Entries already present and intact
are skipped, as are duplicates within the run; samples are grouped by which types they miss, so exactly
the missing entries are computed. A sample that cannot be read is recorded (summary + failures.jsonl)
and the run goes on, unless `precompute.on_error=raise`. `precompute.start`/`end` slice the usable samples
in id order; problems found while scanning the data set are reported by every run.
"""

from __future__ import annotations

import json
import os
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from omegaconf import DictConfig

from qie.cache import SCHEMA_VERSION, build_backend
from qie.config.cache import CACHE_TYPES
from qie.data.images import ImageError
from qie.data.keys import sample_keys
from qie.data.samples import DataProblem, Sample
from qie.encode import Encoder, ImageSizes, PreparedSample, prepare_sample
from qie.errors import ConfigError, DataError
from qie.models import model_spec
from qie.progress import progress
from qie.stages import common
from qie.stages.common import build_encoder, file_hasher, image_sizes, model_key_context, read_data, value

Keyed = tuple[Sample, dict[str, str]]


@dataclass
class TypeSummary:
    new: int = 0
    skipped: int = 0
    failed: int = 0
    bytes_written: int = 0


@dataclass
class PrecomputeSummary:
    samples: int = 0
    types: dict[str, TypeSummary] = field(default_factory=lambda: {t: TypeSummary() for t in CACHE_TYPES})
    failures: list[DataProblem] = field(default_factory=list)
    # One row per process: {"process", "samples", "new", "bytes_written"}.
    processes: list[dict] = field(default_factory=list)
    temp_files_removed: int = 0

    def merge(self, other: PrecomputeSummary) -> None:
        self.samples += other.samples
        for t, s in other.types.items():
            for name in ("new", "skipped", "failed", "bytes_written"):
                setattr(self.types[t], name, getattr(self.types[t], name) + getattr(s, name))
        self.failures += other.failures
        self.processes += other.processes
        self.temp_files_removed += other.temp_files_removed

    def to_dict(self) -> dict:
        return asdict(self)


def run(cfg: DictConfig, run_dir: Path) -> PrecomputeSummary:
    """Fill the cache for `cfg.data` with `cfg.model`; returns (and writes) the summary.

    Raises:
        ConfigError: no data.path, no persistent cache, a bad batch size.
        DataError: no usable sample; with on_error=raise, the first unreadable sample.
    """
    from accelerate import PartialState

    if not cfg.data.path:
        raise ConfigError("data.path is not set: point it at a data set folder or manifest")
    if cfg.cache.name == "none" or not cfg.cache.get("dir"):
        raise ConfigError("precompute needs a persistent cache: use cache=ssd cache.dir=FOLDER")
    batch_size = int(cfg.precompute.batch_size)
    if batch_size < 1:
        raise ConfigError(f"precompute.batch_size={batch_size} is out of range: it must be at least 1")
    raise_errors = str(value(cfg.precompute.on_error)) == "raise"
    # Without CUDA, accelerate only sees the processes of torchrun / `accelerate launch` when told it is on
    # the CPU; otherwise each would think it is alone and encode everything.
    state = PartialState(cpu=not torch.cuda.is_available())
    common.warn_single_process(state.num_processes, "qie.precompute")
    data = read_data(cfg)
    # The range slices the data set in id order, broken samples included, so fixing one shifts nothing.
    items = sorted([*data.samples, *data.problems], key=lambda x: x.id)[cfg.precompute.start : cfg.precompute.end]
    problems = [x for x in items if isinstance(x, DataProblem)]
    if raise_errors and problems:
        raise DataError(_message(problems[0]))
    sizes = image_sizes(cfg)
    ctx = model_key_context(cfg)
    hasher = file_hasher(cfg)
    backend = build_backend(cfg.cache._target_, cfg.cache.dir)
    main = state.is_main_process
    summary = PrecomputeSummary()
    if main:  # what every process finds alike, the main one reports
        summary.temp_files_removed = sweep_stale_temps(backend)
        for p in problems:
            _record_failure(summary, None, DataError(p.reason), CACHE_TYPES, problem=p)

    keyed = []
    for sample in (x for x in items if isinstance(x, Sample)):
        try:
            keyed.append((sample, _keys(sample, ctx, hasher, cfg.model)))
        except DataError as e:
            if raise_errors:
                raise
            if main:
                _record_failure(summary, sample, e, CACHE_TYPES)
    mine = share(keyed, state.num_processes, state.process_index)
    # Samples in the range: this process's share, plus (main) those that failed before it was dealt.
    summary.samples = len(mine) + (len(items) - len(keyed) if main else 0)
    groups = _plan(mine, backend, summary)

    todo = sum(len(g) for g in groups.values())
    encoder: Encoder | None = build_encoder(cfg) if todo else None
    desc = f"precompute[{state.process_index}]" if state.num_processes > 1 else "precompute"
    with progress(todo, desc, unit="sample", disable=not todo) as bar:
        for missing, group in groups.items():
            for start in range(0, len(group), batch_size):
                batch = group[start : start + batch_size]
                _encode_batch(encoder, batch, missing, sizes, backend, summary, raise_errors)
                bar.update(len(batch))
    hasher.save()
    totals = {k: sum(getattr(s, k) for s in summary.types.values()) for k in ("new", "bytes_written")}
    summary.processes = [{"process": state.process_index, "samples": summary.samples, **totals}]
    return _finish(state, summary, run_dir)


def _keys(sample: Sample, ctx, hasher, model_cfg) -> dict[str, str]:
    """The sample's entry keys; DataError for a sample the model cannot take or a file that cannot be read."""
    problem = model_spec(model_cfg).control_problem(len(sample.controls))
    if problem:
        path = sample.controls[int(model_cfg.max_control_images)] if sample.controls else sample.target
        raise ImageError(path, f"sample {sample.id!r} has {problem}")
    try:
        return sample_keys(sample, ctx, hasher)
    except OSError as e:
        raise ImageError(e.filename, f"sample {sample.id!r}: cannot read {e.filename!r} ({e.strerror})") from None


def share(keyed: list[Keyed], num_processes: int, index: int) -> list[Keyed]:
    """The samples process `index` of `num_processes` encodes.

    Samples sharing any entry key form one group that goes to one process, so no entry is encoded twice;
    groups are dealt largest first to the least-loaded process. Every process computes the same split.
    """
    if num_processes <= 1:
        return list(keyed)
    parent = list(range(len(keyed)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    first: dict[tuple[str, str], int] = {}
    for i, (_, keys) in enumerate(keyed):
        for entry in keys.items():
            parent[root(i)] = root(first.setdefault(entry, i))
    groups: dict[int, list[int]] = defaultdict(list)
    for i in range(len(keyed)):
        groups[root(i)].append(i)
    load = [0] * num_processes
    chosen: list[int] = []
    for members in sorted(groups.values(), key=lambda m: (-len(m), m[0])):
        target = min(range(num_processes), key=lambda p: (load[p], p))
        load[target] += len(members)
        if target == index:
            chosen += members
    return [keyed[i] for i in sorted(chosen)]


def _plan(mine: list[Keyed], backend, summary: PrecomputeSummary) -> dict[tuple[str, ...], list[Keyed]]:
    """Group samples by the tuple of types they miss; a present entry or one planned already is skipped."""
    planned: set[tuple[str, str]] = set()
    groups: dict[tuple[str, ...], list[Keyed]] = defaultdict(list)
    for sample, keys in mine:
        missing = []
        for t in (t for t in CACHE_TYPES if t in keys):
            if (t, keys[t]) in planned or entry_intact(backend, t, keys[t]):
                summary.types[t].skipped += 1
            else:
                planned.add((t, keys[t]))
                missing.append(t)
        if missing:
            groups[tuple(missing)].append((sample, keys))
    return groups


def entry_intact(backend, type: str, key: str) -> bool:
    """Whether the entry is stored whole: for a file backend, its safetensors header parses, names this
    type and schema, and the file is exactly as long as the header says (~1 KB read, not the tensors).
    A truncated or garbage file is thus a miss and gets rewritten."""
    from qie.cache.ssd import SsdBackend

    if not isinstance(backend, SsdBackend):
        return backend.exists(type, key)
    try:
        with open(backend.path(type, key), "rb") as f:
            size = os.fstat(f.fileno()).st_size
            hlen = int.from_bytes(f.read(8), "little")
            if size < 8 or hlen > size - 8:
                return False
            header = json.loads(f.read(hlen))
        meta = header.pop("__metadata__")
        if meta["schema"] != str(SCHEMA_VERSION) or meta["type"] != type or not header:
            return False
        return size == 8 + hlen + max(int(t["data_offsets"][1]) for t in header.values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def sweep_stale_temps(backend) -> int:
    """Remove temp files left by cache writers that died (a killed precompute); returns how many."""
    from qie.cache import ssd

    if not isinstance(backend, ssd.SsdBackend):
        return 0
    now, removed = time.time(), 0
    for t in CACHE_TYPES:
        for entry in backend._scan(t):
            if ssd._is_stale_temp(entry, now) and ssd._unlink(entry.path):
                removed += 1
    return removed


def _encode_batch(encoder, batch, missing, sizes: ImageSizes, backend, summary, raise_errors) -> None:
    """Read the batch's images, encode what each sample misses and can be read, and write it."""
    by_types: dict[tuple[str, ...], list[tuple[dict, PreparedSample]]] = defaultdict(list)
    control_types = tuple(t for t in missing if t != "pixel_latent")
    for sample, keys in batch:
        types = list(missing)
        prepared = PreparedSample(sample, None, [], [])
        if "pixel_latent" in missing:
            try:
                prepared.target = prepare_sample(sample, sizes, with_controls=False).target
            except DataError as e:
                _record_failure(summary, sample, e, ["pixel_latent"], raise_errors)
                types.remove("pixel_latent")
        if control_types:
            try:
                read = prepare_sample(sample, sizes, with_target=False)
                prepared.control_pixels, prepared.vl_images = read.control_pixels, read.vl_images
            except DataError as e:
                _record_failure(summary, sample, e, control_types, raise_errors)
                types = [t for t in types if t not in control_types]
        if types:
            by_types[tuple(types)].append((keys, prepared))
    for types, items in by_types.items():
        entries = encoder.encode_entries([p for _, p in items], types)
        for (keys, _), entry in zip(items, entries):
            for t in types:
                summary.types[t].bytes_written += backend.put(t, keys[t], entry[t])
                summary.types[t].new += 1


def _record_failure(summary, sample, error, types, raise_errors: bool = False, problem=None) -> None:
    """Count a sample's `types` as failed and name the file at fault; re-raise with on_error=raise."""
    if raise_errors:
        raise error
    if problem is None:
        path = getattr(error, "path", None) or str(sample.target or sample.controls[0])
        problem = DataProblem(sample.id, path, str(error))
    summary.failures.append(problem)
    for t in types:
        summary.types[t].failed += 1


def _message(problem: DataProblem) -> str:
    return f"sample {problem.id!r}: {problem.path}: {problem.reason} (precompute.on_error=skip goes on)"


def _finish(state, summary: PrecomputeSummary, run_dir: Path) -> PrecomputeSummary:
    from accelerate.utils import gather_object

    if state.num_processes > 1:
        total = PrecomputeSummary()
        for part in gather_object([summary]):
            total.merge(part)
        summary = total
    if state.is_main_process:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "precompute_summary.json").write_text(json.dumps(summary.to_dict(), indent=2))
        with open(run_dir / "failures.jsonl", "w", encoding="utf-8") as f:
            for p in summary.failures:
                f.write(json.dumps(asdict(p)) + "\n")
        print(format_summary(summary, run_dir))
    return summary


def format_summary(summary: PrecomputeSummary, run_dir: Path) -> str:
    lines = [f"precompute: {summary.samples} samples"]
    lines.append(f"  {'type':26s}{'new':>8s}{'skipped':>9s}{'failed':>8s}{'MiB written':>13s}")
    for t, s in summary.types.items():
        lines.append(f"  {t:26s}{s.new:8d}{s.skipped:9d}{s.failed:8d}{s.bytes_written / 2**20:13.2f}")
    if len(summary.processes) > 1:
        lines += [f"  process {p['process']}: {p['samples']} samples, {p['new']} new" for p in summary.processes]
    if summary.temp_files_removed:
        lines.append(f"  removed {summary.temp_files_removed} temp files of interrupted writers")
    for p in summary.failures[:10]:
        lines.append(f"  failed: {p.path}: {p.reason}")
    if len(summary.failures) > 10:
        lines.append(f"  ... {len(summary.failures) - 10} more in failures.jsonl")
    if summary.failures:
        lines.append(f"  failures: {run_dir / 'failures.jsonl'}")
    lines.append(f"  summary: {run_dir / 'precompute_summary.json'}")
    return "\n".join(lines)
