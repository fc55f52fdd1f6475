"""`python -m qie.cache_admin action=stats|clear|verify cache.dir=... [cache.types=[...]] [verify.fix=true]`, and
`python -m qie.cache_admin action=gc cache.dir=... model=NAME data.path=... [gc.dry_run=false]`
(`python -m qie.cache ...` runs this too)."""

import sys

import hydra
from omegaconf import DictConfig

from qie.cli import run_stage
from qie.config import register
from qie.config.tree import conf_path
from qie.stages import cache_admin

register("cache")  # its schema, known to Hydra before @hydra.main composes


@hydra.main(config_path=conf_path(), config_name="cache", version_base=None)
def main(cfg: DictConfig) -> None:
    code = run_stage(cache_admin.run, cfg)
    if code:
        sys.exit(code)


if __name__ == "__main__":
    main()
