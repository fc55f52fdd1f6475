"""python -m qie.caption model=... data.path=... [caption=edit_instruction|describe|layered]"""

import hydra
from omegaconf import DictConfig

from qie.checks import register
from qie.cli import main_of, run_stage
from qie.config.tree import conf_path

register("caption")  # its schema, known to Hydra before @hydra.main composes


def _stage():  # imported once the config is checked: torch, diffusers and transformers come with the stage
    from qie.stages import caption

    return caption.start


@hydra.main(config_path=conf_path(), config_name="caption", version_base=None)
def main(cfg: DictConfig) -> None:
    run_stage("caption", _stage, cfg)


if __name__ == "__main__":
    main_of(main, "caption")
