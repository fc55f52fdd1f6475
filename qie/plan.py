"""python -m qie.plan model=... data.target_pixels=... gpu_memory_gb=24"""

import hydra
from omegaconf import DictConfig

from qie.checks import register
from qie.cli import main_of, run_stage
from qie.config.tree import conf_path

register("plan")  # its schema, known to Hydra before @hydra.main composes


def _stage():  # imported once the config is checked: torch, diffusers and transformers come with the stage
    from qie.stages import plan

    return plan.start


@hydra.main(config_path=conf_path(), config_name="plan", version_base=None)
def main(cfg: DictConfig) -> None:
    run_stage("plan", _stage, cfg)


if __name__ == "__main__":
    main_of(main, "plan")
