"""A sweep's summary: per job its overrides, status, final loss, held-out metrics and run folder, read from the
job folders (so it works whichever launcher ran them, Slurm included), printed as a markdown table and written
to the sweep folder as `sweep_summary.md` and `sweep_summary.json`, with `sweep_report.html` beside them (the jobs
side by side, `qie.reporting.sweep_report`)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import yaml

from qie.reporting.run_files import last_line, read_json

SUMMARY_MD = "sweep_summary.md"
SUMMARY_JSON = "sweep_summary.json"
# What a job leaves in its folder: a user error (written by qie.cli), the train stage's result, validation's
# metrics and rewards (named here to keep this module free of the stages' imports).
ERROR_FILE = "error.txt"
TRAIN_RESULT = "train_result.json"
VALIDATION_METRICS = Path("validation") / "metrics.jsonl"
VALIDATION_REWARDS = Path("validation") / "rewards.jsonl"


def job_record(folder: Path) -> dict[str, Any]:
    """What a job folder says about its job (see `summarize`)."""
    overrides = yaml.safe_load((folder / ".hydra" / "overrides.yaml").read_text(encoding="utf-8")) or []
    record: dict[str, Any] = {"job": folder.name, "overrides": [str(o) for o in overrides], "run_dir": str(folder)}
    result = read_json(folder / TRAIN_RESULT)
    if (folder / ERROR_FILE).is_file():
        lines = (folder / ERROR_FILE).read_text(encoding="utf-8").strip().splitlines()
        record.update(status="failed", error=lines[0] if lines else "(no message)")
    elif result is not None:
        record["status"] = "stopped" if result.get("stopped_by_signal") else "ok"
    else:
        record["status"] = "ok" if any(folder.glob("*_summary.json")) else "no result"
    if result is not None:
        record["step"], record["loss"] = result.get("step"), result.get("loss")
        for key in ("heldout_loss", "search_metric", "search_value"):
            if key in result:
                record[key] = result[key]
    for path in (VALIDATION_METRICS, VALIDATION_REWARDS):  # the edit metrics, then `validation.rewards`
        validation = last_line(folder / path)
        if validation:
            record.setdefault("validation", {}).update(validation.get("mean", {}))
    return record


def summarize(sweep: Path, folders: list[Path]) -> dict[str, Any]:
    """The summary of the jobs in `folders`: the overrides all share, each job's record and the best job: the lowest
    `search_value` (`validation.search_metric`) or, without one, the lowest held-out loss."""
    jobs = [job_record(f) for f in sorted(folders, key=_job_order)]
    common = set.intersection(*(set(j["overrides"]) for j in jobs)) if jobs else set()
    for job in jobs:
        job["varied"] = [o for o in job["overrides"] if o not in common]
    # What the sweeper minimised: `validation.search_metric`'s value where the jobs have one, else the held-out loss.
    key = "search_value" if any(_number(j.get("search_value")) is not None for j in jobs) else "heldout_loss"
    measured = [j for j in jobs if _number(j.get(key)) is not None]
    best = min(measured, key=lambda j: j[key])["job"] if measured else None
    failed = [j["job"] for j in jobs if j["status"] in ("failed", "no result")]
    return {"sweep": str(sweep), "common_overrides": sorted(common), "jobs": jobs, "best": best, "failed": failed}


def markdown(summary: dict[str, Any]) -> str:
    """The summary as a markdown table, one row per job."""
    validation = sorted({k for j in summary["jobs"] for k in j.get("validation", {})})
    head = ["job", "overrides", "status", "final loss", "held-out loss", *validation, "run folder"]
    rows = []
    for j in summary["jobs"]:
        status = j["status"] if j["status"] != "failed" else f"failed: {j['error']}"
        metrics = [_fmt(j.get("validation", {}).get(k)) for k in validation]
        best = " (best)" if j["job"] == summary["best"] else ""
        cells = [
            j["job"],
            " ".join(j["varied"]) or "-",
            status,
            _fmt(j.get("loss")),
            _fmt(j.get("heldout_loss")) + best,
            *metrics,
            j["run_dir"],
        ]
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    common = " ".join(summary["common_overrides"]) or "none"
    lines = [f"# Sweep {summary['sweep']}", "", f"Overrides of every job: {common}", ""]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head), *rows]
    if summary["failed"]:
        lines += ["", f"Failed jobs: {', '.join(summary['failed'])}"]
    return "\n".join(lines) + "\n"


def write_summary(sweep: Path, folders: list[Path]) -> dict[str, Any]:
    """Summarise the jobs in `folders`, write `sweep_summary.{md,json}` into `sweep`, print the table; the summary."""
    summary = summarize(sweep, folders)
    text = markdown(summary)
    sweep.mkdir(parents=True, exist_ok=True)
    (sweep / SUMMARY_MD).write_text(text, encoding="utf-8")
    (sweep / SUMMARY_JSON).write_text(json.dumps(summary, indent=2, default=str), encoding="utf-8")
    print(f"qie: sweep summary ({sweep / SUMMARY_MD}, {SUMMARY_JSON}):\n{text}", end="")
    try:
        from qie.reporting.sweep_report import write_sweep_report  # only when a sweep ends

        print(f"qie: sweep report {write_sweep_report(sweep, summary)}")
    except Exception as e:  # the summary is written; a report that cannot be drawn must not hide it
        print(f"qie: warning: the sweep report could not be written ({e.__class__.__name__}: {e})")
    return summary


def _job_order(folder: Path) -> tuple:
    return (0, int(folder.name), "") if folder.name.isdigit() else (1, 0, folder.name)


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not math.isnan(float(value)) else None


def _fmt(value: Any) -> str:
    number = _number(value)
    return "-" if number is None else f"{number:.4g}"
