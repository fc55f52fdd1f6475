"""python -m qie.infer predict.image=in.png predict.prompt="..." [predict.lora=...] [predict.merge_to=DIR]"""

import hydra
from omegaconf import DictConfig

from qie.cli import run_stage
from qie.config import register
from qie.config.tree import conf_path
from qie.stages import infer

register("infer")  # its schema, known to Hydra before @hydra.main composes


@hydra.main(config_path=conf_path(), config_name="infer", version_base=None)
def main(cfg: DictConfig) -> None:
    run_stage(infer.run, cfg)


if __name__ == "__main__":
    main()
