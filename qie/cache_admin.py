"""`python -m qie.cache_admin action=stats|clear|verify cache.dir=... [cache.types=[...]] [verify.fix=true]`, and
`python -m qie.cache_admin action=gc cache.dir=... model=NAME data.path=... [gc.dry_run=false]`
(`python -m qie.cache ...` runs this too)."""

import sys

import hydra
from omegaconf import DictConfig

from qie.checks import register
from qie.cli import main_of, run_stage
from qie.config.tree import conf_path

register("cache")  # its schema, known to Hydra before @hydra.main composes


def _stage():  # imported once the config is checked: torch, diffusers and transformers come with the stage
    from qie.stages import cache_admin

    return cache_admin.start


@hydra.main(config_path=conf_path(), config_name="cache", version_base=None)
def main(cfg: DictConfig) -> None:
    code = run_stage("cache", _stage, cfg)
    if code:
        sys.exit(code)


if __name__ == "__main__":
    main_of(main, "cache")
