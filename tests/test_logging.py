"""The metrics logger hands the steps' scalars to its tracker thread in batches, every one of them in order."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qie.training import logging as metrics


def test_the_steps_reach_tensorboard_in_batches_and_in_order(tmp_path: Path, monkeypatch) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    handed = []
    submit = metrics._TrackerThread.submit

    def counted(self, fn, *args) -> None:
        handed.append(fn.__name__)
        submit(self, fn, *args)

    monkeypatch.setattr(metrics._TrackerThread, "submit", counted)
    monkeypatch.setattr(metrics, "HAND_OVER_SECONDS", 3600.0)  # by count only, whatever the machine's speed
    logger = metrics.MetricsLogger(tmp_path, "tensorboard")
    for step in range(1, 31):
        logger.log(step, {"loss": 1.0 / step})
    assert handed == ["_send_steps"]  # steps 1-25 in one hand-over; 26-30 wait
    logger.log_scalars({"heldout/loss": 0.5}, 30)  # anything else goes after the steps logged before it
    assert handed == ["_send_steps", "_send_steps", "_send_scalars"]
    logger.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == list(range(1, 31))
    assert [e.value for e in events.Scalars("train/loss")] == pytest.approx([1.0 / s for s in range(1, 31)])
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == list(
        range(1, 31)
    )
