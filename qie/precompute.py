"""python -m qie.precompute model=... data.path=... cache=ssd cache.dir=..."""

import hydra
from omegaconf import DictConfig

from qie.cli import run_stage
from qie.config import register
from qie.config.tree import conf_path
from qie.demo.builtin import with_builtin_data
from qie.stages import precompute

register("precompute")  # its schema, known to Hydra before @hydra.main composes


@hydra.main(config_path=conf_path(), config_name="precompute", version_base=None)
def main(cfg: DictConfig) -> None:
    run_stage(precompute.run, cfg, with_builtin_data)


if __name__ == "__main__":
    main()
