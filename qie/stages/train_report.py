"""The train stage's record of a run and its report: `run_info.json` when the run starts (the command that
reproduces it, its config, its environment), `report.html` rewritten at each checkpoint and at the end
(`qie.reporting.run_report`)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from qie.checks.command import run_command
from qie.reporting.environment import environment, write_run_info
from qie.reporting.run_report import write_report

log = logging.getLogger(__name__)


def rebuilt_command(values: dict[str, Any]) -> str:
    """The command line that composes the config of plain `values` (`Checked.values`) again, or "" (with a warning)
    for a config made in code that the stage's CLI cannot compose: the run goes on without it."""
    try:
        return run_command(values, "train")
    except Exception as e:
        log.warning("qie: no command line rebuilds this run's config (%s: %s)", e.__class__.__name__, e)
        return ""


def record_run(run_dir: Path, command: str, run_config: dict, accelerator: Any) -> None:
    """Write `run_dir/run_info.json` (the main process) before training starts: the command that reruns it, the
    config as plain values and the machine."""
    if not accelerator.is_main_process:
        return
    env = environment(str(accelerator.device), accelerator.num_processes, str(accelerator.mixed_precision))
    write_run_info(run_dir, command, run_config, env)


def refresh_report(run_dir: Path, accelerator: Any) -> Path | None:
    """Rewrite `run_dir/report.html` (the main process); a failure is a warning, never the run's end."""
    if not accelerator.is_main_process:
        return None
    try:
        return write_report(run_dir)
    except Exception as e:  # the report shows the run; it must not stop it
        log.warning("qie: the report of %s could not be written (%s: %s)", run_dir, e.__class__.__name__, e)
        return None
