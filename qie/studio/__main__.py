"""python -m qie.studio [studio.port=8765] [studio.parallel=1] [studio.host=... studio.token=...]"""

import sys

import hydra
from omegaconf import DictConfig

from qie.checks import register
from qie.cli import main_of
from qie.config import typed
from qie.config.tree import conf_path
from qie.errors import QieError
from qie.studio.server import serve

register("studio")  # its schema, known to Hydra before @hydra.main composes


@hydra.main(config_path=conf_path(), config_name="studio", version_base=None)
def main(cfg: DictConfig) -> None:
    """Serve the page and run the queue until Ctrl-C; a bad setting, an unwritable home or a busy port end in one
    `qie: error:` line (exit 2)."""
    settings = typed(cfg.studio)
    try:
        if problem := settings.problem():
            raise QieError(problem)
        serve(settings)
    except QieError as e:
        print(f"qie: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main_of(main, "studio")
