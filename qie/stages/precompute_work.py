"""The work of the precompute stage, as functions of explicit arguments: keys, the split between processes,
the plan of what is missing, claims against other runs, encoding, and the summary.

Everything here reaches the cache through the backend protocol and `qie.cache.entries` only.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field

from qie.cache.base import CacheStore
from qie.cache.entries import BASE_TYPE, STORED_TYPES, nonfinite, stored_order, write_entries
from qie.data.fields import DEFAULT_FIELDS, entry_types
from qie.data.images import ImageError
from qie.data.keys import KeyContext, sample_keys
from qie.data.samples import DataProblem, Sample
from qie.embedding.encode import (
    Encoder,
    ImageSizes,
    PreparedSample,
    prepare_field,
    prepare_sample,
    prompt_limit,
    text_tokens,
)
from qie.errors import DataError
from qie.models import text_positions
from qie.types import field_of_type

log = logging.getLogger(__name__)

# The stored types only some data sets have: layers (a layered model's), the images of sample fields
# (`qie.data.fields`: preference pairs' rejected results, ...).
OPTIONAL_TYPES = ("layer_latent", *entry_types(DEFAULT_FIELDS))

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
    # Every stored type but those only some data sets have (`of`): layer_latent, the sample fields' types.
    types: dict[str, TypeSummary] = field(
        default_factory=lambda: {t: TypeSummary() for t in STORED_TYPES if t not in OPTIONAL_TYPES}
    )
    failures: list[DataProblem] = field(default_factory=list)
    # One row per process: {"process", "samples", "new", "bytes_written"}.
    processes: list[dict] = field(default_factory=list)
    temp_files_removed: int = 0
    # Entries another precompute run (sharing this cache) was writing: waited for, not encoded twice.
    claimed_by_others: int = 0
    # (type, key, sample id, reason) of every entry that could not be written: training skips them.
    failed_entries: list[tuple[str, str, str, str]] = field(default_factory=list)
    written: list[tuple[str, str]] = field(default_factory=list)

    def merge(self, other: PrecomputeSummary) -> None:
        self.samples += other.samples
        for t, s in other.types.items():
            mine = self.types.setdefault(t, TypeSummary())
            for name in ("new", "skipped", "failed", "bytes_written"):
                setattr(mine, name, getattr(mine, name) + getattr(s, name))
        for name in ("failures", "processes", "failed_entries", "written"):
            getattr(self, name).extend(getattr(other, name))
        self.temp_files_removed += other.temp_files_removed
        self.claimed_by_others += other.claimed_by_others

    @classmethod
    def of(cls, items: list) -> PrecomputeSummary:
        """An empty summary of the types the samples among `items` have (layer_latent only for layered ones, a
        sample field's type only where a sample has its image: rejected_latent for preference pairs)."""
        samples = [s for s in items if isinstance(s, Sample)]
        fields = {f"{name}_latent" for s in samples for name, _ in s.field_images}
        has = {"layer_latent": any(s.layers for s in samples), **{t: t in fields for t in OPTIONAL_TYPES[1:]}}
        return cls(types={t: TypeSummary() for t in stored_order([*STORED_TYPES, *fields]) if has.get(t, True)})

    def to_dict(self) -> dict:
        out = asdict(self)
        del out["written"]  # the keys written: for the failure log, not for people
        return out


def keys_of(sample: Sample, ctx: KeyContext, hasher, spec) -> dict[str, str]:
    """The sample's entry keys; DataError for a sample the model (`spec`, a ModelSpec) cannot take or a file
    that cannot be read."""
    problem = spec.control_problem(len(sample.controls))
    if problem:
        path = sample.controls[spec.max_control_images] if sample.controls else sample.target
        raise ImageError(path, f"sample {sample.id!r} has {problem}")
    if sample.target is not None and (problem := spec.layers_problem(len(sample.layers))):
        raise ImageError(sample.target, f"sample {sample.id!r} has {problem}")
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


def whole(backend: CacheStore, type: str, key: str, repair: bool = False) -> bool:
    """Whether (type, key) is stored whole: judged by its header, and with `repair` by its bytes too (read and
    checked against their checksum by a backend built with `verify_reads`)."""
    return backend.intact(type, key) and (not repair or backend.get(type, key) is not None)


def plan(
    mine: list[Keyed], backend: CacheStore, summary: PrecomputeSummary, repair: bool = False
) -> dict[tuple, list[Keyed]]:
    """Group samples by the tuple of stored types they miss; a whole entry (`whole`) or one planned already is
    skipped. Groups that write empty-prompt entries come first: prompt entries then share their prefix.

    An empty-prompt entry written again (missing, or corrupt under `cache.repair=true`) comes out in other
    bytes (float rounding of another batch), so the prompt entries cut against it would no longer match their
    base: they are written again with it, and one run leaves a cache that verifies."""
    planned: set[tuple[str, str]] = set()
    missing_of: list[list[str]] = []
    for _, keys in mine:
        missing = []
        for t in stored_order(keys):
            if (t, keys[t]) in planned or whole(backend, t, keys[t], repair):
                summary.types[t].skipped += 1
            else:
                planned.add((t, keys[t]))
                missing.append(t)
        missing_of.append(missing)
    rebased = {key for t, key in planned if t == BASE_TYPE}
    groups: dict[tuple[str, ...], list[Keyed]] = defaultdict(list)
    for (sample, keys), missing in zip(mine, missing_of):
        entry = ("prompt_embed", keys.get("prompt_embed"))
        if keys.get(BASE_TYPE) in rebased and entry[1] is not None and entry not in planned:
            planned.add(entry)
            missing = stored_order([*missing, "prompt_embed"])  # the tuple keeps the stored order
            summary.types["prompt_embed"].skipped -= 1
        if missing:
            groups[tuple(missing)].append((sample, keys))
    return dict(sorted(groups.items(), key=lambda g: BASE_TYPE not in g[0]))


def claim(backend: CacheStore, batch: list[Keyed], types: tuple, summary: PrecomputeSummary, repair: bool = False):
    """Claim the batch's missing entries against other runs on this cache.

    Returns:
        ([(sample, keys, types to encode)], [samples another run holds, to retry], [claims to release]).
        An entry another run finished meanwhile is counted as skipped.
    """
    todo, busy, held = [], [], []
    for sample, keys in batch:
        got = [(t, backend.claim(t, keys[t])) for t in types]
        if any(c is None for _, c in got):
            for _, c in got:
                if c is not None:
                    c.release()
            busy.append((sample, keys))
            continue
        held += [c for _, c in got]
        left = tuple(t for t in types if not whole(backend, t, keys[t], repair))
        if BASE_TYPE in left and "prompt_embed" in types and "prompt_embed" not in left:
            left += ("prompt_embed",)  # its base is written again: so is it (see `plan`)
        for t in set(types) - set(left):
            summary.types[t].skipped += 1
            summary.claimed_by_others += 1
        if left:
            todo.append((sample, keys, left))
    return todo, busy, held


def encode_groups(
    encoder: Callable[[], Encoder],
    groups: dict[tuple, list[Keyed]],
    backend: CacheStore,
    sizes: ImageSizes,
    summary: PrecomputeSummary,
    batch_size: int,
    raise_errors: bool,
    progress: Callable[[int], object],
    repair: bool = False,
) -> None:
    """Encode and write every group in batches; samples another run holds are retried after waiting for
    that run's claims, holding none (its entries are then skipped, what it failed to write is encoded)."""
    pending = list(groups.items())
    while pending:
        later: list[tuple[tuple, list[Keyed]]] = []
        for types, group in pending:
            for start in range(0, len(group), batch_size):
                batch = group[start : start + batch_size]
                todo, busy, held = claim(backend, batch, types, summary, repair)
                try:
                    if todo:
                        _encode_batch(encoder(), todo, sizes, backend, summary, raise_errors)
                except BaseException:
                    release_all(held, quiet=True)  # the error that stopped the batch is the one to tell
                    raise
                release_all(held)
                if busy:
                    later.append((types, busy))
                progress(len(batch) - len(busy))
        if later:
            entries = sum(len(group) * len(types) for types, group in later)
            samples = sum(len(group) for _, group in later)
            log.warning(
                "%d entries of %d samples are claimed by other runs: waiting for each claim to be released (or to "
                "expire, for a run that died); what those runs do not write is encoded here",
                entries,
                samples,
            )
        for types, group in later:
            for _, keys in group:
                for t in types:
                    backend.claim(t, keys[t], wait=True).release()
        pending = later


def release_all(claims: list, quiet: bool = False) -> None:
    """Release every claim, also after one failed (a store that stopped answering notes the rest, see
    `qie.cache.remote_claims`); the first failure is raised after, unless `quiet`."""
    failed = None
    for c in claims:
        try:
            c.release()
        except Exception as e:
            failed = failed or e
    if failed is not None and not quiet:
        raise failed


# The entry types read from the target's images (the target, a layered target's layers); the sample fields'
# (`field_of_type`: a rejected result) are read as the target is too, each failing only its own entry.
TARGET_TYPES = ("pixel_latent", "layer_latent")


def _encode_batch(encoder: Encoder, todo: list, sizes: ImageSizes, backend, summary, raise_errors: bool) -> None:
    """Read the batch's images, encode what each sample misses and can be read, and write what is finite."""
    by_types: dict[tuple[str, ...], list[tuple[Sample, dict, PreparedSample]]] = defaultdict(list)
    for sample, keys, missing in todo:
        types = list(missing)
        prepared = PreparedSample(sample, None, [], [])
        field_types = [t for t in missing if field_of_type(t) is not None]
        target_types = [t for t in missing if t in TARGET_TYPES or t in field_types]
        control_types = [t for t in missing if t not in target_types]
        if target_types:
            try:
                read = prepare_sample(sample, sizes, with_controls=False, with_fields=False)
                prepared.target, prepared.layers = read.target, read.layers
            except DataError as e:
                record_failure(summary, sample, e, target_types, keys, raise_errors)
                types = [t for t in types if t not in target_types]
        for t in (t for t in field_types if t in types):  # a field's image fails only its entry: the rest trains
            try:
                prepared.fields[field_of_type(t)] = prepare_field(sample, field_of_type(t), sizes, prepared.target)
            except DataError as e:
                record_failure(summary, sample, e, [t], keys, raise_errors)
                types.remove(t)
        if control_types:
            try:
                read = prepare_sample(sample, sizes, with_target=False)
                prepared.control_pixels, prepared.vl_images = read.control_pixels, read.vl_images
            except DataError as e:
                record_failure(summary, sample, e, control_types, keys, raise_errors)
                types = [t for t in types if t not in control_types]
        if types:
            by_types[tuple(types)].append((sample, keys, prepared))
    for types, items in by_types.items():
        entries = encoder.encode_entries([p for _, _, p in items], types)
        for (sample, keys, prepared), entry in zip(items, entries):
            entry = {t: entry[t] for t in types}
            if "prompt_embed" in entry:
                try:
                    limit = prompt_limit(encoder.spec, prepared, sizes)
                    text_positions.check(text_tokens(entry["prompt_embed"]), limit, f"sample {sample.id!r}")
                except text_positions.PromptTooLong as error:
                    record_failure(summary, sample, error, ["prompt_embed"], keys, raise_errors)
                    del entry["prompt_embed"]
            bad = nonfinite(entry)
            if bad:
                bad_types = stored_order({b.split("/")[0] for b in bad})
                error = DataError(f"sample {sample.id!r}: {', '.join(bad)} hold NaN or infinite values: not written")
                record_failure(summary, sample, error, bad_types, keys, raise_errors)
                entry = {t: v for t, v in entry.items() if t not in bad_types}
            for t, n in write_entries(backend, keys, entry).items():
                summary.types[t].bytes_written += n
                summary.types[t].new += 1
                summary.written.append((t, keys[t]))


def record_failure(summary, sample, error, types: Iterable[str], keys=None, raise_errors=False, problem=None) -> None:
    """Count a sample's `types` as failed and name the file at fault; re-raise with on_error=raise."""
    if raise_errors:
        raise error
    if problem is None:
        path = getattr(error, "path", None) or str(sample.target or sample.controls[0])
        problem = DataProblem(sample.id, str(path), str(error))
    summary.failures.append(problem)
    for t in types:
        if t in summary.types:
            summary.types[t].failed += 1
            if keys is not None and t in keys:
                summary.failed_entries.append((t, keys[t], problem.id, problem.reason))
