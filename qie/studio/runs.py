"""What the page shows of a job, read from its run folder: the metrics lines new since the last poll, progress and
time left, the latest validation pictures, the log's tail, the report, a sweep's members, an evaluation's table and
picture, and for several runs their curves and the settings in which they differ. Reads files only (`.hydra/`,
`metrics.jsonl`, `validation/`, `train_result.json`, `eval.json`); a file not written yet leaves its part empty.
"""

from __future__ import annotations

import json
import os
import re
import statistics
from pathlib import Path
from typing import Any

import yaml

from qie.reporting.run_files import HELDOUT, METRICS, REPORT, RESULT, pictures_by_step, read_json, read_lines
from qie.reporting.run_files import validation_sets as validation_folders
from qie.reporting.sweep_summary import ERROR_FILE

SWEEP_REPORT = "sweep_report.html"
# The stages whose run folders log training steps (`metrics.jsonl`, `train.max_steps`): the ones with a progress.
TRAINING_STAGES = ("train", "demo")
_MEMBER = re.compile(r"^\d+$")
# A compared run's curve keeps at most this many points (evenly spread): the page draws, it does not analyse.
CURVE_POINTS = 400


def training_folder(run_dir: Path) -> Path:
    """Where a job's training writes its metrics: the run folder, or the demo's `train/` inside it."""
    if not (run_dir / METRICS).is_file() and (run_dir / "train" / METRICS).is_file():
        return run_dir / "train"
    return run_dir


def new_rows(path: Path, offset: int) -> tuple[list[dict], int, bool]:
    """The JSON lines of `path` written after byte `offset` (whole lines only), the offset after them, and whether
    the file was rewritten (shorter than `offset`: the page starts its curves again)."""
    try:
        size = path.stat().st_size
    except OSError:
        return [], 0, offset > 0
    reset = size < offset
    start = 0 if reset else offset
    with open(path, "rb") as f:
        f.seek(start)
        data = f.read()
    whole = data[: data.rfind(b"\n") + 1]
    rows = []
    for line in whole.decode("utf-8", errors="replace").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a torn line of a killed run
        if isinstance(row, dict):
            rows.append(row)
    return rows, start + len(whole), reset


def tail_rows(path: Path, window: int = 16384) -> list[dict]:
    """The JSON lines in the last `window` bytes of `path`."""
    try:
        size = path.stat().st_size
    except OSError:
        return []
    offset = max(0, size - window)
    rows, _, _ = new_rows(path, offset)
    return rows[1:] if offset else rows  # the first may be the end of a line


