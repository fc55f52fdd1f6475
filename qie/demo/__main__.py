"""python -m qie.demo [train.max_steps=...] — the end-to-end demo on the tiny model."""

import hydra
from omegaconf import DictConfig

from qie.cli import run_stage
from qie.stages import demo


@hydra.main(config_path="../conf", config_name="demo", version_base=None)
def main(cfg: DictConfig) -> None:
    run_stage(demo.run, cfg)


if __name__ == "__main__":
    main()
