"""The eval stage's outputs: eval.json (every number), eval.md (the runs side by side, overall and per category)
and eval.png (a row per sample: control, target, each run's edit at the first seed; the prompt under it)."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from PIL import Image

from qie.evaluation.grid import captioned_grid

JSON_FILE = "eval.json"
MARKDOWN_FILE = "eval.md"
PICTURE_FILE = "eval.png"


def write_json(report: Mapping[str, Any], folder: Path) -> Path:
    """eval.json (a nan, which JSON cannot hold, written as null)."""
    path = folder / JSON_FILE
    path.write_text(json.dumps(_finite(report), indent=2, sort_keys=False) + "\n", encoding="utf-8")
    return path


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def markdown(report: Mapping[str, Any]) -> str:
    """The runs side by side: a table of every metric's mean (and which way is better), then one per category."""
    runs, directions = report["runs"], report["directions"]
    names = list(directions)
    head = ["metric", "better", *runs]

    def table(metrics_of: Mapping[str, Mapping[str, Any]]) -> list[str]:
        rows = [
            f"| {name} | {directions[name]} | " + " | ".join(_fmt(metrics_of[r].get(name)) for r in runs) + " |"
            for name in names
        ]
        return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head), *rows]

    data = report["data"]
    lines = [f"# Evaluation of {data['rows']} row(s) of {data['path']}", ""]
    lines += [
        f"Seeds {', '.join(str(s) for s in report['seeds'])}; runs: "
        + ", ".join(f"{name} ({run['lora'] or 'the base model'})" for name, run in runs.items()),
        "",
    ]
    lines += table({r: runs[r]["metrics"] for r in runs})
    categories = sorted({c for run in runs.values() for c in run["categories"]})
    for category in categories:
        count = next(run["categories"][category]["rows"] for run in runs.values() if category in run["categories"])
        lines += ["", f"## {category} ({count} row(s))", ""]
        lines += table({r: runs[r]["categories"].get(category, {}).get("metrics", {}) for r in runs})
    lines += ["", f"Picture: {PICTURE_FILE} (a row per sample: control, target, {', '.join(runs)})"]
    return "\n".join(lines) + "\n"


def write_markdown(report: Mapping[str, Any], folder: Path) -> Path:
    path = folder / MARKDOWN_FILE
    path.write_text(markdown(report), encoding="utf-8")
    return path


def write_picture(
    rows: Sequence[Sequence[Image.Image]], captions: Sequence[str], runs: Sequence[str], tile: int, folder: Path
) -> Path:
    """eval.png: per sample its control, target (a blank tile where it has none) and each run's edit."""
    path = folder / PICTURE_FILE
    captioned_grid(rows, captions, ("control", "target", *runs), tile).save(path)
    return path


def _fmt(value: Any) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.4f}"


__all__ = ["JSON_FILE", "MARKDOWN_FILE", "PICTURE_FILE", "markdown", "write_json", "write_markdown", "write_picture"]
