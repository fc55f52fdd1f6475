"""Held-out samples and a sweep's summary, from job folders written here (no training)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from qie.data.samples import Sample
from qie.errors import ConfigError
from qie.reporting.sweep_summary import markdown, summarize
from qie.stages.heldout import split_heldout


def _samples(ids: list[str]) -> list[Sample]:
    return [Sample(id=i, target=Path(f"{i}.png"), controls=(), prompt="p") for i in ids]


def test_the_heldout_samples_follow_their_ids_not_the_order() -> None:
    ids = [f"{i:05d}" for i in range(20)]
    train, held = split_heldout(_samples(ids), 3)
    again_train, again_held = split_heldout(_samples(ids[::-1]), 3)
    assert len(held) == 3 and {s.id for s in held} == {s.id for s in again_held}
    assert {s.id for s in train} | {s.id for s in held} == set(ids) and len(train) == 17
    grown = split_heldout(_samples(ids + ["00020"]), 3)[1]
    assert len({s.id for s in grown} & {s.id for s in held}) >= 2  # an added sample moves at most one
    assert split_heldout(_samples(ids), 0) == (_samples(ids), [])
    with pytest.raises(ConfigError, match="validation.heldout_samples=20 leaves no sample to train on"):
        split_heldout(_samples(ids), 20)


def _job(sweep: Path, name: str, overrides: list[str], result: dict | None = None, error: str | None = None) -> Path:
    folder = sweep / name
    (folder / ".hydra").mkdir(parents=True)
    (folder / ".hydra" / "overrides.yaml").write_text(json.dumps(overrides))  # JSON is YAML
    if result is not None:
        (folder / "train_result.json").write_text(json.dumps(result))
    if error is not None:
        (folder / "error.txt").write_text(error + "\n")
    return folder


def test_the_summary_names_each_jobs_state_and_the_best(tmp_path: Path) -> None:
    jobs = [
        _job(tmp_path, "10", ["a=1", "lr=3"], {"step": 5, "loss": 0.5, "heldout_loss": 0.7, "stopped_by_signal": 0}),
        _job(tmp_path, "2", ["a=1", "lr=2"], {"step": 5, "loss": 0.4, "heldout_loss": 0.6, "stopped_by_signal": 0}),
        _job(tmp_path, "3", ["a=1", "lr=|"], error="data.path is not set"),
        _job(tmp_path, "4", ["a=1", "lr=4"]),  # crashed, or still running: no result
    ]
    (jobs[0] / "validation").mkdir()
    (jobs[0] / "validation" / "metrics.jsonl").write_text('{"step": 5, "mean": {"psnr_edit": 20.5}}\n')
    summary = summarize(tmp_path, jobs)
    assert [j["job"] for j in summary["jobs"]] == ["2", "3", "4", "10"]
    assert summary["common_overrides"] == ["a=1"] and summary["best"] == "2"
    assert summary["failed"] == ["3", "4"]
    assert [j["status"] for j in summary["jobs"]] == ["ok", "failed", "no result", "ok"]
    table = markdown(summary)
    assert "| job | overrides | status | final loss | held-out loss | psnr_edit | run folder |" in table
    assert f"| 2 | lr=2 | ok | 0.4 | 0.6 (best) | - | {jobs[1]} |" in table
    assert f"| 10 | lr=3 | ok | 0.5 | 0.7 | 20.5 | {jobs[0]} |" in table
    assert "| 3 | lr=\\| | failed: data.path is not set |" in table and "Failed jobs: 3, 4" in table


def test_a_search_without_heldout_samples_stops_before_any_job(capsys: pytest.CaptureFixture[str]) -> None:
    from qie.cli import SweepSummary

    optuna = "hydra_plugins.hydra_optuna_sweeper.optuna_sweeper.OptunaSweeper"
    config = OmegaConf.create({"hydra": {"sweeper": {"_target_": optuna}}, "validation": {"heldout_samples": 0}})
    with pytest.raises(SystemExit) as end:
        SweepSummary().on_multirun_start(config)
    assert end.value.code == 2 and "set validation.heldout_samples=N" in capsys.readouterr().err
    config.validation.heldout_samples = 4
    SweepSummary().on_multirun_start(config)
