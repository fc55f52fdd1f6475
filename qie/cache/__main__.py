"""`python -m qie.cache action=stats|clear|verify cache.dir=... [cache.types=[...]] [verify.fix=true]`,
`python -m qie.cache action=gc cache.dir=... model=NAME data.path=... [gc.dry_run=false]`, and
`python -m qie.cache action=sync cache.dir=... sync.to=s3://BUCKET/PREFIX [sync.endpoint_url=...]` (or back, from
`cache=remote cache.url=...` to `sync.to=FOLDER`). Any of them works on `cache=remote cache.url=...` too."""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from qie.cache import build_backend, check_types
from qie.cache.admin import run_admin
from qie.cli import run_stage
from qie.errors import ConfigError


def run(cfg: DictConfig, run_dir: Path | None = None) -> int:
    """Run the admin action of a composed `cache` config, print its report, return the exit code.

    Raises:
        ConfigError: an unknown type or backend; StorageError: a cache folder that is missing or a file.
    """
    try:
        types = check_types(list(cfg.cache.types))
    except ValueError as e:
        raise ConfigError(f"cache.types: {e}") from None
    backend = build_backend(cfg.cache._target_, cfg.cache.dir, settings=cfg.cache)
    action = getattr(cfg.action, "value", cfg.action)
    if action == "sync":
        report = _sync(cfg, backend, types)
    elif action == "gc":
        from qie.stages.cache_gc import collect_garbage

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


@hydra.main(config_path="pkg://qie.conf", config_name="cache", version_base=None)
def main(cfg: DictConfig) -> None:
    code = run_stage(run, cfg)
    if code:
        sys.exit(code)


if __name__ == "__main__":
    main()
