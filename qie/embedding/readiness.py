"""Whole-set readiness: before cached training builds its model, every sample's entries are checked.

The check reads each entry's header (schema, type, length, and for a prompt entry its base's checksum), not
its tensors, and writes `cache_report.json` in the run directory listing every sample with missing or damaged
entries. Samples precompute could not encode (recorded in the cache's `precompute_failures.json`) are skipped
with a warning; the others stop the run with their count and the precompute command, or, with
`cache.on_missing=skip`, are left out with a warning. Sources that encode (live, lazy) need no check. Everything
here reaches the source and its cache through `EmbeddingSource.cache` and `CacheStore` as declared.
"""

from __future__ import annotations

import gc
import json
import time
from collections.abc import Sequence
from itertools import repeat
from operator import attrgetter, is_not
from pathlib import Path

import numpy as np

from qie.cache.base import EntryCounts
from qie.cache.failures import read_failures
from qie.data.fields import DEFAULT_FIELDS
from qie.data.samples import Sample
from qie.embedding.sources import CacheReader, EmbeddingSource, sample_types, types_of_kind
from qie.errors import CacheDirMissing, CacheMissError, check_writable
from qie.types import TRAINING_TYPES

REPORT_FILE = "cache_report.json"
# The sample field the remembered key rows have a column for (`qie.data.key_memo`): the built-in one.
(ROW_FIELD,) = DEFAULT_FIELDS


def check_entries(cache: CacheReader, samples: Sequence[Sample], failures: dict[str, dict]) -> dict:
    """{"missing": [...], "damaged": [...], "unreadable": [...], "precompute_failed": [...]}: one row per
    sample with a problem, {"id", "types" or "reason"}; and "seconds"."""
    t0 = time.perf_counter()
    out: dict[str, list] = {"missing": [], "damaged": [], "unreadable": [], "precompute_failed": []}
    backend = cache.backend
    if _all_whole_at_once(cache, samples):
        out["seconds"] = time.perf_counter() - t0
        return out
    keyed = []
    for sample, keys in zip(samples, cache.keys_all(samples)):
        if isinstance(keys, OSError):
            out["unreadable"].append({"id": sample.id, "reason": f"cannot read {keys.filename!r} ({keys.strerror})"})
        else:
            keyed.append((sample, keys))
    types = [sample_types(sample) for sample, _ in keyed]
    items = [(t, keys[t]) for (_, keys), ts in zip(keyed, types) for t in ts]
    found = backend.intact_all(items, remember=True)
    whole = {} if all(found) else dict(zip(items, found))
    keyed = keyed if whole else []  # every entry is whole: nothing to report
    for (sample, keys), ts in zip(keyed, types):
        bad = [t for t in ts if not whole[t, keys[t]]]
        if not bad:
            continue
        known = [failures[f"{t}/{keys[t]}"]["reason"] for t in bad if f"{t}/{keys[t]}" in failures]
        if known:
            out["precompute_failed"].append({"id": sample.id, "types": bad, "reason": known[0]})
            continue
        kind = "damaged" if any(backend.exists(t, keys[t]) for t in bad) else "missing"
        out[kind].append({"id": sample.id, "types": bad})
    out["seconds"] = time.perf_counter() - t0
    return out


def _all_whole_at_once(cache: CacheReader, samples: Sequence[Sample]) -> bool:
    """Whether every entry of every sample is whole, judged in bulk: the cache's remembered keys of all samples
    as one array (`key_rows`), each distinct entry counted (`np.unique`) and checked once by the backend
    (`intact_counted`, the same stamp as `intact_all` of the items). False means "not shown": a sample not
    remembered, or something missing; the caller then checks sample by sample and reports."""
    rows = cache.key_rows(samples) if samples else None
    if rows is None:
        return False
    width = rows.shape[1] // len(TRAINING_TYPES)  # the key bytes of each type, in TRAINING_TYPES order
    keys = rows.reshape(len(samples), len(TRAINING_TYPES), width)
    # Which types each sample needs (`sample_types`) follows from its kind: a target, controls, layers, a rejected
    # result or not; the kinds are read column by column, each kind's types taken once. A sample field's image
    # beyond the rejected result (`qie.data.fields`) has no place in the rows: such samples are checked one by one.
    n, fields = len(samples), [("target", None), ("controls", bool), ("layers", bool)]
    images = list(map(attrgetter("field_images"), samples))
    if any(images) and {name for x in images for name, _ in x} - {ROW_FIELD.name}:
        return False
    has = [
        np.fromiter(
            map(is_not, map(attrgetter(f), samples), repeat(None))
            if test is None
            else map(test, map(attrgetter(f), samples)),
            bool,
            n,
        )
        for f, test in fields
    ]
    has.append(np.fromiter(map(bool, images), bool, n))
    code = (has[0] * 8 + has[1] * 4 + has[2] * 2 + has[3]).astype(np.int64)
    masks = np.zeros((16, len(TRAINING_TYPES)), dtype=bool)
    for c in np.unique(code).tolist():
        types = types_of_kind(bool(c & 8), bool(c & 4), bool(c & 2), (ROW_FIELD.name,) if c & 1 else ())
        masks[c] = [t in types for t in TRAINING_TYPES]
    needed = masks[code]
    if (needed & ~keys.any(axis=2)).any():  # a needed key not remembered: keyed sample by sample
        return False
    by_type = {}
    for j, t in enumerate(TRAINING_TYPES):
        column = np.ascontiguousarray(keys[needed[:, j], j])
        if not len(column):
            continue
        distinct, times = distinct_rows(column)
        text, step = distinct.tobytes().hex(), 2 * width
        prefixes = np.ascontiguousarray(distinct[:, :8]).view(">u8").reshape(-1).astype(np.uint64)
        by_type[t] = ([text[i * step : (i + 1) * step] for i in range(len(distinct))], times, prefixes)
    return bool(cache.backend.intact_counted(EntryCounts(by_type, hex_keys=True), remember=True))


