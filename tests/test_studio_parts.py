"""The studio's parts in this process: reading a run folder as it grows (whole lines only, torn ones skipped, a
rewritten file started again), the measures and a sweep's members, a log's telling line, a sweep checked value by
value, quoting a value for Hydra, and what a schema's source says of its settings."""

from __future__ import annotations

import json
from pathlib import Path

from hydra.core.override_parser.overrides_parser import OverridesParser

from qie.config.roots import DemoConfig
from qie.config.train import EmaConfig, TrainConfig
from qie.studio import runs
from qie.studio.commands import JobRequest, quoted, sweep_members
from qie.studio.notes import field_bounds, field_help
from qie.studio.runner import STOP_LINES, last_line


def test_metrics_are_read_a_whole_line_at_a_time(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 0.5}\n{"step": 2, "lo')  # the second line still being written
    rows, offset, reset = runs.new_rows(path, 0)
    assert (rows, offset, reset) == ([{"step": 1, "loss": 0.5}], len('{"step": 1, "loss": 0.5}\n'), False)
    with open(path, "a") as f:
        f.write('ss": 0.4}\nnot json\n{"step": 3, "loss": 0.3}\n')
    rows, offset, _ = runs.new_rows(path, offset)
    assert [r["step"] for r in rows] == [2, 3] and offset == path.stat().st_size
    path.write_text('{"step": 1, "loss": 0.9}\n')  # a new run in the folder: shorter than the offset
    rows, _, reset = runs.new_rows(path, offset)
    assert reset and rows == [{"step": 1, "loss": 0.9}]


def test_progress_measures_and_members(tmp_path: Path) -> None:
    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".hydra" / "config.yaml").write_text("train:\n  max_steps: 10\n")
    lines = [{"step": s, "loss": 1.0, "seconds": 2.0} for s in (1, 2, 3, 4)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert runs.progress(tmp_path) == {
        "step": 4,
        "max_steps": 10,
        "fraction": 0.4,
        "seconds_per_step": 2.0,
        "seconds_left": 12.0,
    }
    (tmp_path / "heldout.jsonl").write_text('{"step": 4, "heldout/loss": 0.7}\n')
    (tmp_path / "validation").mkdir()
    means = {"step": 4, "mean": {"psnr_edit": 11.0}, "samples": {"a": {"psnr_edit": 12.0}}}
    (tmp_path / "validation" / "metrics.jsonl").write_text(json.dumps(means) + "\n")
    assert runs.measures(tmp_path) == {
        "held-out": [{"step": 4, "heldout/loss": 0.7}],
        "validation/metrics": [{"step": 4, "psnr_edit": 11.0}],
    }
    for n, done in (("0", True), ("1", False)):
        member = tmp_path / "sweep" / n
        (member / ".hydra").mkdir(parents=True)
        (member / ".hydra" / "overrides.yaml").write_text(f"- train.seed={n}\n")
        (member / ("train_result.json" if done else "error.txt")).write_text("{}" if done else "data.path is bad\n")
    assert runs.members(tmp_path / "sweep") == [
        {"member": "0", "overrides": ["train.seed=0"], "state": "done", "step": 0},
        {"member": "1", "overrides": ["train.seed=1"], "state": "failed", "step": 0, "message": "data.path is bad"},
    ]


def test_the_telling_line_of_a_log(tmp_path: Path) -> None:
    log = tmp_path / "job.log"
    assert last_line(log) == "(no output)"
    log.write_text("qie studio: job 1: python -m qie.train\n")
    assert last_line(log) == "(no output)"  # the studio's own header says nothing of the job
    log.write_text("qie studio: job 1: x\nqie: error: data.path is bad\nqie: report r.html\n")
    assert last_line(log) == "qie: error: data.path is bad"
    log.write_text("train: 2/9\rtrain: 3/9\nqie: stopped by signal 15 at step 3\nqie: report r.html\n")
    assert last_line(log, STOP_LINES) == "qie: stopped by signal 15 at step 3"
    assert last_line(log) == "qie: report r.html"


def test_a_sweep_is_checked_value_by_value() -> None:
    parsed = OverridesParser.create().parse_overrides(
        ["train.learning_rate=1e-4,2e-4", "train.seed=1", "train.lora.rank=range(4,12,4)", "train.shift=interval(1,2)"]
    )
    assert sweep_members(parsed) == [
        ["train.learning_rate=0.0001", "train.seed=1", "train.lora.rank=4"],
        ["train.learning_rate=0.0002", "train.seed=1", "train.lora.rank=4"],
        ["train.learning_rate=0.0001", "train.seed=1", "train.lora.rank=8"],
    ]


def test_a_value_is_one_argument_as_hydra_reads_it() -> None:
    parser = OverridesParser.create()
    for value in ("/data/a b", "it's", "a,b=c", "end\\", "x\\'y", "${oc.env:HOME}", "true", "1e5", "/plain/path"):
        assert parser.parse_override(f"k={quoted(value)}").value() in (value, value.replace("${", "\\${")), value
    assert quoted("/plain/path") == "/plain/path" and quoted("true") == "'true'"
    request = JobRequest(stage="train", overrides=["train.max_steps=5", "train.resume=/old"], multirun=True)
    again = request.resumed()
    assert again.overrides == ["train.max_steps=5", "train.resume=latest"]
    assert again.command("/runs/1")[2:5] == ["qie.train", "-m", "train.max_steps=5"]
    assert again.command("/runs/1")[-1] == "hydra.sweep.dir=/runs/1"


def test_what_a_schema_says_of_its_settings() -> None:
    assert field_bounds(TrainConfig)["train.learning_rate"] == (0.0, 3.4e38)
    assert field_bounds(DemoConfig)["demo.image_size"] == (16, None)
    notes = field_help(EmaConfig)
    assert notes["every"] == "update every N optimizer steps"  # beside its field
    assert notes["cpu"] == "keep the average in CPU memory"  # not the comment beside the field above
