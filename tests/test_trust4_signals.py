"""Trust, fourth round: signals and odd values. Ctrl-C ends precompute, inference and captioning in one line with
status 130; a second signal before training's stop save finished removes that save and names the checkpoints kept;
an Optuna search whose trials all fail ends in one line with its sweep summary; odd values (demo sizes, distillation
steps, the local copy's size, DPO weights, fused LoRA scales) are refused at compose time naming the key."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import CachedData, optuna_logs_through_root, small_config

from qie.errors import Interrupted
from qie.stages import train as train_stage
from qie.training import checkpoint as ckpt


def exit_code(main: Callable[[], object]) -> object:
    """The status `main` exits with, or the exception it raised instead (never let one stop the test session)."""
    try:
        main()
    except SystemExit as e:
        return e.code
    except BaseException as e:  # noqa: BLE001 - a KeyboardInterrupt is what a missing fix raises
        return repr(e)
    return None


# --- 8: Ctrl-C -----------------------------------------------------------------------------------------------


KEPT = {
    "precompute": "the entries written so far are kept: run the same command again to encode the rest",
    "infer": "the images written so far are kept",
    "caption": "the captions written so far are kept: run the same command again to caption the rest",
    "train": "the checkpoints saved so far are kept: train.resume=latest continues from the last",
}


@pytest.mark.parametrize("stage", sorted(KEPT))
def test_ctrl_c_in_a_stage_ends_in_one_line_and_status_130(
    stage: str, cached_data: CachedData, tmp_path: Path, monkeypatch, capsys
) -> None:
    """A KeyboardInterrupt in the stage (where Python raises Ctrl-C's) ends in one line saying what is kept."""
    import importlib

    entry, stage_module = importlib.import_module(f"qie.{stage}"), importlib.import_module(f"qie.stages.{stage}")

    def interrupted(checked, run_dir):
        raise KeyboardInterrupt

    interrupted.__module__ = stage_module.__name__
    monkeypatch.setattr(stage_module, "start", interrupted)  # what the entry point runs once the config is checked
    argv = [f"qie.{stage}", f"data.path={cached_data.data}", f"hydra.run.dir={tmp_path / 'run'}"]
    monkeypatch.setattr(sys, "argv", argv)
    capsys.readouterr()
    assert exit_code(entry.main) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"qie: interrupted by SIGINT: {KEPT[stage]}"]


@pytest.mark.subprocess
# Timing-bound beside other tests (the run may end before the signal); the in-process Ctrl-C of each stage runs in CI.
@pytest.mark.slow
def test_ctrl_c_in_a_real_precompute_ends_in_one_line_and_a_rerun_finishes(tiny_path: Path, tmp_path: Path) -> None:
    from qie.demo.synthetic import make_dataset

    make_dataset(tmp_path / "ds", train=160, heldout=0, size=64)  # seconds of work: the signal comes first
    args = [f"data.path={tmp_path / 'ds' / 'train'}", f"cache.dir={tmp_path / 'cache'}", "data.num_workers=0"]
    cmd = [sys.executable, "-m", "qie.precompute", *args, f"hydra.run.dir={tmp_path / 'r0'}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    log = tmp_path / "log"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            deadline = time.monotonic() + 120
            while "/160 (" not in log.read_text():  # the first progress line: 10 % encoded
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.02)
            os.kill(proc.pid, signal.SIGINT)  # Ctrl-C
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
    text = log.read_text()
    assert proc.returncode == 130, text
    assert "Traceback" not in text and text.strip().splitlines()[-1] == (
        "qie: interrupted by SIGINT: the entries written so far are kept: run the same command again to encode the rest"
    )
    from qie.stages import precompute

    summary = precompute.run(small_config("precompute", *args), tmp_path / "r1")
    assert all(s.new + s.skipped == 160 and s.failed == 0 for s in summary.types.values())
    assert 0 < summary.types["pixel_latent"].skipped < 160  # what was written before the signal is kept


