"""python -m qie.infer predict.image=in.png predict.prompt="..." [predict.lora=...] [predict.merge_to=DIR]"""

import hydra
from omegaconf import DictConfig

from qie.checks import register
from qie.cli import main_of, run_stage
from qie.config.tree import conf_path

register("infer")  # its schema, known to Hydra before @hydra.main composes


def _stage():  # imported once the config is checked: torch, diffusers and transformers come with the stage
    from qie.stages import infer

    return infer.start


@hydra.main(config_path=conf_path(), config_name="infer", version_base=None)
def main(cfg: DictConfig) -> None:
    run_stage("infer", _stage, cfg)


if __name__ == "__main__":
    main_of(main, "infer")
