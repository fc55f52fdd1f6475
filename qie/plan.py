"""python -m qie.plan model=... data.target_pixels=... gpu_memory_gb=24"""

import hydra
from omegaconf import DictConfig

from qie.cli import run_stage
from qie.config import register
from qie.config.tree import conf_path
from qie.stages import plan

register("plan")  # its schema, known to Hydra before @hydra.main composes


@hydra.main(config_path=conf_path(), config_name="plan", version_base=None)
def main(cfg: DictConfig) -> None:
    run_stage(plan.run, cfg)


if __name__ == "__main__":
    main()