def test_a_second_signal_during_the_stop_save_removes_it_and_names_the_checkpoints_kept(
    cached_data: CachedData, tmp_path: Path, monkeypatch
) -> None:
    run = tmp_path / "run"
    write_state = ckpt.write_state

    def first_signal(info) -> None:
        if info.step == 2:
            os.kill(os.getpid(), signal.SIGINT)

    def second_signal_while_saving(folder: Path, state: dict) -> None:
        if state["step"] == 3:  # the stop save: the run stops after step 3 (see test_trust3)
            os.kill(os.getpid(), signal.SIGINT)
        write_state(folder, state)

    monkeypatch.setattr(ckpt, "write_state", second_signal_while_saving)
    cfg = small_config("train", *cached_data.overrides, "train.max_steps=6", "train.checkpoint_every=1")
    before = signal.getsignal(signal.SIGINT)  # the test process's own (a test worker may ignore SIGINT)
    try:
        train_stage.run(cfg, run, on_step_end=first_signal)
        raised = None
    except BaseException as e:  # noqa: BLE001 - a bare KeyboardInterrupt is what the missing fix raises
        raised = e
    assert isinstance(raised, Interrupted) and raised.signum == signal.SIGINT, repr(raised)
    assert str(raised) == (
        f"a second signal stopped training without its stop save; 2 checkpoint(s) saved before it are kept in "
        f"{run / 'checkpoints'}, the last step-000002: continue with train.resume=latest hydra.run.dir={run}"
    )
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-000001", "step-000002"]  # no .tmp
    assert signal.getsignal(signal.SIGINT) is before  # the stop handler is gone, the one before it back

    from qie import train as train_entry

    def stopped(checked, run_dir):
        raise Interrupted(str(raised), signal.SIGTERM)

    monkeypatch.setattr(train_stage, "start", stopped)
    monkeypatch.setattr(sys, "argv", ["qie.train", *cached_data.overrides, f"hydra.run.dir={tmp_path / 'cli'}"])
    assert exit_code(train_entry.main) == 143  # 128 + SIGTERM, the second signal's


def test_the_message_names_the_checkpoint_resumed_from_or_that_none_is_kept(tmp_path: Path) -> None:
    assert ckpt.kept_after_interrupt(tmp_path, None) == (
        "a second signal stopped training before any checkpoint was saved: nothing to resume from"
    )
    earlier = tmp_path / "old" / "checkpoints" / "step-000004"
    assert ckpt.kept_after_interrupt(tmp_path / "new", earlier) == (
        "a second signal stopped training without its stop save; this run saved no checkpoint; the one it resumed "
        f"from is kept: {earlier}: continue with train.resume={earlier}"
    )


# --- 9: other tracebacks -----------------------------------------------------------------------------------------


def test_a_search_whose_every_trial_fails_ends_in_one_line_with_its_summary(
    cached_data: CachedData, tmp_path: Path, monkeypatch, capsys
) -> None:
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
    import json

    from qie import train as train_entry

    sweep, missing = tmp_path / "search", tmp_path / "missing"
    argv = [
        "qie.train",
        "-m",
        "hydra/sweeper=optuna",
        "hydra.sweeper.n_trials=2",
        "hydra.sweeper.sampler.seed=1",
        "train.learning_rate=tag(log,interval(1e-4,1e-2))",
        "validation.heldout_samples=2",
        f"data.path={missing}",
        f"hydra.sweep.dir={sweep}",
    ]
    monkeypatch.setattr(sys, "argv", argv)
    with optuna_logs_through_root():
        assert exit_code(train_entry.main) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and "No trials are completed yet" not in err
    errors = [line for line in err.splitlines() if line.startswith("qie: error:")]
    assert errors == [
        "qie: error: no trial of the search finished (each one's error is listed below): fix it and search again; "
        "no best parameters were chosen"
    ]
    assert f"qie: sweep {sweep}: 2 of 2 job(s) failed" in err
    summary = json.loads((sweep / "sweep_summary.json").read_text())
    assert summary["failed"] == ["0", "1"] and summary["best"] is None
    assert all(j["error"].startswith(f"data.path '{missing}' does not exist") for j in summary["jobs"])
    assert not (sweep / "optimization_results.yaml").exists()


