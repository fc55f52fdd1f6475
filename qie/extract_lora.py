"""python -m qie.extract_lora model=... extract.tuned=RUN/transformer extract.rank=R extract.out=FILE"""

import hydra
from omegaconf import DictConfig

from qie.cli import run_stage
from qie.config import register
from qie.config.tree import conf_path
from qie.stages import extract_lora

register("extract_lora")  # its schema, known to Hydra before @hydra.main composes


@hydra.main(config_path=conf_path(), config_name="extract_lora", version_base=None)
def main(cfg: DictConfig) -> None:
    run_stage(extract_lora.run, cfg)


if __name__ == "__main__":
    main()
