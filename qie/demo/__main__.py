"""python -m qie.demo [train.max_steps=...] — the end-to-end demo on the tiny demo model."""

import hydra
from omegaconf import DictConfig

from qie.checks import register
from qie.cli import main_of, run_stage
from qie.config.tree import conf_path

register("demo")  # its schema, known to Hydra before @hydra.main composes


def _stage():  # imported once the config is checked: torch, diffusers and transformers come with the stage
    from qie.demo import run

    return run.start


@hydra.main(config_path=conf_path(), config_name="demo", version_base=None)
def main(cfg: DictConfig) -> None:
    run_stage("demo", _stage, cfg)


if __name__ == "__main__":
    main_of(main, "demo")
