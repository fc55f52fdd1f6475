# ruff: noqa: F811 - the tests take the imported fixtures `s3` and `url` as arguments
"""Run outputs on a bucket of a real S3 server on 127.0.0.1 (moto's, in this process): checkpoints uploaded whole
and visible once their marker is written, `checkpoints_total_limit` applied there, the weights, metrics and report
uploaded at the end, and `train.resume=latest` on a fresh node resuming exactly from the newest complete one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_cache_remote import free_port, s3, url  # noqa: F401 - fixtures, used as arguments

from qie.errors import ConfigError, ModelLoadError, StorageError

STEPS = [
    "train.learning_rate=1e-3",
    "data.batch_size=2",
    "train.seed=7",
    "logging.report_to=none",
    "data.num_workers=0",
    "train.checkpoint_every=1",
]


def train(base: list[str], run_dir: Path, *overrides: str) -> dict:
    from qie.checks import compose
    from qie.stages import train as train_stage

    return train_stage.run(compose("train", [*base, *STEPS, *overrides]), run_dir)


def store_of(url: str, s3: str):
    from qie.training.run_store import RunStore

    return RunStore(url, s3, retries=2, backoff=0.01)


@pytest.fixture
def base(tiny_path: Path, cached_data) -> list[str]:
    return [f"model.pretrained_model_name_or_path={tiny_path}", *cached_data.overrides]


def test_outputs_on_the_bucket_and_a_fresh_node_resumes_from_it_exactly(
    s3: str, url: str, base: list[str], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    full = train(base, tmp_path / "full", "train.max_steps=5")
    on_bucket = [f"run.output_url={url}", f"run.endpoint_url={s3}", "train.resume=latest"]
    # The first start: nothing in the bucket yet, so it trains from step 0.
    on_bucket.append("train.checkpoints_total_limit=2")
    first = train(base, tmp_path / "node_a", *on_bucket, "train.max_steps=3")
    assert first["losses"] == full["losses"][:3]
    assert "no checkpoint in " + url + "/checkpoints, starting from step 0" in capsys.readouterr().out
    store = store_of(url, s3)
    assert store.checkpoints() == ["step-000002", "step-000003"]  # the limit applies in the bucket
    objects = store.store.listing("")
    assert "checkpoints/step-000001/trainer_state.json" not in objects
    for name in (
        "lora/pytorch_lora_weights.safetensors",
        "train_result.json",
        "metrics.jsonl",
        "checkpoints/step-000003/state/model.safetensors",
        "checkpoints/step-000003/.complete",
    ):
        assert name in objects, name
    assert ".qie-run.lock" not in objects
    result = json.loads(store.store.read("train_result.json"))
    assert result["losses"] == first["losses"]
    # A checkpoint whose upload was cut short (no marker) is not listed, so never resumed from.
    state = json.loads(store.store.read("checkpoints/step-000003/trainer_state.json"))
    store.store.write("checkpoints/step-000004/trainer_state.json", json.dumps({**state, "step": 4}).encode())
    assert store.checkpoints()[-1] == "step-000003"
    store.store.write("checkpoints/step-000001/state/model.safetensors", b"cut short")  # older: removed by the run
    # Another node, with an empty run folder, resumes from the bucket's step 3 and ends as one run would.
    second = train(base, tmp_path / "node_b", *on_bucket, "train.max_steps=5")
    assert "checkpoints/step-000003 copied to" in capsys.readouterr().out
    assert second["losses"] == full["losses"][3:]
    assert second["param_checksums"] == full["param_checksums"]
    lines = [json.loads(line) for line in store.store.read("metrics.jsonl").decode().splitlines()]
    assert [m["step"] for m in lines] == [1, 2, 3, 4, 5]
    assert [m["loss"] for m in lines] == full["losses"]
    assert store.checkpoints() == ["step-000004", "step-000005"]
    left = {name.split("/")[1] for name in store.store.listing("checkpoints")}
    assert left == {"step-000004", "step-000005"}  # the older one cut short is gone too
    assert json.loads(store.store.read("checkpoints/step-000004/trainer_state.json"))["step"] == 4  # re-uploaded


def test_a_resume_on_another_number_of_processes_is_refused_unless_inexact(
    base: list[str], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    run = tmp_path / "run"
    train(base, run, "train.max_steps=1")
    state_file = run / "checkpoints" / "step-000001" / "trainer_state.json"
    state_file.write_text(json.dumps({**json.loads(state_file.read_text()), "num_processes": 2}))
    with pytest.raises(ModelLoadError, match="saved by 2 processes, resuming with 1.*train.resume_inexact=true"):
        train(base, run, "train.max_steps=2", "train.resume=latest")
    resumed = train(base, run, "train.max_steps=2", "train.resume=latest", "train.resume_inexact=true")
    assert len(resumed["losses"]) == 1
    assert "the data order from here on differs" in capsys.readouterr().out


def test_a_bucket_without_a_prefix_is_refused_in_one_line(base: list[str], tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"run.output_url='s3://bucket' names a bucket without a prefix"):
        train(base, tmp_path / "run", "train.max_steps=1", "run.output_url=s3://bucket")


def test_an_unreachable_store_is_named_in_one_line_before_training(s3: str, base: list[str], tmp_path: Path) -> None:
    endpoint = f"http://127.0.0.1:{free_port()}"  # not `s3`'s: no server there (the fixture sets the credentials)
    assert endpoint != s3
    on_bucket = ["run.output_url=s3://bucket/runs/a", f"run.endpoint_url={endpoint}", "train.resume=latest"]
    named = f"object store s3://bucket/runs/a at {endpoint}: .* failed .*check run.endpoint_url"
    with pytest.raises(StorageError, match=named):
        train(base, tmp_path / "run", "train.max_steps=1", *on_bucket)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_the_endpoint_comes_from_aws_endpoint_url_as_boto_reads_it(
    s3: str, url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from qie.training.run_store import RunStore

    monkeypatch.setenv("AWS_ENDPOINT_URL", s3)
    RunStore(url, retries=1).store.write("probe.json", b"{}")  # no run.endpoint_url: the environment's
    assert store_of(url, s3).store.read("probe.json") == b"{}"


@pytest.mark.parametrize("planted", ["../../../PWNED", "/{outside}/PWNED"])
def test_an_object_whose_key_leaves_its_checkpoint_refuses_that_checkpoint(
    s3: str, url: str, base: list[str], tmp_path: Path, planted: str
) -> None:
    on_bucket = [f"run.output_url={url}", f"run.endpoint_url={s3}", "train.resume=latest"]
    train(base, tmp_path / "node_a", *on_bucket, "train.max_steps=1")
    outside = tmp_path / "outside"
    key = "checkpoints/step-000001/" + planted.format(outside=str(outside).strip("/"))
    store_of(url, s3).store.write(key, b"import os  # a .pth would run this\n")
    node_b = tmp_path / "nodes" / "b"
    with pytest.raises(StorageError, match=r"holds the object .*PWNED.*leads out of its checkpoint folder: "):
        train(base, node_b, *on_bucket, "train.max_steps=2")
    assert not list(tmp_path.rglob("PWNED")) and not outside.exists()
    assert not (node_b / "checkpoints" / "step-000001").exists()
