"""python -m qie.eval data.path=HELDOUT cache.dir=CACHE 'eval.loras=[none,a.safetensors]'"""

import hydra
from omegaconf import DictConfig

from qie.checks import Checked, register
from qie.cli import main_of, run_stage
from qie.config.tree import conf_path

register("eval")  # its schema, known to Hydra before @hydra.main composes


def _stage():  # imported once the config is checked: torch, diffusers and transformers come with the stage
    from qie.stages import evaluation

    return evaluation.start


def _builtin_data(checked: Checked) -> Checked:  # a tiny model without data.path: the built-in demo data set
    from qie.demo.builtin import with_builtin_data

    return with_builtin_data(checked)


@hydra.main(config_path=conf_path(), config_name="eval", version_base=None)
def main(cfg: DictConfig) -> None:
    run_stage("eval", _stage, cfg, _builtin_data)


if __name__ == "__main__":
    main_of(main, "eval")
