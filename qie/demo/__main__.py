"""python -m qie.demo [train.max_steps=...] — the end-to-end demo on the tiny demo model."""

import hydra
from omegaconf import DictConfig

from qie.cli import run_stage
from qie.config import register
from qie.config.tree import conf_path
from qie.demo.run import run

register("demo")  # its schema, known to Hydra before @hydra.main composes


@hydra.main(config_path=conf_path(), config_name="demo", version_base=None)
def main(cfg: DictConfig) -> None:
    run_stage(run, cfg)


if __name__ == "__main__":
    main()
