# ruff: noqa: F811 - the tests take the imported fixtures `s3` and `url` as arguments
"""One writer per `run.output_url` (a lease in the store, as the remote cache's claims), checkpoints whose files and
marker belong to one run (its id in the marker and the trainer state, each file's digest checked on resume), and
the store opened and checked before the model loads: each refusal in one line, nothing written into the store,
nothing in it overwritten. A real S3 server on 127.0.0.1 (moto's, `tests/test_cache_remote.py`)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from test_cache_remote import BUCKET, free_port, s3, url  # noqa: F401 - fixtures, used as arguments
from test_run_store import STEPS, store_of

from qie.errors import StorageError


def train(base: list[str], run_dir: Path, *overrides: str) -> dict:
    from qie.checks import compose
    from qie.stages import train as train_stage

    return train_stage.run(compose("train", [*base, *STEPS, *overrides]), run_dir)


@pytest.fixture
def base(tiny_path: Path, cached_data) -> list[str]:
    return [f"model.pretrained_model_name_or_path={tiny_path}", *cached_data.overrides]


def on_bucket(url: str, s3: str, *more: str) -> list[str]:
    return [f"run.output_url={url}", f"run.endpoint_url={s3}", *more]


def objects(url: str, s3: str) -> dict[str, bytes]:
    store = store_of(url, s3).store
    return {name: store.read(name) for name in store.listing("")}


@pytest.fixture(scope="module")
def trained(s3: str, tiny_path: Path, cached_data, tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    """The objects of a store a one-step run wrote (its checkpoint step-000001), trained once for the module."""
    first = f"s3://{BUCKET}/trained-once-{uuid.uuid4().hex[:8]}"
    base = [f"model.pretrained_model_name_or_path={tiny_path}", *cached_data.overrides]
    train(base, tmp_path_factory.mktemp("trained"), *on_bucket(first, s3), "train.max_steps=1")
    return objects(first, s3)


def stored(url: str, s3: str, objects: dict[str, bytes]):
    """A store at `url` holding `objects`."""
    store = store_of(url, s3).store
    for name, data in objects.items():
        store.write(name, data)
    return store


def test_a_second_writer_is_refused_in_one_line_and_writes_nothing(
    s3: str, url: str, base: list[str], tmp_path: Path
) -> None:
    """The probe's two writers: both printed "stored" and the store ended with one run's bytes under the other's
    markers. Now the second is refused before it loads anything, naming the first, and the store is unchanged."""
    first = store_of(url, s3)
    first.claim(resuming=False)  # a run writing this URL, alive in this process
    try:
        before = objects(url, s3)
        run = tmp_path / "second"
        with pytest.raises(StorageError) as info:
            train(base, run, *on_bucket(url, s3), "train.max_steps=1")
        message = str(info.value)
        assert message.startswith(f"run.output_url={url} is being written by process ")
        assert f"(run {first.run_id}) until " in message and "one run writes an output URL at a time" in message
        assert objects(url, s3) == before  # the lease untouched, nothing added
        assert not (run / "run_info.json").exists() and not (run / "checkpoints").exists()
    finally:
        first.release()
    # Released: the next run takes the store, trains and stores its checkpoint with its id.
    train(base, tmp_path / "third", *on_bucket(url, s3), "train.max_steps=1")
    marker = json.loads(store_of(url, s3).store.read("checkpoints/step-000001/.complete"))
    state = json.loads(store_of(url, s3).store.read("checkpoints/step-000001/trainer_state.json"))
    assert marker["run"] == state["run"] and len(marker["run"]) == 16
    assert "trainer_state.json" in marker["files"] and "state/model.safetensors" in marker["files"]
    assert ".claims/run/writer.lease" not in store_of(url, s3).store.listing("")  # released at the end


def test_the_lease_of_a_process_that_died_on_this_machine_is_taken_over(s3: str, url: str) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    gone = store_of(url, s3)
    gone.claim(resuming=False)
    gone.writer._stop.set()  # as if killed: no renewal, no release
    lease = json.loads(gone.store.read(".claims/run/writer.lease"))
    gone.store.write(".claims/run/writer.lease", json.dumps({**lease, "pid": int(dead.stdout)}).encode())
    restart = store_of(url, s3)
    restart.claim(resuming=True)  # not expired, but its holder is gone: the restart goes on at once
    assert json.loads(restart.store.read(".claims/run/writer.lease"))["owner"] == restart.run_id
    with pytest.raises(StorageError, match="this run's lease was taken over by process"):
        gone.writer.check()  # the old holder, were it alive, would stop before writing
    restart.release()


def test_an_elastic_restart_takes_over_its_jobs_lease(s3: str, url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun's restarts of one job (one TORCHELASTIC_RUN_ID) take over the lease an earlier attempt left, whatever
    its machine; another job is refused."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-7")
    earlier = store_of(url, s3)
    earlier.claim(resuming=True)
    earlier.writer._stop.set()  # killed: the lease stays, held by a live-looking process of this machine
    with monkeypatch.context() as other:
        other.setenv("TORCHELASTIC_RUN_ID", "job-8")
        with pytest.raises(StorageError, match=f"is being written by process .*\\(run {earlier.run_id}@job-7\\)"):
            store_of(url, s3).claim(resuming=True)
    restart = store_of(url, s3)
    restart.claim(resuming=True)
    assert json.loads(restart.store.read(".claims/run/writer.lease"))["owner"] == f"{restart.run_id}@job-7"
    restart.release()


def test_the_lease_is_renewed_while_the_run_lasts(s3: str, url: str) -> None:
    from qie.training.run_lease import WriterLease

    store = store_of(url, s3)
    lease = WriterLease(store.store, url, "r1", seconds=0.4)
    lease.take()
    first = json.loads(store.store.read(".claims/run/writer.lease"))["expires"]
    time.sleep(0.5)  # past its first expiry: renewed meanwhile, so another writer is still refused
    assert json.loads(store.store.read(".claims/run/writer.lease"))["expires"] > first
    with pytest.raises(StorageError, match="is being written by"):
        WriterLease(store.store, url, "r2", seconds=0.4).take()
    lease.release()


def test_a_run_that_does_not_resume_is_refused_a_store_holding_another_runs_checkpoints(
    s3: str, url: str, base: list[str], tmp_path: Path, trained: dict
) -> None:
    stored(url, s3, trained)
    with pytest.raises(StorageError) as info:
        train(base, tmp_path / "b", *on_bucket(url, s3), "train.max_steps=2")
    assert str(info.value) == (
        f"run.output_url={url} holds the checkpoints of an earlier run (the newest step-000001): continue it with "
        "train.resume=latest, or give this run an output URL of its own"
    )
    assert objects(url, s3) == trained


@pytest.mark.parametrize("mix", ["file", "marker", "extra"])
def test_a_checkpoint_written_by_two_runs_is_refused_on_resume(
    s3: str, url: str, base: list[str], tmp_path: Path, trained: dict, mix: str
) -> None:
    """A third run resumed silently from one run's marker over another's files; now the checkpoint is refused in
    one line and nothing of it is copied into the run folder."""
    store = stored(url, s3, trained)
    name = "checkpoints/step-000001"
    if mix == "file":  # another run's bytes under this run's marker
        weights = f"{name}/state/optimizer.safetensors"
        store.write(weights, store.read(weights)[:-8] + b"\0" * 8)
        why = "its state/optimizer.safetensors is not the file run .* stored"
    elif mix == "marker":  # the marker of another run over this run's files
        marker = json.loads(store.read(f"{name}/.complete"))
        store.write(f"{name}/.complete", json.dumps({**marker, "run": "0123456789abcdef"}).encode())
        why = "its marker names run 0123456789abcdef and its trainer_state.json run "
    else:
        store.write(f"{name}/comfyui_lora.safetensors", b"another run's export")
        why = "it holds comfyui_lora.safetensors, which its marker .* does not list"
    node = tmp_path / "node_b"
    with pytest.raises(StorageError, match=f"checkpoint step-000001 in {url} is refused: {why}"):
        train(base, node, *on_bucket(url, s3, "train.resume=latest"), "train.max_steps=2")
    assert not (node / "checkpoints").exists() or not list((node / "checkpoints").iterdir())


def test_a_marker_without_run_or_digests_is_refused(s3: str, url: str, tmp_path: Path, trained: dict) -> None:
    store = stored(url, s3, trained)
    store.write("checkpoints/step-000001/.complete", json.dumps({"step": 1, "written": 0}).encode())
    with pytest.raises(StorageError, match="has a marker without its run's id and file digests"):
        store_of(url, s3).download_checkpoint("step-000001", tmp_path / "b")
    assert not (tmp_path / "b" / "checkpoints" / "step-000001").exists()


@pytest.mark.parametrize("where", ["no bucket", "no server"])
def test_the_store_is_checked_before_the_model_loads(
    s3: str, base: list[str], tmp_path: Path, where: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A missing bucket was a raw NoSuchBucket traceback at the first checkpoint, a store that is down found only
    then (and a restart with resume=latest started at step 0): both are named in one line before anything loads."""
    from qie.stages import train as train_stage

    endpoint = s3 if where == "no bucket" else f"http://127.0.0.1:{free_port()}"
    loaded = []
    monkeypatch.setattr(train_stage, "load_model", lambda *a, **k: loaded.append(1))
    run = tmp_path / "run"
    with pytest.raises(StorageError) as info:
        train(base, run, *on_bucket("s3://missing-bucket/runs/a", endpoint), "train.max_steps=1")
    message = str(info.value)
    assert message.startswith(f"object store s3://missing-bucket/runs/a at {endpoint}: ") and "\n" not in message
    expected = "the bucket does not exist: create it" if where == "no bucket" else "check run.endpoint_url and that"
    assert expected in message
    assert not loaded and not (run / "run_info.json").exists()
