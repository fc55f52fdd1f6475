"""`python -m qie.cache action=gc`: remove the cache entries that no sample of the named data set(s) uses.

An entry's key is a hash of what its value depends on (image bytes, sizes, model fingerprints, prompt), so the
entries a data set uses are the keys of its samples under the model and data settings given; the rest are
left by deleted or edited samples, other sizes, or other models. A dry run (the default) lists what would go.
Only entry files inside `cache.dir`'s type folders are ever removed (see `CacheBackend.unused`). Distillation's
teacher outputs (`teacher_latent`) are keyed by the tensors training reads, not by a sample's files: gc keeps them
(`action=clear cache.types=[teacher_latent]` removes them).
"""

from __future__ import annotations

from omegaconf import DictConfig

from qie.cache.admin import AdminReport, format_bytes
from qie.cache.base import CacheBackend
from qie.components import prepare_model
from qie.errors import ConfigError
from qie.stages.auto_caption import CAPTION_TYPE, auto_captions
from qie.stages.common import build_source, read_data
from qie.types import CACHE_TYPES

# Types no sample's keys name: never collected.
KEPT_TYPES = ("teacher_latent",)
COLLECTED_TYPES = [t for t in CACHE_TYPES if t not in KEPT_TYPES]


def used_keys(cfg: DictConfig, backend: CacheBackend) -> tuple[dict[str, set[str]], int]:
    """The keys (per type) of every sample of `data.path` and `gc.keep_data`, and how many samples that is.

    Raises:
        ConfigError: `backend` stores nothing (there is nothing to collect).
    """
    spec = prepare_model(cfg.model)
    cache = build_source(cfg, mode="cached", spec=spec, backend=backend).cache
    if cache is None:
        raise ConfigError(f"action=gc needs a cache that stores entries; {backend!r} stores none")
    captions = auto_captions(cfg, spec, False, backend)  # data.auto_caption: the cached captions are used too
    keep: dict[str, set[str]] = {}
    count = 0
    for path in [cfg.data.path, *cfg.gc.keep_data]:
        for sample in read_data(cfg, path=str(path), captions=captions).samples:
            count += 1
            for type, key in cache.keys(sample).items():
                keep.setdefault(type, set()).add(key)
    if captions is not None:
        keep[CAPTION_TYPE] = set(captions.counts.keys)
    return keep, count


def collect_garbage(cfg: DictConfig, backend: CacheBackend) -> AdminReport:
    """List (and unless `gc.dry_run`, remove) the entries no sample of the named data sets uses.

    Raises:
        ConfigError: no data set named; or, when removing without `gc.force`, none of the data sets' entries of
            a type the cache holds is in the cache (another model or other sizes were named: nothing is removed).
    """
    if not cfg.data.path:
        raise ConfigError(
            "action=gc needs the data set(s) whose entries to keep: add data.path=... (more: gc.keep_data=[...]) "
            "and the model=NAME precompute was given"
        )
    keep, samples = used_keys(cfg, backend)
    remove = not bool(cfg.gc.dry_run)
    unused = backend.unused(keep, COLLECTED_TYPES, remove=False)
    total = backend.stats(COLLECTED_TYPES)
    kept = sum(s["count"] for s in total.values()) - sum(s["count"] for s in unused.values())
    # Each type the data sets use and the cache holds must match some entry: a type none of whose entries match
    # says the settings differ from precompute's (another text encoder: every prompt entry; another VAE area:
    # every latent), even when other types match.
    unmatched = [t for t, s in total.items() if keep.get(t) and s["count"] and unused[t]["count"] == s["count"]]
    if remove and unmatched and not cfg.gc.get("force", False):
        which = "" if kept == 0 else f"{', '.join(unmatched)} "
        raise ConfigError(
            f"none of the {samples} samples' {which}entries is in {backend!r}: were they encoded with another model "
            "or other sizes? Nothing was removed; give the model= and data settings precompute was run with (or "
            "gc.force=true to remove them all the same)"
        )
    if remove:
        unused = backend.unused(keep, COLLECTED_TYPES, remove=True)
    count, size = sum(s["count"] for s in unused.values()), sum(s["bytes"] for s in unused.values())
    verb = "removed" if remove else "would remove"
    lines = [f"cache: {backend!r}", f"{samples} samples of model={cfg.model.name} use {kept:,} entries"]
    lines += [f"  {t:<20} {verb} {s['count']:,} ({format_bytes(s['bytes'])})" for t, s in unused.items() if s["count"]]
    lines.append(f"{verb} {count:,} unused entries, {format_bytes(size)}")
    if not remove and count:
        lines.append("dry run: nothing removed; add gc.dry_run=false to remove them")
    return AdminReport("\n".join(lines))
