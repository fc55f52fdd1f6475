"""Training you can trust, second round: a NaN reaching the weights through the optimizer is never saved nor
called good; a failed checkpoint write stops in one line and keeps what was saved; one writer per run folder;
a resume under another model or data set is refused; a damaged trainer_state.json is named."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import safetensors.torch
import torch
from helpers import cached_set, held_run_lock
from safetensors import SafetensorError

from qie.checks import compose
from qie.errors import ConfigError, ModelLoadError, StorageError
from qie.runtime.guards import NonFiniteLoss
from qie.stages import train as train_stage
from qie.training import checkpoint as ckpt

FAST = ["train.learning_rate=1e-3", "logging.report_to=none", "train.seed=3"]


@pytest.fixture(scope="module")
def data(tiny_path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    return cached_set(tiny_path, tmp_path_factory.mktemp("trust2_data"), train=6)


def train(data: dict, overrides: list[str], run_dir: Path) -> dict:
    return train_stage.run(compose("train", data["base"] + FAST + overrides), run_dir)


def finite_files(folder: Path) -> bool:
    """Every tensor of every safetensors file of a checkpoint is finite."""
    files = list(folder.rglob("*.safetensors"))
    return bool(files) and all(
        bool(torch.isfinite(t).all())
        for f in files
        for t in safetensors.torch.load_file(str(f)).values()
        if t.is_floating_point()
    )


def test_a_nan_optimizer_state_is_refused_at_resume_and_never_saved(data: dict, tmp_path: Path, monkeypatch) -> None:
    run = tmp_path / "run"
    train(data, ["train.max_steps=2", "train.checkpoint_every=2"], run)
    good = run / "checkpoints" / "step-000002"
    assert finite_files(good)
    # A checkpoint whose optimizer state holds NaN: the weights it would write are refused at resume.
    bad = tmp_path / "bad"
    shutil.copytree(good, bad)
    tensors = safetensors.torch.load_file(str(bad / "state" / "optimizer.safetensors"))
    moment = max(tensors, key=lambda k: tensors[k].numel())  # an exp_avg (the first are step counts)
    tensors[moment].view(-1)[0] = float("nan")
    safetensors.torch.save_file(tensors, str(bad / "state" / "optimizer.safetensors"))
    with pytest.raises(ModelLoadError, match=f"checkpoint {bad} holds NaN or infinite trained weights or optimizer"):
        train(data, ["train.max_steps=4", f"train.resume={bad}"], tmp_path / "from_bad")

    # Mid-run, after step 3 the optimizer's moments turn NaN: step 4's loss is finite, its update is not.
    built = {}
    original = train_stage.build_train_state

    def capture(*args, **kwargs):
        built["state"] = original(*args, **kwargs)
        return built["state"]

    def poison(info) -> None:
        if info.step == 3:
            for entry in built["state"][0].optimizer.state.values():
                entry["exp_avg"].fill_(float("nan"))

    monkeypatch.setattr(train_stage, "build_train_state", capture)
    for name, extra in (("logged", []), ("saved", ["logging.log_every=100"]), ("skip", ["train.on_nonfinite=skip"])):
        run = tmp_path / name
        cfg = compose("train", data["base"] + FAST + ["train.max_steps=6", "train.checkpoint_every=2", *extra])
        with pytest.raises(NonFiniteLoss) as info:
            train_stage.run(cfg, run, on_step_end=poison)
        assert str(info.value).startswith("step 4 left NaN or infinite values in the trained weights")
        assert f"the last good state is saved in {run / 'checkpoints' / 'step-000002'}" in str(info.value)
        assert [p.name for p in (run / "checkpoints").iterdir()] == ["step-000002"], name
        assert finite_files(run / "checkpoints" / "step-000002")
    # Between the state checks (every STATE_CHECK_EVERY steps, the last step, every save) the NaN state is caught
    # by the next step's loss: step 5 stops the run, and the state, checked once before the save on the way out,
    # is not saved.
    from qie.training import policies

    checks: list[int] = []
    real_check = policies.state_is_finite
    monkeypatch.setattr(policies, "state_is_finite", lambda *a: checks.append(1) or real_check(*a))
    unsaved = tmp_path / "unsaved"
    cfg = compose("train", data["base"] + FAST + ["train.max_steps=6", "train.checkpoint_every=0"])
    with pytest.raises(NonFiniteLoss, match="^step 5 gave a NaN or infinite loss or gradient"):
        train_stage.run(cfg, unsaved, on_step_end=poison)
    assert len(checks) == 1 and not list(unsaved.glob("checkpoints/step-*"))
    checks.clear()
    train(data, ["train.max_steps=3", "train.checkpoint_every=0"], tmp_path / "checked_once")
    assert len(checks) == 2  # logged every step (log_every=1); the state checked at the last step and its save
    # The state it points to resumes.
    monkeypatch.undo()
    result = train(data, ["train.max_steps=3", f"train.resume={run / 'checkpoints' / 'step-000002'}"], tmp_path / "r")
    assert result["step"] == 3 and all(torch.isfinite(torch.tensor(result["losses"])))


@pytest.mark.parametrize("where", ["none", "weight", "moment", "step", "bf16 weight"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_the_state_check_finds_any_nonfinite_element_and_only_those(where: str, bad: float) -> None:
    from qie.runtime.guards import local_state_finite

    params = [torch.nn.Parameter(torch.full((16, 48), 3e38)), torch.nn.Parameter(torch.ones(48, 16))]
    params.append(torch.nn.Parameter(torch.ones(4, 4, dtype=torch.bfloat16)))
    params.append(torch.nn.Parameter(torch.ones(0)))  # an empty tensor is finite (and has no largest value)
    optimizer = torch.optim.AdamW(params[:2])
    for p in params[:2]:
        p.grad = torch.ones_like(p)
    optimizer.step()
    state = optimizer.state[params[1]]
    target = {"none": None, "weight": params[1].data, "moment": state["exp_avg_sq"], "step": state["step"],
              "bf16 weight": params[2].data}[where]  # fmt: skip
    if target is not None:
        target.view(-1)[-1] = bad
    # 3e38 is finite, though a sum over such values would overflow
    assert local_state_finite(params, optimizer) is (where == "none")


def test_a_failed_checkpoint_write_stops_in_one_line_keeping_earlier_ones(
    data: dict, tmp_path: Path, monkeypatch
) -> None:
    run = tmp_path / "run"
    real = safetensors.torch.save_file
    calls = {"n": 0}

    def full_disk(tensors, filename, *args, **kwargs):
        if "step-000004" in filename:
            calls["n"] += 1
            real(tensors, filename, *args, **kwargs)  # half written, then the disk fills
            raise SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "
                                  '"No space left on device" })')  # fmt: skip
        return real(tensors, filename, *args, **kwargs)

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    with pytest.raises(StorageError) as info:
        train(data, ["train.max_steps=6", "train.checkpoint_every=2"], run)
    message = str(info.value)
    assert message.startswith(f"cannot write checkpoint {run / 'checkpoints' / 'step-000004'} (the disk is full)")
    assert "the earlier checkpoints are kept" in message and "\n" not in message and calls["n"] == 1
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-000002"]  # no .step-000004.tmp
    monkeypatch.undo()
    # Permission denied reads the same way; the earlier checkpoint still resumes.
    error = ckpt.save_error(PermissionError(13, "Permission denied", "x"), run / "checkpoints" / "step-000006")
    assert "(permission denied): make the run folder writable" in str(error)
    result = train(data, ["train.max_steps=4", "train.checkpoint_every=2", "train.resume=latest"], run)
    assert result["step"] == 4 and sorted(p.name for p in (run / "checkpoints").iterdir()) == [
        "step-000002",
        "step-000004",
    ]


def test_a_full_disk_ends_the_cli_in_one_line_within_the_timeout(data: dict, tmp_path: Path) -> None:
    """A real write error from the kernel (a file-size limit, EFBIG) in `python -m qie.train`."""
    run = tmp_path / "run"
    train(data, ["train.max_steps=2", "train.checkpoint_every=2"], run)
    limit = 120_000  # the optimizer state file of the tiny LoRA is ~170 kB; metrics and JSON stay below
    code = textwrap.dedent(f"""
        import resource, runpy, sys
        resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))
        sys.argv = ["qie.train", *sys.argv[1:]]
        runpy.run_module("qie.train", run_name="__main__")
    """)
    args = [*data["base"], *FAST, "train.max_steps=4", "train.checkpoint_every=1", "train.resume=latest",
            f"hydra.run.dir={run}"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith(f"qie: error: cannot write checkpoint {run / 'checkpoints' / 'step-000003'}")
    assert "Traceback" not in proc.stderr
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-000002"]
    assert finite_files(run / "checkpoints" / "step-000002")
    assert ckpt.read_state(run / "checkpoints" / "step-000002")["step"] == 2


def test_a_second_process_on_the_run_folder_is_refused_naming_it(data: dict, tmp_path: Path) -> None:
    run = tmp_path / "run"
    with held_run_lock(run) as holder:
        with pytest.raises(StorageError, match=rf"run folder '{run}' is in use by another training or inference \(pid "
                           rf"{holder.pid} on .*, started 20\d\d-.*give this run its own hydra.run.dir"):  # fmt: skip
            train(data, ["train.max_steps=2"], run)
        assert sorted(p.name for p in run.iterdir()) == [".qie-run.lock"]  # nothing written
    result = train(data, ["train.max_steps=2"], run)
    assert result["step"] == 2
    # A process takes its own folder again (the entry point, then the stage), and gives it back.
    train(data, ["train.max_steps=1"], run)


def test_resume_refuses_another_model_or_data_set_unless_inexact(data: dict, tiny_plus_path: Path, tmp_path) -> None:
    run = tmp_path / "run"
    train(data, ["train.max_steps=2", "train.checkpoint_every=2"], run)
    saved = ckpt.read_state(run / "checkpoints" / "step-000002")
    assert saved["data"]["samples"] == 6 and saved["model"]["lora"]["rank"] == 16
    assert saved["model"]["name"] == "tiny" and len(saved["model"]["transformer"]) == 16
    fewer = data["root"] / "fewer.jsonl"
    folder = data["root"] / "train" / "training_images"
    stems = sorted(p.stem for p in folder.glob("*.txt"))[:3]
    rows = [{"target": f"train/training_images/{s}.png", "controls": [f"train/control_images/{s}.png"],
             "prompt": (folder / f"{s}.txt").read_text().strip()} for s in stems]  # fmt: skip
    fewer.write_text("".join(json.dumps(r) + "\n" for r in rows))
    latest = ["train.max_steps=3", "train.resume=latest"]
    cases = {
        "data.samples: 6 -> 3": [f"data.path={fewer}"],
        "model.lora: ": ["train.lora.rank=8"],
        "model.name: 'tiny' -> 'tiny_plus'": [
            "model=tiny_plus",
            f"model.pretrained_model_name_or_path={tiny_plus_path}",
        ],
    }
    for expected, overrides in cases.items():
        with pytest.raises(ConfigError) as info:
            train(data, latest + overrides, run)
        message = str(info.value)
        assert message.startswith(f"checkpoint {run / 'checkpoints' / 'step-000002'} was trained on another model")
        assert expected in message and "train.resume_inexact=true" in message and "\n" not in message
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-000002"]  # nothing written
    result = train(data, latest + [f"data.path={fewer}", "train.resume_inexact=true"], run)
    assert result["step"] == 3


@pytest.mark.parametrize(
    "content, why",
    [
        ('{"step": 1e400, "batches_consumed": 2}', "step is inf"),
        ('{"step": 2, "batches_consumed": -1}', "batches_consumed is -1"),
        ('{"step": 2', "JSONDecodeError"),
        ("[2, 2]", "not a JSON object"),
        (b"\xff\xfe{", "UnicodeDecodeError"),
    ],
)
def test_a_malformed_trainer_state_is_named_in_one_line(tmp_path: Path, content, why: str) -> None:
    folder = tmp_path / "step-000002"
    folder.mkdir()
    path = folder / "trainer_state.json"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(ModelLoadError) as info:
        ckpt.read_state(folder)
    assert str(info.value).startswith(f"checkpoint state {path} is damaged (") and why in str(info.value)
    assert "\n" not in str(info.value)