def test_the_search_sweeper_plugin_is_packaged(monkeypatch) -> None:
    from setuptools import distutils  # setuptools' own distutils, whose run_setup builds its Distribution

    root = Path(__file__).resolve().parents[1]
    monkeypatch.chdir(root)
    packages = distutils.core.run_setup(str(root / "setup.py"), stop_after="config").packages
    assert "hydra_plugins.qie_search" in packages


# --- 9, 11, 12 and the demo's counts: odd values refused at compose time ----------------------------------------

TEACHER_DEFAULT = "the teacher's 50 (train.objective.teacher_steps unset: model.num_inference_steps)"
DISTILL_FIX = "lower train.objective.student_steps or raise train.objective.teacher_steps"
REFUSED = [
    ("demo", ["demo.image_size=-64"], "demo.image_size=-64 is out of range: it must be at least 16"),
    ("demo", ["demo.train_samples=0"], "demo.train_samples=0 is out of range: it must be at least 1"),
    ("demo", ["demo.heldout_samples=0"], "demo.heldout_samples=0 is out of range: it must be at least 1"),
    (
        "train",
        ["train/objective=distill", "train.objective.student_steps=8", "train.objective.teacher_steps=4"],
        "train.objective.student_steps=8 is above train.objective.teacher_steps=4: the student learns to sample in "
        f"fewer steps than its teacher; {DISTILL_FIX}",
    ),
    (
        "precompute",
        ["train/objective=distill", "train.objective.student_steps=51", "precompute.teachers=true"],
        f"train.objective.student_steps=51 is above {TEACHER_DEFAULT}: the student learns to sample in fewer steps "
        f"than its teacher; {DISTILL_FIX}",
    ),
    (
        "train",
        ["train/objective=dpo", "train.objective.sft_weight=inf"],
        "train.objective.sft_weight=inf is out of range: give a value from 0 to 100",
    ),
    (
        "train",
        ["train/objective=dpo", "train.objective.beta=1e38"],
        "train.objective.beta=1e+38 is out of range: give a value above 0 and at most 1e+06 (e.g. 2000)",
    ),
]


@pytest.mark.parametrize(("stage", "overrides", "message"), REFUSED)
def test_an_odd_value_is_refused_at_compose_time_naming_its_key(stage: str, overrides: list, message: str) -> None:
    from qie.checks import compose
    from qie.errors import ConfigError

    with pytest.raises(ConfigError) as refused:
        compose(stage, overrides)
    assert str(refused.value) == message


@pytest.mark.parametrize("scale", ["nan", "1e30", "-inf", "100.5"])
def test_a_fused_lora_scale_out_of_range_is_refused_at_compose_time(scale: str, tmp_path: Path) -> None:
    from qie.checks import compose
    from qie.errors import ConfigError

    lora = tmp_path / "lora.safetensors"
    lora.write_bytes(b"")  # its contents are read when the model loads, not when the config is composed
    overrides = [f"model.fuse_loras=[{lora}]", f"model.fuse_lora_scales=[{scale}]"]
    with pytest.raises(ConfigError) as refused:
        compose("infer", overrides)
    assert str(refused.value) == (
        f"model.fuse_lora_scales[0]={float(scale)} is out of range: give a scale from -100 to 100 (1.0: the LoRA as "
        "trained; below 0 subtracts it)"
    )


def test_the_edges_of_the_ranges_are_taken(tmp_path: Path) -> None:
    from qie.checks import compose

    lora = tmp_path / "lora.safetensors"
    lora.write_bytes(b"")
    compose("infer", [f"model.fuse_loras=[{lora},{lora}]", "model.fuse_lora_scales=[-100,100]"])
    compose("train", ["train/objective=dpo", "train.objective.beta=1e6", "train.objective.sft_weight=100"])
    compose("train", ["train/objective=distill", "train.objective.student_steps=4", "train.objective.teacher_steps=4"])
    compose("demo", ["demo.image_size=16", "demo.train_samples=1", "demo.heldout_samples=1"])
