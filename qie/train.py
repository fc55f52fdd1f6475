"""python -m qie.train model=... data.path=... cache.dir=... [train.max_steps=...]"""

import hydra
from omegaconf import DictConfig

from qie.cli import run_stage, search_value
from qie.demo.builtin import with_builtin_data
from qie.stages import train


@hydra.main(config_path="pkg://qie.conf", config_name="train", version_base=None)
def main(cfg: DictConfig) -> float | None:
    """Train; the held-out loss (validation.heldout_samples) is returned for a sweeper to minimise."""
    return search_value(run_stage(train.run, cfg, with_builtin_data))


if __name__ == "__main__":
    main()
