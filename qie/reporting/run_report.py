"""`report.html` of a training run: its curves (loss, learning rate, gradient norm), step time and memory,
held-out and validation measures over the steps, the validation pictures as strips (a row per sample, a column per
validation step), its config, environment and the command that reproduces it. Built from the run folder's files
alone (`qie.reporting.run_files`): the train stage rewrites it at each checkpoint and at the end, and
`python -m qie.report RUN_DIR` rebuilds it from a finished folder."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from pathlib import Path

from qie.output_files import replace_file
from qie.reporting import charts as ch
from qie.reporting.page import charts, details, esc, page, preformatted, section, strip, table
from qie.reporting.run_files import REPORT, RunFiles, read_run

# At most this many validation steps in a strip, spread over the run (the first and the last always among them).
MAX_STRIP_STEPS = 12
MAX_STRIP_ROWS = 16  # and at most this many pictures of each step (the first, by name)
# The columns of metrics.jsonl drawn on their own charts (each other number gets a chart of its own).
PLOTTED = {"step", "loss", "lr", "grad_norm", "seconds", "reg_loss"}


def write_report(folder: Path, out: Path | None = None, extra: Sequence[str] = (), title: str = "") -> Path:
    """Write the report of the run folder `folder` to `out` (default `folder/report.html`) atomically; its path.

    Args:
        extra: sections (HTML) shown after the overview, by a caller that knows more of the run (the demo).
        title: the page's title (default: "qie training run" and the folder's name).
    """
    folder = Path(folder)
    out = Path(out) if out is not None else folder / REPORT
    text = render(read_run(folder), extra, title)
    return replace_file(out, lambda tmp: tmp.write_text(text, encoding="utf-8"), "the report")


def render(run: RunFiles, extra: Sequence[str] = (), title: str = "") -> str:
    """The report page of `run`, with the `extra` sections after its overview."""
    title = title or f"qie training run {run.folder.name}"
    sections = [
        f"<h1>{esc(title)}</h1>",
        overview(run),
        *extra,
        section("Training", charts(training_charts(run.metrics))),
        section("Step time and memory", charts(speed_charts(run.metrics))),
        section("Held-out and validation measures", charts(measure_charts(run))),
        validation_pictures(run),
        section("Command", preformatted(run.command) if run.command else "", hydra_overrides(run)),
        section(
            "Config", details("the resolved config (YAML)", preformatted(run.config_text)) if run.config_text else ""
        ),
        environment(run.info.get("environment")),
    ]
    return page(title, sections)


def overview(run: RunFiles) -> str:
    """A table of what the run is and where it stands."""
    last = run.metrics[-1] if run.metrics else {}
    seconds = [r["seconds"] for r in run.metrics if _number(r.get("seconds"))]
    memory = [v for r in run.metrics for k, v in r.items() if k.startswith("memory/") and _number(v)]
    heldout = (run.result or {}).get("heldout_loss")
    if heldout is None and run.heldout:
        heldout = run.heldout[-1].get("heldout/loss")
    rows = [
        ("run folder", str(run.folder)),
        ("state", state(run)),
        ("last logged step", last.get("step")),
        ("last loss", last.get("loss")),
        ("held-out loss", heldout),
        ("mean step time (s)", sum(seconds) / len(seconds) if seconds else None),
        ("peak memory (GiB)", max(memory) if memory else None),
        ("checkpoints", ", ".join(run.checkpoints) or None),
        ("report written", time.strftime("%Y-%m-%d %H:%M:%S %Z")),
    ]
    return table(None, rows)


def state(run: RunFiles) -> str:
    """Finished, stopped by a signal, or in progress (at which step of how many)."""
    if run.result is not None:
        how = "stopped by a signal" if run.result.get("stopped_by_signal") else "finished"
        return f"{how} at step {run.result.get('step')}"
    config = run.info.get("config") or {}
    total = (config.get("train") or {}).get("max_steps") if isinstance(config, dict) else None
    step = run.metrics[-1].get("step") if run.metrics else 0
    return f"in progress: step {step}" + (f" of {total}" if total else "")


def training_charts(rows: list[dict]) -> list[tuple[str, str | None]]:
    """Loss (and its smoothed line), learning rate, gradient norm, and every other number training logs."""
    steps = [r.get("step") for r in rows]
    loss = [_value(r, "loss") for r in rows]
    lines = {"loss": (steps, loss)}
    if len(rows) > 10:
        lines["smoothed"] = (steps, ch.smoothed(loss))
    if any("reg_loss" in r for r in rows):
        lines["regularisation loss"] = (steps, [_value(r, "reg_loss") for r in rows])
    out = [("loss", ch.line_chart("loss", lines))]
    out.append(("learning rate", ch.line_chart("learning rate", {"lr": (steps, [_value(r, "lr") for r in rows])})))
    out.append(
        (
            "gradient norm",
            ch.line_chart(
                "gradient norm (before clipping)",
                {"grad_norm": (steps, [_value(r, "grad_norm") for r in rows])},
                log_y=True,
            ),
        )
    )
    others = sorted(
        {k for r in rows for k, v in r.items() if k not in PLOTTED and not k.startswith("memory/") and _number(v)}
    )
    for key in others:
        out.append((key, ch.line_chart(key, {key: (steps, [_value(r, key) for r in rows])})))
    return out


def speed_charts(rows: list[dict]) -> list[tuple[str, str | None]]:
    """Seconds per step, and the memory figures logged with each step."""
    steps = [r.get("step") for r in rows]
    seconds = ch.line_chart("seconds per optimizer step", {"seconds": (steps, [_value(r, "seconds") for r in rows])})
    names = sorted({k for r in rows for k in r if k.startswith("memory/")})
    memory = {n.removeprefix("memory/"): (steps, [_value(r, n) for r in rows]) for n in names}
    return [("step time", seconds), ("memory", ch.line_chart("peak memory (GiB)", memory) if memory else None)]


def measure_charts(run: RunFiles) -> list[tuple[str, str | None]]:
    """One chart per held-out measure, and one per validation measure (a line per validation set)."""
    out = []
    names = sorted({k for r in run.heldout for k, v in r.items() if k != "step" and _number(v)})
    steps = [r.get("step") for r in run.heldout]
    for name in names:
        out.append(
            (
                name,
                ch.line_chart(
                    f"held-out {name.removeprefix('heldout/')}", {name: (steps, [_value(r, name) for r in run.heldout])}
                ),
            )
        )
    measures = sorted({k for rows in run.validation.values() for r in rows for k in (r.get("mean") or {})})
    for measure in measures:
        lines = {}
        for name, rows in run.validation.items():
            values = [_value(r.get("mean") or {}, measure) for r in rows]
            lines[f"validation {name}".strip()] = ([r.get("step") for r in rows], values)
        out.append((f"validation {measure}", ch.line_chart(f"validation {measure} (mean of the samples)", lines)))
    return out


def validation_pictures(run: RunFiles) -> str:
    """Per validation set, its pictures: a row per sample (the first MAX_STRIP_ROWS), a column per validation step
    (at most MAX_STRIP_STEPS)."""
    parts = []
    for name, by_step in run.pictures.items():
        if not by_step:
            continue
        steps = spread(list(by_step), MAX_STRIP_STEPS)
        files = sorted({f for step in steps for f in by_step[step]})
        rows = [(Path(f).stem, [by_step[s].get(f) for s in steps]) for f in files[:MAX_STRIP_ROWS]]
        notes = [
            f"{len(steps)} of {len(by_step)} validation steps" if len(steps) < len(by_step) else "",
            f"{len(rows)} of {len(files)} pictures" if len(rows) < len(files) else "",
        ]
        shown = "; ".join(n for n in notes if n)
        title = f"<h3>{esc(name)}</h3>" if name else ""
        parts.append(
            title
            + (f'<p class="muted">shown: {shown}</p>' if shown else "")
            + strip([f"step {s}" for s in steps], rows)
        )
    return section("Validation pictures", *parts)


def spread(steps: list[int], count: int) -> list[int]:
    """At most `count` of `steps`, evenly spread, the first and the last among them."""
    if len(steps) <= count:
        return steps
    picks = {round(i * (len(steps) - 1) / (count - 1)) for i in range(count)}
    return [steps[i] for i in sorted(picks)]


def hydra_overrides(run: RunFiles) -> str:
    """The overrides Hydra recorded in the run folder, where it did."""
    if not run.hydra_overrides:
        return ""
    return "<p>Hydra's overrides (.hydra/overrides.yaml):</p>" + preformatted(" ".join(run.hydra_overrides))


def environment(env: dict | None) -> str:
    """Versions and the device, as the run recorded them when it started."""
    if not env:
        return ""
    versions = env.get("versions") or {}
    rows = [(k, v) for k, v in env.items() if k != "versions"]
    return section("Environment", table(["package", "version"], versions.items()), table(None, rows))


def _value(row: dict, key: str) -> float:
    value = row.get(key)
    return float(value) if _number(value) else math.nan


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
