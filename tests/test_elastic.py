# ruff: noqa: F811 - the tests take the imported fixtures `s3` and `url` as arguments
"""Elastic restarts: two CPU processes under `torchrun --max-restarts=1` write their checkpoints to a bucket of a
real S3 server on 127.0.0.1 (moto's, in this process); one worker dies right after a checkpoint is stored, torchrun
starts both again, and the job resumes from the bucket and ends with the losses of an uninterrupted run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from test_cache_remote import s3, url  # noqa: F401 - fixtures, used as arguments

pytestmark = pytest.mark.subprocess

STEPS = [
    "train.max_steps=4",
    "train.checkpoint_every=2",
    "train.learning_rate=1e-3",
    "data.batch_size=2",
    "data.num_workers=0",
    "logging.report_to=none",
    "train.resume=latest",
]

# `python -m qie.train` whose process of rank 1 exits hard once the checkpoint of step QIE_TEST_DIE_AFTER is stored,
# in torchrun's first attempt only.
DIE_AFTER_STORING = """
import os, runpy
from qie.stages import run_outputs

saving = run_outputs.RunOutputs.saving
first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0" and os.environ.get("RANK") == "1"


def dying(self, save, accelerator, run_dir, keep):
    stored = saving(self, save, accelerator, run_dir, keep)

    def save_then_die(step, consumed):
        folder = stored(step, consumed)
        if first_attempt and step == int(os.environ["QIE_TEST_DIE_AFTER"]):
            os._exit(1)
        return folder

    return save_then_die


run_outputs.RunOutputs.saving = dying
runpy.run_module("qie.train", run_name="__main__")
"""


def torchrun(target: list[str], args: list[str], log: Path, restarts: int = 0) -> tuple[int, str]:
    """Two processes under torchrun; returns (exit status, output). Output goes to the file `log` (a pipe that
    torchrun's workers inherit would outlive it); what is left after the timeout is killed."""
    launcher = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        f"--max-restarts={restarts}",
    ]
    # Each attempt's processes meet in a store of their own: in the rendezvous' shared store a restarted process
    # may read its peer's address from the attempt before and wait for it forever (pytorch#135712).
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "QIE_TEST_DIE_AFTER": "2",
        "PYTHONUNBUFFERED": "1",
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
    }
    with open(log, "w") as out:
        proc = subprocess.Popen([*launcher, *target, *args], env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            proc.wait(timeout=300)
        except subprocess.TimeoutExpired:
            for child in psutil.Process(proc.pid).children(recursive=True):  # torchrun's workers too
                child.kill()
            proc.kill()
            proc.wait()
            pytest.fail(f"torchrun did not end in 300 s: {log.read_text()[-3000:]}")
    return proc.returncode, log.read_text()


def losses(metrics: str) -> dict[int, float]:
    return {line["step"]: line["loss"] for line in map(json.loads, metrics.splitlines())}


@pytest.mark.slow  # a torchrun restart after a kill: minutes on CPU
def test_a_worker_killed_mid_run_resumes_from_the_bucket_with_the_uninterrupted_losses(
    s3: str, url: str, tiny_path: Path, cached_data, tmp_path: Path
) -> None:
    from qie.training.run_store import RunStore

    base = [f"model.pretrained_model_name_or_path={tiny_path}", *cached_data.overrides, *STEPS]
    status, out = torchrun(["-m", "qie.train"], [*base, f"hydra.run.dir={tmp_path / 'whole'}"], tmp_path / "whole.log")
    assert status == 0, out[-3000:]
    script = tmp_path / "die_after_storing.py"
    script.write_text(DIE_AFTER_STORING)
    on_bucket = [f"run.output_url={url}", f"run.endpoint_url={s3}", f"hydra.run.dir={tmp_path / 'node'}"]
    status, out = torchrun([str(script)], [*base, *on_bucket], tmp_path / "node.log", restarts=1)
    assert status == 0, out[-3000:]
    assert "no checkpoint in " + url + "/checkpoints, starting from step 0" in out  # the first attempt
    assert "exitcode: 1) local_rank: 1" in out  # the worker that died
    assert f"{url}/checkpoints/step-000002 copied to" in out  # the restart, from the bucket
    store = RunStore(url, s3, retries=2, backoff=0.01)
    assert store.checkpoints() == ["step-000002", "step-000004"]
    expected = losses((tmp_path / "whole" / "metrics.jsonl").read_text())
    assert sorted(expected) == [1, 2, 3, 4]
    assert losses(store.store.read("metrics.jsonl").decode()) == expected
    assert losses((tmp_path / "node" / "metrics.jsonl").read_text()) == expected
    result = json.loads(store.store.read("train_result.json"))
    assert result["ranks_agree"] and result["losses"] == [expected[3], expected[4]]