def run_config(folder: Path) -> dict:
    """The run's composed config as Hydra recorded it (`.hydra/config.yaml`); {} without it."""
    try:
        loaded = yaml.safe_load((folder / ".hydra" / "config.yaml").read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return {}
    return loaded if isinstance(loaded, dict) else {}


def progress(folder: Path) -> dict:
    """The last logged step, `train.max_steps`, the fraction done and the seconds left at the recent step time."""
    rows = [r for r in tail_rows(folder / METRICS) if isinstance(r.get("step"), int)]
    max_steps = (run_config(folder).get("train") or {}).get("max_steps")
    out: dict[str, Any] = {"step": rows[-1]["step"] if rows else 0, "max_steps": max_steps}
    if isinstance(max_steps, int) and max_steps > 0:
        out["fraction"] = min(1.0, out["step"] / max_steps)
        seconds = [r["seconds"] for r in rows[-20:] if isinstance(r.get("seconds"), int | float)]
        if seconds:
            per_step = statistics.median(seconds)
            out["seconds_per_step"] = per_step
            out["seconds_left"] = max(0, max_steps - out["step"]) * per_step
    return out


def latest_pictures(folder: Path) -> dict:
    """The validation pictures of the latest validation step (per validation set), paths relative to `folder`."""
    out = {}
    for name, sub in validation_folders(folder / "validation").items():
        steps = pictures_by_step(sub)
        if steps:
            step = max(steps)
            out[name or "validation"] = {
                "step": step,
                "files": [str(p.relative_to(folder)) for p in steps[step].values()],
            }
    return out


def measures(folder: Path) -> dict[str, list[dict]]:
    """What a training measured besides each step's line: the held-out measures (`heldout.jsonl`) and each
    validation's (`validation/metrics.jsonl` per validation set, `validation/rewards.jsonl`; their means over the
    samples): name -> rows of a step and its numbers."""
    files = {"held-out": folder / HELDOUT}
    for name, sub in validation_folders(folder / "validation").items():
        for file in ("metrics.jsonl", "rewards.jsonl"):
            files["/".join(p for p in ("validation", name, file.split(".")[0]) if p)] = sub / file
    out = {}
    for name, path in files.items():
        rows = [_numbers(r) for r in read_lines(path) if isinstance(r.get("step"), int)]
        if rows:
            out[name] = rows
    return out


def _numbers(row: dict) -> dict:
    """A measures line's step and numbers: its own, or its means over the samples (`mean`)."""
    values = row["mean"] if isinstance(row.get("mean"), dict) else row
    return {"step": row["step"], **{k: v for k, v in values.items() if k != "step" and _number(v)}}


def log_tail(path: Path, lines: int = 60, window: int = 32768) -> list[str]:
    """The last `lines` lines of the log at `path` (progress bars' carriage returns as line ends)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - window))
            text = f.read().decode("utf-8", errors="replace")
    except OSError:
        return []
    return [line for line in text.replace("\r", "\n").splitlines() if line.strip()][-lines:]


def members(sweep: Path) -> list[dict]:
    """A sweep's job folders (Hydra's `<sweep>/<n>/`): each one's overrides and how it stands (failed with its
    `error.txt`, done with a `train_result.json`, else its last logged step)."""
    out = []
    folders = [p for p in sweep.iterdir() if p.is_dir() and _MEMBER.match(p.name)] if sweep.is_dir() else []
    for folder in sorted(folders, key=lambda p: int(p.name)):
        try:
            overrides = yaml.safe_load((folder / ".hydra" / "overrides.yaml").read_text(encoding="utf-8")) or []
        except (OSError, yaml.YAMLError):
            overrides = []
        error = folder / ERROR_FILE
        state = "failed" if error.is_file() else "done" if (folder / RESULT).is_file() else "started"
        entry = {"member": folder.name, "overrides": overrides, "state": state, "step": progress(folder)["step"]}
        if error.is_file():
            entry["message"] = error.read_text(encoding="utf-8", errors="replace").strip()
        out.append(entry)
    return out


def evaluation(folder: Path) -> dict | None:
    """An eval job's table (each run's metric means, which way each is better) and picture, from `eval.json` and
    `eval.png` in its `eval.output_dir`; None before they exist."""
    out_dir = str((run_config(folder).get("eval") or {}).get("output_dir") or ".")
    where = (folder / out_dir).resolve()
    if not where.is_relative_to(folder.resolve()):
        return None
    result = read_json(where / "eval.json")
    if result is None:
        return None
    runs = result.get("runs") or {}
    table = {name: (run or {}).get("metrics") or {} for name, run in runs.items()}
    picture = where / "eval.png"
    return {
        "runs": table,
        "loras": {name: (run or {}).get("lora") for name, run in runs.items()},
        "directions": result.get("directions") or {},
        "picture": str(picture.relative_to(folder.resolve())) if picture.is_file() else None,
    }


def outputs(folder: Path) -> dict:
    """The files of `folder` the page links: its report (or a sweep's), the LoRA, the checkpoints."""
    report = next((name for name in (REPORT, SWEEP_REPORT) if (folder / name).is_file()), None)
    if report is None and (folder / "train" / REPORT).is_file():
        report = f"train/{REPORT}"
    lora = training_folder(folder) / "lora" / "pytorch_lora_weights.safetensors"
    checkpoints = training_folder(folder) / "checkpoints"
    return {
        "report": report,
        "lora": str(lora) if lora.is_file() else None,
        "checkpoints": sorted(p.name for p in checkpoints.glob("step-*")) if checkpoints.is_dir() else [],
        "result": read_json(training_folder(folder) / RESULT),
    }


def curves(folder: Path) -> dict:
    """A run's loss, learning rate and held-out loss per step, thinned to `CURVE_POINTS`."""
    train = training_folder(folder)
    rows = [r for r in read_lines(train / METRICS) if isinstance(r.get("step"), int)]
    step = max(1, len(rows) // CURVE_POINTS)
    kept = rows[::step] + ([rows[-1]] if rows and (len(rows) - 1) % step else [])
    out = {name: [[r["step"], r[name]] for r in kept if _number(r.get(name))] for name in ("loss", "lr")}
    heldout = [(r["step"], r.get("heldout/loss", r.get("loss"))) for r in read_lines(train / HELDOUT)]
    out["heldout_loss"] = [[step, loss] for step, loss in heldout if _number(loss)]
    return out


def flat(config: Any, prefix: str = "") -> dict[str, str]:
    """A nested config as dotted keys -> the value written as JSON."""
    if isinstance(config, dict) and config:
        out: dict[str, str] = {}
        for key, value in config.items():
            out.update(flat(value, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: json.dumps(config, default=str)}


def differences(folders: list[Path]) -> dict[str, list[str | None]]:
    """The settings in which the runs of `folders` differ: dotted key -> each run's value (None where it has no
    such key)."""
    configs = [flat(run_config(training_folder(f))) for f in folders]
    keys = sorted(set().union(*configs)) if configs else []
    return {k: [c.get(k) for c in configs] for k in keys if len({c.get(k) for c in configs}) > 1}


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value == value


__all__ = [
    "curves",
    "differences",
    "evaluation",
    "latest_pictures",
    "log_tail",
    "members",
    "new_rows",
    "outputs",
    "progress",
    "training_folder",
]
