# ruff: noqa: F811 - the tests take the imported fixtures `s3` and `url` as arguments
"""`python -m qie.train` as a user runs it: a cache miss, SIGTERM then resume, two processes (gloo), two nodes
training from a bucket."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest
from helpers import CachedData
from test_cache_remote import remote, s3, url  # noqa: F401 - fixtures, used as arguments

from qie.checks import compose
from qie.stages import train as train_stage

pytestmark = pytest.mark.subprocess


@pytest.fixture(scope="module")
def data(tiny_path: Path, cached_data: CachedData) -> dict:
    """The CLI's arguments for the shared cached data set (the model named by its folder)."""
    model = f"model.pretrained_model_name_or_path={tiny_path}"
    return {"root": cached_data.root, "base": [model, *cached_data.overrides, "logging.report_to=none"]}


# The short multi-process runs: 3 steps, a checkpoint at step 2 (and at the end).
SHORT = ["train.max_steps=3", "train.learning_rate=1e-3", "train.checkpoint_every=2"]


@pytest.fixture(scope="module")
def one_node(data: dict, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run folder of one torchrun of two processes on one node (SHORT). Tests read it, never write it."""
    tmp = tmp_path_factory.mktemp("one_node")
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m"]
    with qie_train(data["base"] + SHORT + [f"hydra.run.dir={tmp / 'run'}"], tmp / "logs", launcher=launcher) as proc:
        proc.wait(timeout=300)
    assert proc.returncode == 0, output(tmp / "logs")[1][-3000:]
    return tmp / "run"


def env() -> dict[str, str]:
    # One thread per process: two processes share this machine's cores.
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


@contextmanager
def qie_train(args: list[str], logs: Path, launcher: list[str] | None = None,
              module: str = "qie.train") -> Iterator[subprocess.Popen]:  # fmt: skip
    """Start `python -m qie.train ARGS` (or `module`; or under `launcher`), output to files; kill what is left at
    exit."""
    launcher = launcher or [sys.executable, "-m"]
    logs.mkdir(parents=True, exist_ok=True)
    with open(logs / "stdout", "w") as out, open(logs / "stderr", "w") as err:
        proc = subprocess.Popen([*launcher, module, *args], env=env(), stdout=out, stderr=err)
        try:
            yield proc
        finally:
            if proc.poll() is None:  # a failed test: end it and everything it started (torchrun's workers
                # run in sessions of their own, so its process group would not reach them)
                for child in psutil.Process(proc.pid).children(recursive=True):
                    child.kill()
                proc.kill()
                proc.wait()


def output(logs: Path) -> tuple[str, str]:
    return (logs / "stdout").read_text(), (logs / "stderr").read_text()


def test_a_cache_miss_stops_with_the_sample_and_the_precompute_command(data: dict, tmp_path: Path) -> None:
    empty = f"cache.dir={tmp_path / 'empty'}"
    with qie_train(data["base"] + [empty, f"hydra.run.dir={tmp_path / 'run'}"], tmp_path / "logs") as proc:
        proc.wait(timeout=120)
    out, err = output(tmp_path / "logs")
    assert proc.returncode == 2, err
    assert err.startswith("qie: error: 8 of 8 samples have missing or damaged cache entries")
    assert "the first is '00000'" in err and not (tmp_path / "empty").exists()
    assert f"python -m qie.precompute {data['base'][0]} data.path=" in err and empty in err
    assert "Traceback" not in err


def test_sigterm_saves_a_checkpoint_that_resume_latest_continues(data: dict, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = ["train.max_steps=100000", "train.checkpoint_every=100000", "data.num_workers=1"]
    metrics, logs = run_dir / "metrics.jsonl", tmp_path / "logs"
    with qie_train(data["base"] + args + [f"hydra.run.dir={run_dir}"], logs) as proc:
        deadline = time.monotonic() + 120
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
            assert proc.poll() is None, output(logs)[1]
            assert time.monotonic() < deadline, "no training step within 120 s"
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)  # to the main process only, as `kill PID` does
        proc.wait(timeout=120)
    out, err = output(logs)
    assert proc.returncode == 143, err  # 128 + SIGTERM, with the state saved
    assert "stopped by signal 15 at step" in out
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    saved = sorted((run_dir / "checkpoints").iterdir())
    assert [p.name for p in saved] == [f"step-{steps[-1]:06d}"]

    stopped = steps[-1]
    cfg = compose("train", data["base"] + ["train.resume=latest", f"train.max_steps={stopped + 2}"])
    result = train_stage.run(cfg, run_dir)
    assert result["step"] == stopped + 2 and len(result["losses"]) == 2
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert steps == list(range(1, stopped + 3))


def test_two_processes_keep_the_lora_identical(one_node: Path) -> None:
    result = json.loads((one_node / "train_result.json").read_text())
    checksums = result["param_checksums"]  # gathered from every process after the last step
    assert len(checksums) == 2 and checksums[0] == checksums[1] and result["ranks_agree"]
    assert (one_node / "checkpoints" / "step-000003" / "state" / "rng_state_1.safetensors").is_file()


@pytest.mark.slow  # two processes of the plain LoRA run in CI, distillation in one in the family battery
def test_distillation_on_two_processes_keeps_the_lora_identical(data: dict, tmp_path: Path) -> None:
    """`train/objective=distill` under torchrun: two precompute processes fill the teacher outputs of 7 of the 8
    samples (shares of 4 and 3: each process runs the teacher apart), then training, where the student runs the
    model several times before one backward pass (each step's prediction recomputed in it), which data-parallel
    training must reduce once; each process fills the missing teacher outputs of its own samples (lazy)."""
    import shutil

    cache = tmp_path / "cache"
    shutil.copytree(Path(data["root"]) / "cache", cache)
    distill = ["train/objective=distill", "train.objective.student_steps=2", "train.objective.teacher_steps=2",
               "train.objective.teacher_cfg=4", "train.objective.seeds=2", f"cache.dir={cache}"]  # fmt: skip
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m"]
    base = [a for a in data["base"] if not a.startswith("cache.dir=")]  # the copy's, where teachers are written
    fill = [*base, *distill, "precompute.teachers=true", "precompute.end=7", f"hydra.run.dir={tmp_path / 'pre'}"]
    with qie_train(fill, tmp_path / "pre_logs", launcher=launcher, module="qie.precompute") as proc:
        proc.wait(timeout=300)
    assert proc.returncode == 0, output(tmp_path / "pre_logs")[1][-3000:]
    summary = json.loads((tmp_path / "pre" / "precompute_summary.json").read_text())
    assert summary["types"]["teacher_latent"]["new"] == 7 * 2 == len(list((cache / "teacher_latent").rglob("*.s*")))
    assert sorted(p["samples"] for p in summary["processes"]) == [3, 4]
    args = [*base, *SHORT, *distill, "cache.mode=lazy", f"hydra.run.dir={tmp_path / 'run'}"]
    with qie_train(args, tmp_path / "logs", launcher=launcher) as proc:
        proc.wait(timeout=300)
    assert proc.returncode == 0, output(tmp_path / "logs")[1][-3000:]
    result = json.loads((tmp_path / "run" / "train_result.json").read_text())
    checksums = result["param_checksums"]
    assert len(checksums) == 2 and checksums[0] == checksums[1] and result["ranks_agree"]
    assert len(result["losses"]) == 3 and all(0 < loss < 1 for loss in result["losses"])
    assert list((cache / "teacher_latent").rglob("*.safetensors"))  # written by the processes as they went


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_nodes(args: list[str], logs: Path, node_env: dict[str, str] | None = None) -> list[subprocess.Popen]:
    """Two torchrun node agents on this machine, one process each, meeting at a c10d rendezvous on 127.0.0.1
    (as two machines would, with the run folder on shared storage). `node_env`: variables set to
    `VALUE/node<N>` for node N (a folder of each node's own, as each machine has its own disk)."""
    port = _free_port()
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
                "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", f"qie{port}",
                "--max_restarts", "0", "-m"]  # fmt: skip
    procs = []
    for node in range(2):
        (logs / str(node)).mkdir(parents=True, exist_ok=True)
        own = {k: f"{v}/node{node}" for k, v in (node_env or {}).items()}
        with open(logs / str(node) / "stdout", "w") as out, open(logs / str(node) / "stderr", "w") as err:
            procs.append(subprocess.Popen([*launcher, "qie.train", *args], env={**env(), **own}, stdout=out,
                                          stderr=err))  # fmt: skip
    return procs


def _wait_all(procs: list[subprocess.Popen], logs: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    try:
        for node, proc in enumerate(procs):
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            assert proc.returncode == 0, (logs / str(node) / "stderr").read_text()[-3000:]
    finally:
        for proc in procs:
            if proc.poll() is None:
                for child in psutil.Process(proc.pid).children(recursive=True):
                    child.kill()
                proc.kill()
                proc.wait()


@pytest.mark.slow  # two torchrun node agents: a minute; two processes on one node run in CI
def test_two_nodes_training_from_a_bucket_give_the_losses_of_one_node_on_ssd_and_resume_exactly(
    data: dict, one_node: Path, s3: str, url: str, cached_data: CachedData, tmp_path: Path
) -> None:
    """Two node agents train from the cache in a bucket of an S3 server on 127.0.0.1 (`cache=remote`), each node
    with its own cache folder and node-local copy: the losses of two processes on one node reading the ssd cache,
    and a resume on the bucket goes on exactly."""
    from qie.cache.ssd import SsdBackend
    from qie.cache.sync import sync

    sync(SsdBackend(cached_data.cache), remote(url, s3, tmp_path / "upload"))
    model_and_data = [a for a in data["base"] if not a.startswith("cache.dir=")]
    bucket = [*model_and_data, "cache=remote", f"cache.backend.url={url}", f"cache.backend.endpoint_url={s3}",
              "cache.dir=${oc.env:QIE_NODE}/dir", "cache.backend.local_dir=${oc.env:QIE_NODE}/copy",
              *SHORT]  # fmt: skip
    nodes = {"QIE_NODE": str(tmp_path / "nodes")}
    _wait_all(_two_nodes([*bucket, f"hydra.run.dir={tmp_path / 'two'}"], tmp_path / "two_logs", nodes),
              tmp_path / "two_logs", 300)  # fmt: skip
    one = json.loads((one_node / "train_result.json").read_text())
    two = json.loads((tmp_path / "two" / "train_result.json").read_text())
    assert len(two["param_checksums"]) == 2 and two["ranks_agree"]
    assert two["losses"] == pytest.approx(one["losses"], rel=0, abs=1e-6)
    for node in ("node0", "node1"):  # each node read the bucket through a copy of its own
        assert any((tmp_path / "nodes" / node / "copy").rglob("*.safetensors")), node

    resume = [f"train.resume={tmp_path / 'two' / 'checkpoints' / 'step-000002'}", f"hydra.run.dir={tmp_path / 'r'}"]
    _wait_all(_two_nodes([*bucket, *resume], tmp_path / "r_logs", nodes), tmp_path / "r_logs", 300)
    resumed = json.loads((tmp_path / "r" / "train_result.json").read_text())
    assert resumed["step"] == 3 and resumed["losses"] == pytest.approx(two["losses"][2:], rel=0, abs=1e-6)
    flat = [x for row in resumed["param_checksums"] for x in row]
    assert flat == pytest.approx([x for row in two["param_checksums"] for x in row], rel=1e-6)
