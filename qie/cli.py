"""What the stage entry points share: the Hydra run directory and turning user errors into messages."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from qie.config import register, validate
from qie.errors import QieError

# The stage schemas must be known to Hydra before an entry point's @hydra.main composes its config.
register()


def run_dir() -> Path:
    """The Hydra run (or multirun job) directory of the current job."""
    from hydra.core.hydra_config import HydraConfig

    return Path(HydraConfig.get().runtime.output_dir)


def run_stage(run: Callable[[DictConfig, Path], Any], cfg: DictConfig) -> Any:
    """Validate `cfg`, run the stage in the Hydra run directory; a QieError exits 2 with its message."""
    try:
        validate(cfg)
        return run(cfg, run_dir())
    except QieError as e:
        print(f"qie: error: {e}", file=sys.stderr)
        sys.exit(2)
