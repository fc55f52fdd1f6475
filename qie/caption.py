"""python -m qie.caption model=... data.path=... [caption=edit_instruction|describe|layered]"""

import hydra
from omegaconf import DictConfig

from qie.cli import run_stage
from qie.config import register
from qie.config.tree import conf_path
from qie.stages import caption

register("caption")  # its schema, known to Hydra before @hydra.main composes


@hydra.main(config_path=conf_path(), config_name="caption", version_base=None)
def main(cfg: DictConfig) -> None:
    run_stage(caption.run, cfg)


if __name__ == "__main__":
    main()
