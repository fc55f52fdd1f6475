"""Eval metrics in training: `validation.rewards` scored on the held-out rows at each validation, logged, and
`validation.search_metric` returned to a sweeper."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import CachedData, small_config

from qie.cli import search_value
from qie.errors import ConfigError
from qie.reporting.sweep_summary import job_record
from qie.stages import train

REWARDS = [
    "+validation.rewards.pixel_error._target_=qie.evaluation.metrics.PixelError",
    "+validation.rewards.edit_psnr._target_=qie.evaluation.metrics.EditPsnr",
]


def test_validation_scores_the_heldout_rows_and_returns_the_searched_metric(
    tmp_path: Path, cached_data: CachedData
) -> None:
    cfg = small_config(
        "train",
        *cached_data.overrides,
        "validation.heldout_samples=2",
        "validation.every=2",
        "predict.true_cfg_scale=1.0",
        *REWARDS,
        "validation.search_metric=edit_psnr",
    )
    result = train.run(cfg, tmp_path)
    lines = [json.loads(line) for line in (tmp_path / "validation" / "rewards.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [2]
    assert lines[0]["directions"] == {"pixel_error": "lower", "edit_psnr": "higher"}
    assert 0 < lines[0]["mean"]["pixel_error"] < 1
    psnr = lines[0]["mean"]["edit_psnr"]
    assert result["search_metric"] == "edit_psnr" and result["validation_edit_psnr"] == psnr
    # A sweeper minimises: a higher-is-better metric is returned negated.
    assert result["search_value"] == -psnr == search_value(result)
    # The rows scored are the held-out ones (kept out of training), not the first training samples.
    heldout = json.loads((tmp_path / "train_result.json").read_text())["heldout_samples"]
    assert heldout == 2 and len(list((tmp_path / "validation" / "step-000002").glob("*.png"))) == 2
    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".hydra" / "overrides.yaml").write_text("[]\n")
    record = job_record(tmp_path)
    assert record["search_value"] == -psnr and record["validation"]["edit_psnr"] == psnr


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["validation.search_metric=edit_psnr"],
            "validation.search_metric=edit_psnr is not a reward of validation.rewards (pixel_error)",
        ),
        (
            ["validation.search_metric=pixel_error", "validation.every=3", "train.max_steps=10"],
            "validation.search_metric=pixel_error is read from the last validation: set validation.every to a divisor "
            "of train.max_steps=10 (now 3)",
        ),
    ],
)
def test_a_search_metric_must_be_a_reward_measured_at_the_last_step(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as e:
        small_config("train", REWARDS[0], *overrides)
    assert str(e.value) == message


def test_an_optuna_search_minimises_an_eval_metric(
    tmp_path: Path, cached_data: CachedData, monkeypatch, capsys
) -> None:
    """`hydra/sweeper=optuna` on `validation.search_metric=pixel_error`: each trial returns its last validation's
    pixel error, and the summary's best job is the one Optuna picked."""
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
    import sys

    import yaml

    from qie import train as cli

    sweep = tmp_path / "search"
    argv = [
        "qie.train",
        "-m",
        "hydra/sweeper=optuna",
        "hydra.sweeper.n_trials=2",
        "hydra.sweeper.sampler.seed=1",
        "train.learning_rate=tag(log,interval(1e-3,1e-1))",
        "train.max_steps=2",
        "train.checkpoint_every=0",
        "validation.heldout_samples=2",
        "validation.every=2",
        REWARDS[0],
        "validation.search_metric=pixel_error",
        "predict.num_inference_steps=2",
        "predict.true_cfg_scale=1.0",
        "logging.report_to=none",
        "data.num_workers=0",
        f"hydra.sweep.dir={sweep}",
        *cached_data.overrides,
    ]
    monkeypatch.setattr(sys, "argv", argv)
    cli.main()
    best = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    summary = json.loads((sweep / "sweep_summary.json").read_text())
    errors = {j["job"]: j["validation"]["pixel_error"] for j in summary["jobs"]}
    assert sorted(errors) == ["0", "1"] and summary["failed"] == []
    assert best["best_value"] == min(errors.values()) == errors[summary["best"]]
    assert "sweep_summary.md" in capsys.readouterr().out
