"""python -m qie.eval data.path=HELDOUT cache.dir=CACHE 'eval.loras=[none,a.safetensors]'"""

import hydra
from omegaconf import DictConfig

from qie.cli import run_stage
from qie.config import register
from qie.config.tree import conf_path
from qie.demo.builtin import with_builtin_data
from qie.stages import evaluation

register("eval")  # its schema, known to Hydra before @hydra.main composes


@hydra.main(config_path=conf_path(), config_name="eval", version_base=None)
def main(cfg: DictConfig) -> None:
    run_stage(evaluation.run, cfg, with_builtin_data)


if __name__ == "__main__":
    main()
