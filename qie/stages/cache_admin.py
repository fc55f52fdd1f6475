"""The cache admin stage: `action=stats|clear|verify` on the configured backend, `action=gc` (which reads the
data sets and the model's keys, `qie.stages.cache_gc`), and `action=sync` (copies the cache to `sync.to`: an
object store URL or a cache folder, `qie.cache.sync`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from qie.cache import check_types
from qie.cache.admin import run_admin
from qie.checks import Checked, check
from qie.config.backend import build_backend
from qie.config.cache import CacheConfig, SyncConfig
from qie.errors import ConfigError
from qie.stages.cache_gc import check_gc_data, collect_garbage, gc_setup
from qie.stages.recipe import Recipe


def run(cfg: DictConfig, run_dir: Path | None = None) -> int:
    """Run the admin action of a composed `cache` config, print its report, return the exit code (the stage from
    code: `cfg` checked once, `qie.checks.check`, then `start`).

    Raises:
        ConfigError: an unknown type or backend; StorageError: a cache folder that is missing or a file.
    """
    return start(check(cfg), run_dir)


def start(checked: Checked, run_dir: Path | None = None) -> int:
    """The stage's edge: the checked config's typed root (`CacheAdminRoot`) read into what its action needs, then run
    by the `CacheAdminRecipe`. See `run`."""
    root = checked.root
    try:
        types = check_types(list(root.cache.types))
    except ValueError as e:
        raise ConfigError(f"cache.types: {e}") from None
    action = str(root.action)
    if action == "sync":
        work: Any = root.sync
    elif action == "gc":
        check_gc_data(root.data)
        work = gc_setup(root.model, root.data, root.cache, root.gc, checked.precompute_command)
    else:
        work = bool(root.verify.fix)
    return CacheAdminRecipe(root.cache, action, types, work).execute()


class CacheAdminRecipe(Recipe):
    """The cache admin stage: `setup()` opens the backend, `run()` runs the action and prints its report.

    Args:
        cache: the cache group (its backend is built from `cache.backend`: `build_backend`).
        action: stats, clear, verify, gc or sync; types: the entry types it covers.
        work: what the action reads besides: sync's `SyncConfig`, gc's `gc_setup`, verify's `fix`.
    """

    def __init__(self, cache: CacheConfig, action: str, types: list[str], work: Any) -> None:
        self.cache, self.action, self.types, self.work = cache, action, types, work

    def setup(self) -> None:
        self.backend = build_backend(self.cache)

    def run(self) -> int:
        if self.action == "sync":
            report = _sync(self.work, self.backend, self.types)
        elif self.action == "gc":
            report = collect_garbage(self.work, self.backend)
        else:
            report = run_admin(self.backend, self.action, self.types, fix=bool(self.work))
        print(report)
        return report.exit_code


def _sync(s: SyncConfig, backend, types: list[str]):
    from qie.cache.sync import destination, sync_report

    if not s.to:
        raise ConfigError("action=sync needs sync.to: an object store URL (s3://BUCKET/PREFIX) or a cache folder")
    return sync_report(backend, destination(s.to, s.endpoint_url, s.storage_options, s.local_dir), types)
