"""python -m qie.extract_lora model=... extract.tuned=RUN/transformer extract.rank=R extract.out=FILE"""

import hydra
from omegaconf import DictConfig

from qie.checks import register
from qie.cli import main_of, run_stage
from qie.config.tree import conf_path

register("extract_lora")  # its schema, known to Hydra before @hydra.main composes


def _stage():  # imported once the config is checked: torch, diffusers and transformers come with the stage
    from qie.stages import extract_lora

    return extract_lora.start


@hydra.main(config_path=conf_path(), config_name="extract_lora", version_base=None)
def main(cfg: DictConfig) -> None:
    run_stage("extract_lora", _stage, cfg)


if __name__ == "__main__":
    main_of(main, "extract_lora")
