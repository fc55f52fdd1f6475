"""What a training run folder holds, read for its report: the metrics per step, the held-out and validation
measures, the validation pictures per step, the run record (`run_info.json`), Hydra's `.hydra/` record, the
result and the checkpoints. Files that are missing, or lines a killed run left torn, are skipped."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from qie.reporting.environment import RUN_INFO

METRICS = "metrics.jsonl"
HELDOUT = "heldout.jsonl"
RESULT = "train_result.json"
VALIDATION = "validation"
REPORT = "report.html"
_STEP_FOLDER = re.compile(r"^step-(\d+)$")


@dataclass
class RunFiles:
    """A run folder's files, read.

    Attributes:
        validation: per validation set (its folder under validation/, "" for the plain one) its measure rows.
        pictures: per validation set, step -> the pictures sampled at that step, by file name.
        hydra_overrides: the overrides in `.hydra/overrides.yaml` (None without it).
        hydra_config: the text of `.hydra/config.yaml` ("" without it).
    """

    folder: Path
    metrics: list[dict] = field(default_factory=list)
    heldout: list[dict] = field(default_factory=list)
    validation: dict[str, list[dict]] = field(default_factory=dict)
    pictures: dict[str, dict[int, dict[str, Path]]] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)
    result: dict[str, Any] | None = None
    hydra_overrides: list[str] | None = None
    hydra_config: str = ""
    checkpoints: list[str] = field(default_factory=list)

    @property
    def command(self) -> str:
        """The command that reproduces the run: the run record's, else one rebuilt from Hydra's overrides."""
        if self.info.get("command"):
            return str(self.info["command"])
        if self.hydra_overrides is not None:
            return " ".join(["python -m qie.train", *self.hydra_overrides])
        return ""

    @property
    def config_text(self) -> str:
        """The run's resolved config as YAML (the run record's, else Hydra's composed one)."""
        if isinstance(self.info.get("config"), dict):
            return yaml.safe_dump(self.info["config"], sort_keys=False, default_flow_style=None)
        return self.hydra_config


def read_run(folder: Path) -> RunFiles:
    """Read the run folder `folder` (a missing file leaves its part empty)."""
    run = RunFiles(Path(folder))
    run.metrics = read_lines(folder / METRICS)
    run.heldout = read_lines(folder / HELDOUT)
    for name, sub in validation_sets(folder / VALIDATION).items():
        run.validation[name] = read_lines(sub / "metrics.jsonl")
        run.pictures[name] = pictures_by_step(sub)
    run.info = read_json(folder / RUN_INFO) or {}
    run.result = read_json(folder / RESULT)
    overrides = folder / ".hydra" / "overrides.yaml"
    if overrides.is_file():
        loaded = yaml.safe_load(overrides.read_text(encoding="utf-8")) or []
        run.hydra_overrides = [str(o) for o in loaded] if isinstance(loaded, list) else []
    if (folder / ".hydra" / "config.yaml").is_file():
        run.hydra_config = (folder / ".hydra" / "config.yaml").read_text(encoding="utf-8")
    checkpoints = folder / "checkpoints"
    if checkpoints.is_dir():
        run.checkpoints = sorted(p.name for p in checkpoints.iterdir() if _STEP_FOLDER.match(p.name))
    return run


def validation_sets(folder: Path) -> dict[str, Path]:
    """The validation sets under `folder`: "" for its own step folders, and `steps-N` per sampling step count."""
    if not folder.is_dir():
        return {}
    found = {"": folder} if any(_STEP_FOLDER.match(p.name) for p in folder.iterdir()) else {}
    found.update({p.name: p for p in sorted(folder.glob("steps-*")) if p.is_dir()})
    if not found and (folder / "metrics.jsonl").is_file():
        found[""] = folder
    return found


def pictures_by_step(folder: Path) -> dict[int, dict[str, Path]]:
    """step -> {file name: path} of the pictures in `folder`'s `step-NNNNNN` folders, by step."""
    out: dict[int, dict[str, Path]] = {}
    for sub in folder.iterdir():
        match = _STEP_FOLDER.match(sub.name)
        if match and sub.is_dir():
            out[int(match.group(1))] = {p.name: p for p in sorted(sub.glob("*.png"))}
    return dict(sorted(out.items()))


def read_lines(path: Path) -> list[dict]:
    """The JSON objects of a JSON-lines file, lines of one step merged into one (the regularisation loss is logged
    beside the step's own line); a torn line is skipped."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError:
        return []
    rows: dict[Any, dict] = {}
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.setdefault(row.get("step", len(rows)), {}).update(row)
    return list(rows.values())


def read_json(path: Path) -> dict | None:
    """The JSON object in `path`; None where it is missing, unreadable or not an object."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def last_line(path: Path) -> dict | None:
    """The last line of a JSON-lines file as an object; None where it is missing, empty or unreadable."""
    try:
        lines = path.read_text(encoding="utf-8").strip().splitlines()
        value = json.loads(lines[-1]) if lines else None
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None
