"""`sweep_report.html` of a sweep, beside its summary (`qie.reporting.sweep_summary`): the jobs side by side (a
table, their loss curves on one chart), the sweep's measure against each setting it varied, and each job's last
validation pictures.
Built from the summary and the job folders' files, linking each job's own `report.html`."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import yaml

from qie.output_files import replace_file
from qie.reporting import charts as ch
from qie.reporting.page import Raw, charts, esc, page, section, strip, table
from qie.reporting.run_files import REPORT, read_lines, read_run

SWEEP_REPORT = "sweep_report.html"


def write_sweep_report(sweep: Path, summary: dict[str, Any]) -> Path:
    """Write `sweep/sweep_report.html` of `summary` (`qie.reporting.sweep_summary.summarize`) atomically; its path."""
    text = render_sweep(Path(sweep), summary)
    return replace_file(Path(sweep) / SWEEP_REPORT, lambda tmp: tmp.write_text(text, encoding="utf-8"), "the report")


def render_sweep(sweep: Path, summary: dict[str, Any]) -> str:
    jobs = summary["jobs"]
    metric, label = measure_of(jobs)
    common = " ".join(summary["common_overrides"]) or "none"
    sections = [
        f"<h1>qie sweep {esc(sweep)}</h1><p>Overrides of every job: <code>{esc(common)}</code></p>",
        section("Jobs", jobs_table(sweep, summary)),
        section("Jobs side by side", charts(curves(jobs))),
        section(f"{label} against each swept setting", charts(setting_charts(jobs, metric, label))),
        section("Last validation pictures", last_pictures(jobs)),
    ]
    return page(f"qie sweep {sweep.name}", sections)


def measure_of(jobs: list[dict]) -> tuple[str, str]:
    """The measure the jobs are compared by: the held-out loss where any job has one, else the final loss."""
    if any(_number(j.get("heldout_loss")) for j in jobs):
        return "heldout_loss", "held-out loss"
    return "loss", "final loss"


def jobs_table(sweep: Path, summary: dict[str, Any]) -> str:
    jobs = summary["jobs"]
    measures = sorted({k for j in jobs for k in j.get("validation", {})})
    rows = []
    for j in jobs:
        status = j["status"] if j["status"] != "failed" else f"failed: {j.get('error', '')}"
        best = " (best)" if j["job"] == summary.get("best") else ""
        rows.append(
            [
                _job_link(sweep, j),
                " ".join(j.get("varied", [])) or "-",
                status,
                j.get("step"),
                j.get("loss"),
                f"{_fmt(j.get('heldout_loss'))}{best}",
                *(j.get("validation", {}).get(m) for m in measures),
            ]
        )
    head = ["job", "overrides", "status", "steps", "final loss", "held-out loss", *measures]
    return table(head, rows)


def curves(jobs: list[dict]) -> list[tuple[str, str | None]]:
    """Every job's loss curve on one chart, and its held-out loss where measured."""
    loss, heldout = {}, {}
    for j in jobs:
        name = f"{j['job']}: {' '.join(j.get('varied', [])) or '-'}"
        rows = read_lines(Path(j["run_dir"]) / "metrics.jsonl")
        if rows:
            loss[name] = ([r.get("step") for r in rows], ch.smoothed([_float(r.get("loss")) for r in rows], 0.6))
        held = read_lines(Path(j["run_dir"]) / "heldout.jsonl")
        if held:
            heldout[name] = ([r.get("step") for r in held], [_float(r.get("heldout/loss")) for r in held])
    out = [("loss of every job", ch.line_chart("loss (lightly smoothed), per job", loss) if loss else None)]
    out.append(("held-out loss of every job", ch.line_chart("held-out loss, per job", heldout) if heldout else None))
    return out


def setting_charts(jobs: list[dict], metric: str, label: str) -> list[tuple[str, str | None]]:
    """Per setting the jobs vary, `metric` of each job against the job's value of it."""
    values: dict[str, list[tuple[Any, float, str]]] = {}
    for j in jobs:
        for override in j.get("varied", []):
            key, _, text = override.partition("=")
            values.setdefault(key.lstrip("+~"), []).append((_parsed(text), _float(j.get(metric)), j["job"]))
    return [
        (f"{label} against {key}", ch.setting_chart(f"{label} against {key}", key, points))
        for key, points in values.items()
    ]


def last_pictures(jobs: list[dict]) -> str:
    """A row per job: the pictures of its last validation step (of its first validation set)."""
    rows, names = [], []
    for j in jobs:
        run = read_run(Path(j["run_dir"]))
        by_step = next((p for p in run.pictures.values() if p), None)
        if by_step:
            step = max(by_step)
            rows.append((f"job {j['job']} (step {step})", by_step[step]))
            names += [n for n in by_step[step] if n not in names]
    if not rows:
        return ""
    return strip([Path(n).stem for n in names], [(label, [files.get(n) for n in names]) for label, files in rows])


def _job_link(sweep: Path, job: dict) -> str | Raw:
    report = Path(job["run_dir"]) / REPORT
    if not report.is_file():
        return str(job["job"])
    try:
        href = report.relative_to(sweep).as_posix()
    except ValueError:
        href = report.as_uri()
    return Raw(f'<a href="{esc(href)}">{esc(job["job"])}</a>')


def _parsed(text: str) -> Any:
    """An override's value as Hydra reads it: numbers as numbers (`3e-4` too, which YAML 1.1 keeps as text)."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _float(value: Any) -> float:
    return float(value) if _number(value) else math.nan


def _fmt(value: Any) -> str:
    return f"{value:.4g}" if _number(value) else "-"