def distinct_rows(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct rows of a (n, width >= 8) uint8 array and how often each occurs (`np.unique(axis=0)` with
    counts, in another order): sorted by their first 8 bytes as a number, the full rows compared only where those
    are equal (a million 32-byte keys in a fraction of `np.unique`'s time)."""
    prefix = np.ascontiguousarray(rows[:, :8]).view(">u8").reshape(-1)
    order = np.argsort(prefix, kind="stable")
    ordered, sorted_prefix = rows[order], prefix[order]
    new = np.ones(len(rows), dtype=bool)
    new[1:] = sorted_prefix[1:] != sorted_prefix[:-1]
    same = ~new[1:]
    if same.any() and not (ordered[1:][same] == ordered[:-1][same]).all():  # two keys share 8 bytes: row by row
        distinct, times = np.unique(rows, axis=0, return_counts=True)
        return distinct, times
    starts = np.flatnonzero(new)
    return ordered[starts], np.diff(np.append(starts, len(rows)))


def ready_samples(
    source: EmbeddingSource,
    samples: list[Sample],
    run_dir: Path,
    on_missing: str,
    report: bool = True,
    precompute_command: str = "python -m qie.precompute ...",
    remember: bool | None = None,
) -> list[Sample]:
    """The samples to train on, after checking the run and cache folders and (cached mode) every entry.
    `report`: print and write the report; `remember` (default: `report`): save what was learnt about the
    samples' keys in the cache folder (one process does).

    Raises:
        StorageError: the run directory cannot be written, or the cache folder is missing or a file.
        CacheMissError: samples without their entries (on_missing="stop"), or no sample left.
    """
    check_writable(run_dir, "the run directory (hydra.run.dir)")
    cache = source.cache
    if cache is None:  # nothing cached to check: every entry is encoded
        return samples
    backend = cache.backend
    try:
        backend.check_access(write=source.encodes)
    except CacheDirMissing:  # every entry is missing: said below, with the count and the precompute command
        pass
    if source.encodes:
        return samples
    # No garbage collection passes while a few hundred thousand keys and paths are made (none is cyclic):
    # at 100k samples they would cost about a second.
    gc_was_on = gc.isenabled()
    gc.disable()
    try:
        found = check_entries(cache, samples, read_failures(backend))
    finally:
        if gc_was_on:
            gc.enable()
    if report if remember is None else remember:  # `remember` defaults to `report`
        cache.remember_keys()  # the next start stats images instead of hashing them
    path = run_dir / REPORT_FILE
    if report:
        doc = {"samples": len(samples), **found, "precompute_command": precompute_command}
        path.write_text(json.dumps(doc, indent=1))
        print(f"qie: cache checked for {len(samples):,} samples in {found['seconds']:.2f} s ({path})")
    skip = {row["id"] for row in found["precompute_failed"]}
    for row in found["precompute_failed"][:5] if report else []:
        print(f"qie: warning: skipping sample {row['id']!r}: precompute could not encode it: {row['reason']}")
    missing = found["missing"] + found["damaged"] + found["unreadable"]
    if missing and on_missing != "skip":
        first = missing[0]
        raise CacheMissError(
            f"{len(missing):,} of {len(samples):,} samples have missing or damaged cache entries in {backend!r} "
            f"(all listed in {path}); the first is {first['id']!r} ({', '.join(first.get('types', []))}"
            f"{first.get('reason', '')}).\nFill the cache first with the same model, data and cache settings:\n"
            f"  {precompute_command}\nor train on the other samples with cache.on_missing=skip."
        )
    if missing and report:
        print(
            f"qie: warning: training without {len(missing):,} samples whose cache entries are missing or damaged "
            f"(cache.on_missing=skip; listed in {path})"
        )
    skip |= {row["id"] for row in missing}
    kept = [s for s in samples if s.id not in skip]
    if not kept:
        raise CacheMissError(f"no sample has all its cache entries (see {path}): run\n  {precompute_command}")
    return kept
