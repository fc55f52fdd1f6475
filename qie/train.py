"""python -m qie.train model=... data.path=... cache.dir=... [train.max_steps=...]"""

import hydra
from omegaconf import DictConfig

from qie.checks import Checked, register
from qie.cli import exit_after_signal, main_of, run_stage, search_value
from qie.config.tree import conf_path

register("train")  # its schema, known to Hydra before @hydra.main composes


def _stage():  # imported once the config is checked: torch, diffusers and transformers come with the stage
    from qie.stages import train

    return train.start


def _builtin_data(checked: Checked) -> Checked:  # a tiny model without data.path: the built-in demo data set
    from qie.demo.builtin import with_builtin_data

    return with_builtin_data(checked)


@hydra.main(config_path=conf_path(), config_name="train", version_base=None)
def main(cfg: DictConfig) -> float | None:
    """Train; exit 128 + the signal's number after a signal stop; else the held-out loss
    (validation.heldout_samples) is returned for a sweeper to minimise."""
    result = run_stage("train", _stage, cfg, _builtin_data)
    exit_after_signal(result)
    return search_value(result)


if __name__ == "__main__":
    main_of(main, "train")
