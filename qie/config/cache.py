"""Schemas of the `cache` group, the precompute stage and the cache admin command."""

from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from qie.config.ranges import at_least
from qie.entry_types import CACHE_TYPES


class SourceMode(StrEnum):
    """Where training gets embeddings: the cache only, live encoders, or the cache filled on a miss."""

    cached = "cached"
    live = "live"
    lazy = "lazy"


# What precompute does with a sample it cannot read. Built with the functional API because `raise` is a
# keyword: OmegaConf matches strings to member *names*, so the member must be named "raise" itself.
OnError = StrEnum("OnError", [("skip", "skip"), ("raise", "raise")], module=__name__)


class CacheAction(StrEnum):
    stats = "stats"
    clear = "clear"
    verify = "verify"
    gc = "gc"
    sync = "sync"


class OnMissing(StrEnum):
    """What cached training does when samples have no (or damaged) entries: stop, or train on the rest."""

    stop = "stop"
    skip = "skip"


# The state folder's name inside `cache.dir` when `cache.state_dir` is not set.
STATE_FOLDER = "state"


def _ssd() -> dict[str, Any]:
    return {"_target_": "qie.cache.ssd.SsdBackend"}


def _all_types() -> list[str]:
    """Every cache entry type, sample fields' and stores' included (registered as they are declared): read when a
    cache node is built."""
    return list(CACHE_TYPES)


@dataclass
class CacheConfig:
    """The stages' cache settings; the backend's own are under `backend`."""

    name: str = "ssd"
    # The cache's folder on this node, given to a backend that takes `dir` (cache=ssd keeps its entries there).
    dir: str | None = None
    # The stages' rebuildable state on this node, apart from the entries: file hashes, remembered sample keys and
    # image sizes, folder indexes, images written from a Hugging Face data set. Deleting it costs a scan again, never
    # an entry. null: `<cache.dir>/state` (none without a cache folder).
    state_dir: str | None = None
    mode: SourceMode = SourceMode.cached
    # Check each entry's checksum when training reads it (a corrupt entry is then a miss, never data). On by
    # default: it costs ~0.01% of a tiny cached step and ~0.2 ms per Edit 1024² sample (docs/benchmarks.md §8,
    # scripts/bench_verify_reads.py); false reads the bytes unchecked. Given to a backend that takes it.
    verify_reads: bool = True
    # Precompute: read every existing entry once and re-encode those whose checksum fails (without it, only
    # missing and truncated entries are written again).
    repair: bool = False
    # Cached training with samples whose entries are missing or damaged: stop before building the model
    # (listing them in cache_report.json with the precompute command), or train on the rest with a warning.
    on_missing: OnMissing = OnMissing.stop
    types: list[str] = field(default_factory=_all_types)
    vae_encoder_device: str = "auto"
    text_encoder_device: str = "auto"
    # The backend, instantiated as written: `_target_` names its class, every other key is its constructor's
    # (conf/cache/remote.yaml lists the object store's; a backend of your own: `cache.backend._target_=pkg.Cls
    # +cache.backend.param=value`). cache=ssd's `startup_check` ("folders", or "files": every entry file is
    # stat-ed, which also finds one rewritten in place): `+cache.backend.startup_check=files`.
    backend: dict[str, Any] = field(default_factory=_ssd)

    def state_folder(self) -> str | None:
        """Where the stages keep their rebuildable state: `state_dir`, else `<dir>/state`; None without either."""
        if self.state_dir:
            return str(self.state_dir)
        return str(Path(self.dir) / STATE_FOLDER) if self.dir else None


@dataclass
class PrecomputeConfig:
    start: int = 0
    end: int | None = None
    batch_size: int = 4
    on_error: OnError = OnError.skip
    # Also compute distillation's teacher outputs (`teacher_latent`) for every sample of the range, for each of
    # `train.objective.seeds` and with caption dropout's empty prompt too: give the training run's overrides
    # (train/objective=distill, train.objective.*, model.*, and its train.* memory settings), so its cached run
    # reads them instead of sampling the teacher on first use.
    teachers: bool = False

    def problem(self) -> str | None:
        """`batch_size` from 1, a range of samples from `start` (0 or more) to an `end` not before it."""
        return at_least("precompute", [("batch_size", self.batch_size, 1), ("start", self.start, 0)]) or (
            None if self.end is None else at_least("precompute", [("end", self.end, self.start)])
        )


@dataclass
class VerifyConfig:
    fix: bool = False


@dataclass
class GcConfig:
    """`action=gc`: remove the entries no sample of `data.path` (and of `keep_data`) uses under `model=`."""

    # List what would go, remove nothing; gc.dry_run=false removes it.
    dry_run: bool = True
    # More data sets (folders or manifests, read with the same data settings) whose entries are kept too.
    keep_data: list[str] = field(default_factory=list)
    # Remove even the whole of a type the data sets use none of (else refused: another model or other sizes
    # were named, e.g. a model with the same VAE but another text encoder would take every prompt entry).
    force: bool = False


@dataclass
class SyncConfig:
    """`action=sync`: copy the configured cache into `to` (an object store URL, or an ssd cache folder)."""

    to: str | None = None
    # For an object store destination: its endpoint, more fsspec options, and the node-local copy folder.
    endpoint_url: str | None = None
    storage_options: Any = None
    local_dir: str | None = None
