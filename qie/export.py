"""python -m qie.export RUN_DIR OUT [export.push_to_hub=USER/NAME] [export.lora=...] [export.license=...]

RUN_DIR and OUT, given without a key, are `export.run_dir=RUN_DIR export.out=OUT` (`qie.cli.keyed_positionals`);
the keyed form works too."""

import sys

import hydra
from omegaconf import DictConfig

from qie.checks import register
from qie.cli import keyed_positionals, main_of, run_stage
from qie.config.tree import conf_path

register("export")  # its schema, known to Hydra before @hydra.main composes


def _stage():  # imported once the config is checked: torch, diffusers and transformers come with the stage
    from qie.stages import export

    return export.start


@hydra.main(config_path=conf_path(), config_name="export", version_base=None)
def main(cfg: DictConfig) -> None:
    run_stage("export", _stage, cfg)


if __name__ == "__main__":
    sys.argv[1:] = keyed_positionals(sys.argv[1:], ("export.run_dir", "export.out"))
    main_of(main, "export")
