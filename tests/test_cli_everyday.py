"""The CLI as everyday use meets it: sweeps that survive a failing job, logs that read well in a file,
and a launcher that starts fewer processes than asked for."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import CachedData

from qie.progress import PlainProgress
from qie.stages.processes import launch_problem

pytestmark = pytest.mark.subprocess


@pytest.fixture(scope="module")
def data(tiny_path: Path, cached_data: CachedData) -> dict:
    """The CLI's arguments for the shared cached data set (the model named by its folder)."""
    model = f"model.pretrained_model_name_or_path={tiny_path}"
    return {"root": cached_data.root, "base": [model, *cached_data.overrides, "logging.report_to=none",
                                               "data.num_workers=0"]}  # fmt: skip


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def test_a_sweep_with_a_failing_job_completes_the_other(data: dict, tmp_path: Path, monkeypatch, capsys) -> None:
    from qie import train as cli

    sweep, good, missing = tmp_path / "sweep", data["root"] / "train", tmp_path / "missing"
    argv = ["qie.train", "-m", f"data.path={missing},{good}", "train.max_steps=1", f"hydra.sweep.dir={sweep}",
            "validation.heldout_samples=2"]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv + [o for o in data["base"] if not o.startswith("data.path=")])
    with pytest.raises(SystemExit) as end:
        cli.main()
    assert end.value.code == 1
    out, err = capsys.readouterr()
    # Job 0 failed with a user error, written to its own run directory; job 1 ran after it.
    assert "does not exist" in (sweep / "0" / "error.txt").read_text()
    result = json.loads((sweep / "1" / "train_result.json").read_text())
    assert result["step"] == 1 and result["heldout_samples"] == 2 and result["heldout_loss"] > 0
    assert not (sweep / "1" / "error.txt").exists()
    assert f"qie: sweep {sweep}: 1 of 2 job(s) failed" in err and f"{sweep / '0'}: data.path" in err
    assert "Traceback" not in err
    # The summary: printed, and written as markdown and JSON into the sweep folder.
    summary = json.loads((sweep / "sweep_summary.json").read_text())
    failed, ok = summary["jobs"]
    assert summary["failed"] == ["0"] and summary["best"] == "1"
    assert failed["status"] == "failed" and "does not exist" in failed["error"] and "loss" not in failed
    assert failed["varied"] == [f"data.path={missing}"] and ok["run_dir"] == str(sweep / "1")
    assert (ok["status"], ok["step"], ok["loss"]) == ("ok", 1, result["loss"])
    assert ok["heldout_loss"] == result["heldout_loss"]
    table = (sweep / "sweep_summary.md").read_text()
    row = f"| 1 | data.path={good} | ok | {ok['loss']:.4g} | {ok['heldout_loss']:.4g} (best) |"
    assert table in out and row in table
    assert "| 0 | data.path=" in table and "failed: data.path" in table


def test_an_optuna_search_minimises_the_heldout_loss(data: dict, tmp_path: Path, monkeypatch, capsys) -> None:
    """`hydra/sweeper=optuna` (the `optuna` extra): two trials, each returning its held-out loss."""
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
    import yaml

    from qie import train as cli

    sweep = tmp_path / "search"
    argv = ["qie.train", "-m", "hydra/sweeper=optuna", "hydra.sweeper.n_trials=2", "hydra.sweeper.sampler.seed=1",
            "train.learning_rate=tag(log,interval(1e-4,1e-2))", "train.lora.rank=choice(2,4)", "train.max_steps=1",
            "validation.heldout_samples=2", f"hydra.sweep.dir={sweep}", *data["base"]]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    cli.main()
    out = capsys.readouterr().out
    best = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    summary = json.loads((sweep / "sweep_summary.json").read_text())
    losses = {j["job"]: j["heldout_loss"] for j in summary["jobs"]}
    assert sorted(losses) == ["0", "1"] and summary["failed"] == []
    assert best["best_value"] == min(losses.values()) == losses[summary["best"]]
    assert set(best["best_params"]) == {"train.learning_rate", "train.lora.rank"}
    assert all(any(o.startswith("train.learning_rate=") for o in j["varied"]) for j in summary["jobs"])
    assert "sweep_summary.md" in out


def test_a_40_step_log_in_a_file_is_plain_lines(data: dict, tmp_path: Path) -> None:
    run = tmp_path / "run"
    args = ["train.max_steps=40", "train.checkpoint_every=10", f"hydra.run.dir={run}"]
    with open(tmp_path / "out", "w") as out, open(tmp_path / "err", "w") as err:
        proc = subprocess.run([sys.executable, "-m", "qie.train", *data["base"], *args], env=_env(), stdout=out,
                              stderr=err, timeout=600)  # fmt: skip
    text = (tmp_path / "out").read_text() + (tmp_path / "err").read_text()
    assert proc.returncode == 0, text[-3000:]
    lines = text.splitlines()
    assert "\r" not in text and max(len(line) for line in lines) <= 400
    progress = [line for line in lines if line.startswith("train: ")]
    assert progress[0].startswith("train: 4/40 (10%)") and progress[-1].startswith("train: 40/40 (100%)")
    assert len(progress) <= 12  # every 10% (and every 30 s), not every step
    # accelerate's line per saved file is folded into one qie line per checkpoint.
    assert [line for line in lines if line.startswith("qie: checkpoint at step")] == [
        f"qie: checkpoint at step {s}: {run / 'checkpoints' / f'step-{s:06d}'}" for s in (10, 20, 30, 40)
    ]
    assert "Saving current state" not in text and "Random states saved" not in text


def test_plain_progress_writes_at_most_every_tenth_or_30_seconds() -> None:
    import io

    clock = iter([0.0] + [float(t) for t in range(0, 1000, 10)])
    stream = io.StringIO()
    bar = PlainProgress(1000, "train", stream=stream, clock=lambda: next(clock))
    for _ in range(20):  # 20 steps, 10 "seconds" apart: a line at 30 s, 60 s, ... (10% would be 100 steps)
        bar.update(1)
    bar.set_postfix(loss="0.1234")
    bar.close()
    lines = stream.getvalue().splitlines()
    assert [line.split(",")[0] for line in lines] == [
        f"train: {n}/1000 ({round(n / 10)}%)" for n in (4, 7, 10, 13, 16, 19, 20)
    ]
    assert lines[-1].startswith("train: 20/1000 (2%), loss=0.1234, ") and lines[-1].endswith(" left")


def test_a_launcher_that_started_one_process_of_several_is_named() -> None:
    accelerate_env = {"MASTER_ADDR": "127.0.0.1", "ACCELERATE_MIXED_PRECISION": "no"}
    assert "started one" in launch_problem(1, accelerate_env)
    assert "started 2 processes, but this run joined 1" in launch_problem(1, {"WORLD_SIZE": "2"})
    assert launch_problem(2, {**accelerate_env, "WORLD_SIZE": "2"}) is None  # torchrun / multi_gpu: joined
    assert launch_problem(1, {"ACCELERATE_MIXED_PRECISION": "no"}) is None  # accelerate launch of one process
    assert launch_problem(1, {}) is None


def test_accelerate_launch_on_cpus_says_how_to_run_several_processes(data: dict, tmp_path: Path) -> None:
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "2", "--num_machines",
              "1", "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "qie.train"]  # fmt: skip
    args = ["train.max_steps=1", f"hydra.run.dir={tmp_path / 'run'}"]
    proc = subprocess.run(launch + data["base"] + args, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "qie: warning: accelerate launch was asked for several processes but started one" in proc.stderr
    assert "torchrun --standalone --nproc_per_node N -m qie.train" in proc.stderr
