"""The cache admin stage: `action=stats|clear|verify` on the configured backend, `action=gc` (which reads the
data sets and the model's keys, `qie.stages.cache_gc`), and `action=sync` (copies the cache to `sync.to`: an
object store URL or a cache folder, `qie.cache.sync`)."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from qie.cache import check_types
from qie.cache.admin import run_admin
from qie.config.backend import build_backend
from qie.errors import ConfigError
from qie.stages.cache_gc import collect_garbage
from qie.stages.common import value


def run(cfg: DictConfig, run_dir: Path | None = None) -> int:
    """Run the admin action of a composed `cache` config, print its report, return the exit code.

    Raises:
        ConfigError: an unknown type or backend; StorageError: a cache folder that is missing or a file.
    """
    try:
        types = check_types(list(cfg.cache.types))
    except ValueError as e:
        raise ConfigError(f"cache.types: {e}") from None
    backend = build_backend(cfg.cache)
    action = str(value(cfg.action))
    if action == "sync":
        report = _sync(cfg, backend, types)
    elif action == "gc":
        report = collect_garbage(cfg, backend)
    else:
        report = run_admin(backend, action, types, fix=bool(cfg.verify.fix))
    print(report)
    return report.exit_code


def _sync(cfg: DictConfig, backend, types: list[str]):
    from qie.cache.sync import destination, sync_report

    s = cfg.sync
    if not s.to:
        raise ConfigError("action=sync needs sync.to: an object store URL (s3://BUCKET/PREFIX) or a cache folder")
    return sync_report(backend, destination(s.to, s.endpoint_url, s.storage_options, s.local_dir), types)
