"""python -m qie.train model=... data.path=... cache.dir=... [train.max_steps=...]"""

import hydra
from omegaconf import DictConfig

from qie.cli import exit_after_signal, run_stage
from qie.stages import train


@hydra.main(config_path="conf", config_name="train", version_base=None)
def main(cfg: DictConfig) -> None:
    exit_after_signal(run_stage(train.run, cfg))


if __name__ == "__main__":
    main()
