"""A wall-clock budget for any run (`train.max_minutes`): training stops at the first step boundary past it, saves
and exports as at the end, says how to go on, and a resume continues from there."""

from __future__ import annotations

from pathlib import Path

import pytest

from qie.errors import ConfigError

STEPS = ["train.learning_rate=1e-3", "data.batch_size=2", "logging.report_to=none", "data.num_workers=0"]


def train(base: list[str], run_dir: Path, *overrides: str) -> dict:
    from qie.checks import compose
    from qie.stages import train as train_stage

    return train_stage.run(compose("train", [*base, *STEPS, *overrides]), run_dir)


def test_a_spent_budget_stops_after_the_step_saves_and_a_resume_goes_on(
    tiny_path: Path, cached_data, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    base = [f"model.pretrained_model_name_or_path={tiny_path}", *cached_data.overrides]
    run = tmp_path / "run"
    # 6 ms: spent before the first step ends, so the run stops right after it.
    result = train(base, run, "train.max_steps=50", "train.max_minutes=0.0001")
    assert result["stopped_by_time"] and not result["stopped_by_signal"] and result["signal"] is None
    assert result["step"] == 1 and (run / "checkpoints" / "step-000001").is_dir() and (run / "lora").is_dir()
    out = capsys.readouterr().out
    assert "qie: stopped by the time budget (train.max_minutes) at step 1" in out
    assert f"qie: continue with train.resume=latest hydra.run.dir={run}" in out
    resumed = train(base, run, "train.max_steps=3", "train.resume=latest")
    assert resumed["step"] == 3 and len(resumed["losses"]) == 2 and not resumed["stopped_by_time"]


@pytest.mark.parametrize("value", ["0", "-5", "nan"])
def test_a_budget_that_is_no_time_is_refused_when_composed(value: str) -> None:
    from qie.checks import compose

    with pytest.raises(ConfigError, match=rf"train.max_minutes={value}.* is out of range"):
        compose("train", [f"train.max_minutes={value}"])
