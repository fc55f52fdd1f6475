"""The cache admin stage: `action=stats|clear|verify` on the configured backend, `action=gc` (which reads the
data sets and the model's keys, `qie.stages.cache_gc`), and `action=sync` (copies the cache to `sync.to`: an
object store URL or a cache folder, `qie.cache.sync`)."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from qie.cache import check_types
from qie.cache.admin import run_admin
from qie.config import precompute_command, typed
from qie.config.backend import build_backend
from qie.config.cache import SyncConfig
from qie.errors import ConfigError
from qie.stages.cache_gc import check_gc_data, collect_garbage, gc_setup


def run(cfg: DictConfig, run_dir: Path | None = None) -> int:
    """Run the admin action of a composed `cache` config, print its report, return the exit code. The stage's
    edge: the one place that reads `cfg`.

    Raises:
        ConfigError: an unknown type or backend; StorageError: a cache folder that is missing or a file.
    """
    try:
        types = check_types(list(cfg.cache.types))
    except ValueError as e:
        raise ConfigError(f"cache.types: {e}") from None
    backend = build_backend(cfg.cache)
    action = str(cfg.action)
    if action == "sync":
        report = _sync(typed(cfg.sync), backend, types)
    elif action == "gc":
        data = typed(cfg.data)
        check_gc_data(data)
        setup = gc_setup(typed(cfg.model), data, typed(cfg.cache), typed(cfg.gc), precompute_command(cfg))
        report = collect_garbage(setup, backend)
    else:
        report = run_admin(backend, action, types, fix=bool(cfg.verify.fix))
    print(report)
    return report.exit_code


def _sync(s: SyncConfig, backend, types: list[str]):
    from qie.cache.sync import destination, sync_report

    if not s.to:
        raise ConfigError("action=sync needs sync.to: an object store URL (s3://BUCKET/PREFIX) or a cache folder")
    return sync_report(backend, destination(s.to, s.endpoint_url, s.storage_options, s.local_dir), types)
