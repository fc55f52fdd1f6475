"""`python -m qie.cache action=gc`: remove the cache entries that no sample of the named data set(s) uses.

An entry's key is a hash of what its value depends on (image bytes, sizes, model fingerprints, prompt), so the
entries a data set uses are the keys of its samples under the model and data settings given; the rest are
left by deleted or edited samples, other sizes, or other models. A dry run (the default) lists what would go.
Only entry files inside `cache.dir`'s type folders are ever removed (see `CacheBackend.unused`). Distillation's
teacher outputs (`teacher_latent`) are keyed by the tensors training reads, not by a sample's files: gc keeps them
(`action=clear cache.types=[teacher_latent]` removes them).
"""

from __future__ import annotations

from dataclasses import dataclass

from qie.cache.admin import AdminReport, format_bytes
from qie.cache.base import CacheBackend
from qie.components import prepare_model
from qie.config.cache import CacheConfig, GcConfig
from qie.config.data import DataConfig
from qie.config.model import ModelConfig
from qie.data.formats import DataSource
from qie.errors import ConfigError
from qie.models import ModelSpec
from qie.stages.auto_caption import CAPTION_TYPE, CaptionSettings, auto_captions, caption_settings
from qie.stages.datasets import read_data
from qie.stages.settings import SourceSettings, at_path, data_source, source_settings
from qie.stages.sources import build_source
from qie.types import CACHE_TYPES, STORE_TYPES


def collected_types() -> list[str]:
    """The types gc may remove entries of: those a sample's keys name (never an objective's stores, `STORE_TYPES`:
    no sample's keys name them)."""
    return [t for t in CACHE_TYPES if t not in STORE_TYPES]


@dataclass(frozen=True, kw_only=True)
class GcSetup:
    """What `action=gc` reads: the model, how its entries are keyed, the data sets whose entries are kept."""

    spec: ModelSpec
    source: SourceSettings  # the model, the image sizes and the cache folder the keys are made with
    samples: DataSource  # `data.path`, read with the `data` group's settings
    keep_data: tuple[str, ...]  # `gc.keep_data`: more data sets read with the same settings
    captions: CaptionSettings | None  # `data.auto_caption`: the cached captions are used too
    dry_run: bool
    force: bool


def check_gc_data(data: DataConfig) -> None:
    """Raise ConfigError when no data set is named (before the model is read)."""
    if not data.path:
        raise ConfigError(
            "action=gc needs the data set(s) whose entries to keep: add data.path=... (more: gc.keep_data=[...]) "
            "and the model=NAME precompute was given"
        )


def gc_setup(model: ModelConfig, data: DataConfig, cache: CacheConfig, gc: GcConfig, command: str) -> GcSetup:
    """The gc action's setup (the model prepared).

    Raises:
        ConfigError: a checkpoint that is not the model, or a caption prompt that cannot be read.
    """
    spec = prepare_model(model)
    captions = caption_settings(data.auto_caption_prompt, spec) if data.auto_caption else None
    source = source_settings(model, data, cache, spec, None, command).with_mode("cached")
    return GcSetup(
        spec=spec,
        source=source,
        samples=data_source(data, cache.state_folder()),
        keep_data=tuple(str(p) for p in gc.keep_data),
        captions=captions,
        dry_run=bool(gc.dry_run),
        force=bool(gc.force),
    )


def used_keys(setup: GcSetup, backend: CacheBackend) -> tuple[dict[str, set[str]], int]:
    """The keys (per type) of every sample of `data.path` and `gc.keep_data`, and how many samples that is.

    Raises:
        ConfigError: `backend` stores nothing (there is nothing to collect).
    """
    cache = build_source(setup.source, setup.spec, backend).cache
    if cache is None:
        raise ConfigError(f"action=gc needs a cache that stores entries; {backend!r} stores none")
    # data.auto_caption: the cached captions are used too
    captions = auto_captions(setup.captions, setup.source, setup.spec, False, backend)
    keep: dict[str, set[str]] = {}
    count = 0
    for path in [setup.samples.path, *setup.keep_data]:
        for sample in read_data(at_path(setup.samples, path), captions=captions).samples:
            count += 1
            for type, key in cache.keys(sample).items():
                keep.setdefault(type, set()).add(key)
    if captions is not None:
        keep[CAPTION_TYPE] = set(captions.counts.keys)
    return keep, count


def collect_garbage(setup: GcSetup, backend: CacheBackend) -> AdminReport:
    """List (and unless `gc.dry_run`, remove) the entries no sample of the named data sets uses.

    Raises:
        ConfigError: when removing without `gc.force`, none of the data sets' entries of a type the cache holds is
            in the cache (another model or other sizes were named: nothing is removed).
    """
    keep, samples = used_keys(setup, backend)
    remove = not setup.dry_run
    collected = collected_types()
    unused = backend.unused(keep, collected, remove=False)
    total = backend.stats(collected)
    kept = sum(s["count"] for s in total.values()) - sum(s["count"] for s in unused.values())
    # Each type the data sets use and the cache holds must match some entry: a type none of whose entries match
    # says the settings differ from precompute's (another text encoder: every prompt entry; another VAE area:
    # every latent), even when other types match.
    unmatched = [t for t, s in total.items() if keep.get(t) and s["count"] and unused[t]["count"] == s["count"]]
    if remove and unmatched and not setup.force:
        which = "" if kept == 0 else f"{', '.join(unmatched)} "
        raise ConfigError(
            f"none of the {samples} samples' {which}entries is in {backend!r}: were they encoded with another model "
            "or other sizes? Nothing was removed; give the model= and data settings precompute was run with (or "
            "gc.force=true to remove them all the same)"
        )
    if remove:
        unused = backend.unused(keep, collected, remove=True)
    count, size = sum(s["count"] for s in unused.values()), sum(s["bytes"] for s in unused.values())
    verb = "removed" if remove else "would remove"
    lines = [f"cache: {backend!r}", f"{samples} samples of model={setup.spec.name} use {kept:,} entries"]
    lines += [f"  {t:<20} {verb} {s['count']:,} ({format_bytes(s['bytes'])})" for t, s in unused.items() if s["count"]]
    lines.append(f"{verb} {count:,} unused entries, {format_bytes(size)}")
    if not remove and count:
        lines.append("dry run: nothing removed; add gc.dry_run=false to remove them")
    return AdminReport("\n".join(lines))
