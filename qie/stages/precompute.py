"""The precompute stage: encode a data set (or a range of it) once into the cache.

Each process of an `accelerate launch` takes a disjoint share. Samples are assigned by their control
images, so samples that share a control image (one image, several instructions) land on one process and
its latent is encoded once. Entries already present are skipped; within a run, samples are grouped by
which types they miss, so exactly the missing entries are computed.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

from omegaconf import DictConfig
from tqdm import tqdm

from qie.cache import build_backend
from qie.config.cache import CACHE_TYPES
from qie.data.keys import sample_keys
from qie.data.samples import DataProblem, Sample, scan_dataset
from qie.embeddings import key_context
from qie.encode import Encoder, prepare_sample
from qie.errors import ConfigError, QieError
from qie.stages.common import build_encoder, file_hasher, image_sizes, model_source, value


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

    def merge(self, other: PrecomputeSummary) -> None:
        self.samples += other.samples
        for t, s in other.types.items():
            mine = self.types[t]
            mine.new, mine.skipped = mine.new + s.new, mine.skipped + s.skipped
            mine.failed, mine.bytes_written = mine.failed + s.failed, mine.bytes_written + s.bytes_written
        self.failures += other.failures

    def to_dict(self) -> dict:
        return {
            "samples": self.samples,
            "types": {t: asdict(s) for t, s in self.types.items()},
            "failures": [asdict(f) for f in self.failures],
        }


def run(cfg: DictConfig, run_dir: Path) -> PrecomputeSummary:
    """Fill the cache for `cfg.data` with `cfg.model`; returns (and writes) the summary."""
    from accelerate import PartialState

    if not cfg.data.path:
        raise ConfigError("data.path is not set: point it at a data set folder or manifest")
    if cfg.cache.name == "none" or not cfg.cache.get("dir"):
        raise ConfigError("precompute needs a persistent cache: use cache=ssd cache.dir=FOLDER")
    state = PartialState()
    data = scan_dataset(cfg.data.path, str(value(cfg.data.format)))
    samples = data.samples[cfg.precompute.start : cfg.precompute.end]
    sizes = image_sizes(cfg)
    ctx = key_context(model_source(cfg.model), cfg.model.revision, str(value(cfg.model.variant)), sizes)
    hasher = file_hasher(cfg)
    keyed = [(s, sample_keys(s, ctx, hasher)) for s in samples]
    mine = [
        (s, k)
        for s, k in keyed
        if int(k["control_latent"][:8], 16) % state.num_processes == state.process_index
    ]
    backend = build_backend(cfg.cache._target_, cfg.cache.dir)
    summary = PrecomputeSummary(samples=len(mine))
    summary.failures += [p for p in data.problems] if state.is_main_process else []
    raise_errors = str(value(cfg.precompute.on_error)) == "raise"
    if raise_errors and summary.failures:
        p = summary.failures[0]
        raise QieError(f"sample {p.id!r}: {p.path}: {p.reason}")

    groups: dict[tuple[str, ...], list[tuple[Sample, dict]]] = defaultdict(list)
    for sample, keys in mine:
        missing = tuple(t for t in CACHE_TYPES if t in keys and not backend.exists(t, keys[t]))
        for t in CACHE_TYPES:
            if t in keys and t not in missing:
                summary.types[t].skipped += 1
        if missing:
            groups[missing].append((sample, keys))

    todo = sum(len(g) for g in groups.values())
    encoder: Encoder | None = build_encoder(cfg) if todo else None
    batch_size = int(cfg.precompute.batch_size)
    written: set[tuple[str, str]] = set()
    with tqdm(total=todo, desc=f"precompute[{state.process_index}]", disable=not todo) as bar:
        for missing, group in groups.items():
            for start in range(0, len(group), batch_size):
                batch = group[start : start + batch_size]
                _encode_batch(encoder, batch, missing, sizes, backend, summary, written, raise_errors)
                bar.update(len(batch))
    hasher.save()
    return _finish(state, summary, run_dir)


def _encode_batch(encoder, batch, missing, sizes, backend, summary, written, raise_errors) -> None:
    prepared, kept = [], []
    for sample, keys in batch:
        try:
            prepared.append(prepare_sample(sample, sizes, with_target="pixel_latent" in missing))
            kept.append((sample, keys))
        except QieError as e:
            if raise_errors:
                raise
            summary.failures.append(DataProblem(sample.id, str(sample.target), str(e)))
            for t in missing:
                summary.types[t].failed += 1
    if not prepared:
        return
    for (_, keys), entries in zip(kept, encoder.encode_entries(prepared, missing)):
        for t in missing:
            if (t, keys[t]) in written:
                summary.types[t].skipped += 1
                continue
            summary.types[t].bytes_written += backend.put(t, keys[t], entries[t])
            summary.types[t].new += 1
            written.add((t, keys[t]))


def _finish(state, summary: PrecomputeSummary, run_dir: Path) -> PrecomputeSummary:
    from accelerate.utils import gather_object

    if state.num_processes > 1:
        parts = gather_object([summary.to_dict()])
        total = PrecomputeSummary()
        for d in parts:
            total.merge(_from_dict(d))
        summary = total
    if state.is_main_process:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "precompute_summary.json").write_text(json.dumps(summary.to_dict(), indent=2))
        with open(run_dir / "failures.jsonl", "w") as f:
            for p in summary.failures:
                f.write(json.dumps(asdict(p)) + "\n")
        print(format_summary(summary, run_dir))
    return summary


def _from_dict(d: dict) -> PrecomputeSummary:
    s = PrecomputeSummary(samples=d["samples"], failures=[DataProblem(**f) for f in d["failures"]])
    s.types = {t: TypeSummary(**v) for t, v in d["types"].items()}
    return s


def format_summary(summary: PrecomputeSummary, run_dir: Path) -> str:
    lines = [f"precompute: {summary.samples} samples"]
    lines.append(f"  {'type':26s}{'new':>8s}{'skipped':>9s}{'failed':>8s}{'MiB written':>13s}")
    for t, s in summary.types.items():
        lines.append(f"  {t:26s}{s.new:8d}{s.skipped:9d}{s.failed:8d}{s.bytes_written / 2**20:13.2f}")
    for p in summary.failures[:10]:
        lines.append(f"  failed: {p.path}: {p.reason}")
    if len(summary.failures) > 10:
        lines.append(f"  ... {len(summary.failures) - 10} more in failures.jsonl")
    lines.append(f"  summary: {run_dir / 'precompute_summary.json'}")
    return "\n".join(lines)
