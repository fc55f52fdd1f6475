"""python -m qie.train model=... data.path=... cache.dir=... [train.max_steps=...]"""

import hydra
from omegaconf import DictConfig

from qie.cli import exit_after_signal, run_stage, search_value
from qie.config import register
from qie.config.tree import conf_path
from qie.demo.builtin import with_builtin_data
from qie.stages import train

register("train")  # its schema, known to Hydra before @hydra.main composes


@hydra.main(config_path=conf_path(), config_name="train", version_base=None)
def main(cfg: DictConfig) -> float | None:
    """Train; exit 128 + the signal's number after a signal stop; else the held-out loss
    (validation.heldout_samples) is returned for a sweeper to minimise."""
    result = run_stage(train.run, cfg, with_builtin_data)
    exit_after_signal(result)
    return search_value(result)


if __name__ == "__main__":
    main()
