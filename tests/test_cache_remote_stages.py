# ruff: noqa: F811 - the tests take the imported fixtures `s3` and `url` as arguments
"""The stages on a bucket of a real S3 server on 127.0.0.1 (moto's, in this process): precompute into it and cached
training give the ssd backend's losses, two precompute processes at once encode no entry twice, an unreachable
endpoint is named before any model is built, and the cache command's actions (gc included) and sync work on it."""

from __future__ import annotations

from pathlib import Path
from unittest.mock import ANY

import pytest
import torch
from test_cache_backends import assert_same
from test_cache_remote import free_port, remote, s3, url  # noqa: F401 - fixtures, used as arguments

from qie.errors import StorageError

# --- the stages on the bucket ----------------------------------------------------------------------------------

TRAINING = ["train.max_steps=2", "train.learning_rate=1e-3", "data.batch_size=2", "train.seed=7",
            "logging.report_to=none", "train.checkpoint_every=0", "data.num_workers=0"]  # fmt: skip


def on_bucket(url: str, endpoint: str) -> list[str]:
    """The overrides of a cache in the bucket `url` at `endpoint`, two tries per request."""
    return [
        "cache=remote",
        f"cache.backend.url={url}",
        f"cache.backend.endpoint_url={endpoint}",
        "cache.backend.retries=2",
    ]


def node(tmp_path: Path, name: str) -> list[str]:
    """The overrides of node `name`'s own folders: its state and its copy of the bucket's entries."""
    return [f"cache.dir={tmp_path / name / 'dir'}", f"cache.backend.local_dir={tmp_path / name / 'copy'}"]


def indexed_when_the_backend_goes(url: str, s3: str, local: Path) -> None:
    """Every stored entry is in the index once precompute's backend is collected (polled: the collector may hand
    the flush to a thread)."""
    import gc
    import time

    gc.collect()
    stored = {t: s["count"] for t, s in remote(url, s3, local).stats().items() if s["count"]}
    for _ in range(50):
        if stored == {t: len(remote(url, s3, local).index.records(t)) for t in stored}:
            return
        time.sleep(0.1)
    pytest.fail(f"the index lacks entries of {stored}")


def test_precompute_into_the_bucket_then_training_gives_the_ssd_losses(
    s3: str, url: str, tiny_path: Path, cached_data, tmp_path: Path
) -> None:
    from qie.checks import compose
    from qie.stages import precompute
    from qie.stages import train as train_stage

    base = [f"model.pretrained_model_name_or_path={tiny_path}", f"data.path={cached_data.data}"]
    ssd = train_stage.run(compose("train", [*base, f"cache.dir={cached_data.cache}", *TRAINING]), tmp_path / "ssd")
    bucket = on_bucket(url, s3)
    summary = precompute.run(compose("precompute", [*base, *bucket, *node(tmp_path, "a")]), tmp_path / "pre")
    assert summary.samples == 8 and not summary.failures
    indexed_when_the_backend_goes(url, s3, tmp_path / "c")
    again = precompute.run(compose("precompute", [*base, *bucket, *node(tmp_path, "a")]), tmp_path / "pre2")
    assert sum(t.new for t in again.types.values()) == 0  # everything found in the bucket
    training = [*base, *bucket, *node(tmp_path, "b"), *TRAINING]
    remote_run = train_stage.run(compose("train", training), tmp_path / "remote")
    assert remote_run["losses"] == ssd["losses"]


@pytest.mark.parametrize("stage", ["precompute", "train"])
def test_a_stage_names_an_unreachable_endpoint_before_building_a_model(
    stage: str, url: str, tiny_path: Path, cached_data, tmp_path: Path, monkeypatch
) -> None:
    from qie.checks import compose
    from qie.stages import precompute, train_model
    from qie.stages import train as train_stage

    run, builds, what = {"precompute": (precompute.run, precompute, "build_encoder"),
                         "train": (train_stage.run, train_model, "load_parts")}[stage]  # fmt: skip
    monkeypatch.setattr(builds, what, lambda *a, **k: pytest.fail("a model was built"))
    # Credentials of their own (not the S3 server fixture's, which may be gone by now): the endpoint is what fails.
    credentials = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}
    for key, v in credentials.items():
        monkeypatch.setenv(key, v)
    endpoint = f"http://127.0.0.1:{free_port()}"
    overrides = [f"model.pretrained_model_name_or_path={tiny_path}", f"data.path={cached_data.data}", "cache=remote",
                 f"cache.backend.url={url}", f"cache.backend.endpoint_url={endpoint}", "cache.backend.retries=2",
                 f"cache.dir={tmp_path}", *(TRAINING if stage == "train" else [])]  # fmt: skip
    with pytest.raises(StorageError, match=f"{endpoint}.*unreachable after 2 tries"):
        run(compose(stage, overrides), tmp_path / "run")


# --- the admin command on the bucket, and sync ------------------------------------------------------------------


def admin(*overrides: str) -> int:
    from qie.checks import compose
    from qie.stages.cache_admin import run

    return run(compose("cache", list(overrides)))


def test_sync_copies_a_cache_to_the_bucket_and_back_verified_and_resumable(
    s3: str, url: str, tiny_path: Path, cached_data, tmp_path: Path, capsys
) -> None:
    from qie.cache.ssd import SsdBackend

    on_bucket = [
        "cache=remote",
        f"cache.backend.url={url}",
        f"cache.backend.endpoint_url={s3}",
        f"cache.backend.local_dir={tmp_path / 'l'}",
    ]
    assert admin(f"cache.dir={cached_data.cache}", "action=sync", f"sync.to={url}", f"sync.endpoint_url={s3}",
                 f"sync.local_dir={tmp_path / 's'}") == 0  # fmt: skip
    source = SsdBackend(cached_data.cache)
    counts = {t: s["count"] for t, s in source.stats().items()}
    assert "copied" in capsys.readouterr().out
    assert admin(*on_bucket, "action=stats") == 0
    printed = capsys.readouterr().out
    assert all(f"{t}" in printed for t, n in counts.items() if n)
    assert admin(*on_bucket, "action=verify") == 0 and "0 corrupt" in capsys.readouterr().out
    # Back into a folder; interrupted (some entries missing) and run again: only those are copied.
    back = tmp_path / "back"
    assert admin(*on_bucket, "action=sync", f"sync.to={back}") == 0
    copy = SsdBackend(back)
    for k in copy.keys("pixel_latent")[:3]:
        copy.path("pixel_latent", k).unlink()
    assert admin(*on_bucket, "action=sync", f"sync.to={back}") == 0
    assert "copied 3 entries" in capsys.readouterr().out.splitlines()[-1]
    for t in counts:
        for k in source.keys(t):
            want = source.get(t, k)  # (safetensors orders header metadata its own way: compare entries)
            assert_same(copy.get(t, k), want)
            assert copy.get(t, k).meta == want.meta and copy.get(t, k).checksum == want.checksum
    # gc on the bucket: an entry no sample uses is listed (dry run), then removed; the samples' entries stay.
    stray = remote(url, s3, tmp_path / "y")
    stray.put("pixel_latent", "ff" * 32, {"latent": torch.zeros(2)})
    stray.flush()
    used = [f"data.path={cached_data.data}", f"model.pretrained_model_name_or_path={tiny_path}"]
    assert admin(*on_bucket, *used, "action=gc") == 0
    assert "would remove 1 unused entries" in capsys.readouterr().out
    assert admin(*on_bucket, *used, "action=gc", "gc.dry_run=false") == 0
    assert "removed 1 unused entries" in capsys.readouterr().out
    assert remote(url, s3, tmp_path / "z").stats() == {t: {"count": n, "bytes": ANY} for t, n in counts.items()}
    # Clear on the bucket removes the entries only.
    assert admin(*on_bucket, "action=clear") == 0
    assert remote(url, s3, tmp_path / "x").stats()["pixel_latent"]["count"] == 0


@pytest.mark.slow  # the claims are tested in-process in test_cache_remote; this runs two real precomputes
def test_two_precompute_processes_on_one_bucket_encode_no_entry_twice(
    s3: str, url: str, tiny_path: Path, cached_data, tmp_path: Path
) -> None:
    """Two `python -m qie.precompute` processes at once (two machines, each with its own node folders): the
    claims in the bucket split the entries between them."""
    import json
    import os
    import subprocess
    import sys

    on_bucket = [f"model.pretrained_model_name_or_path={tiny_path}", f"data.path={cached_data.data}", "cache=remote",
                 f"cache.backend.url={url}", f"cache.backend.endpoint_url={s3}", "precompute.batch_size=1",
                 "cache.backend.retries=2"]  # fmt: skip
    env = {**os.environ, "TQDM_DISABLE": "1"}
    procs = {
        n: subprocess.Popen(
            [
                sys.executable,
                "-m",
                "qie.precompute",
                *on_bucket,
                f"cache.dir={tmp_path / n}",
                f"cache.backend.local_dir={tmp_path / n}/l",
                f"hydra.run.dir={tmp_path / f'run_{n}'}",
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for n in ("a", "b")
    }
    for p in procs.values():
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0, out[-3000:]
    summaries = [json.loads((tmp_path / f"run_{n}" / "precompute_summary.json").read_text()) for n in procs]
    stored = {t: s["count"] for t, s in remote(url, s3, tmp_path / "c").stats().items() if s["count"]}
    encoded = {t: sum(s["types"][t]["new"] for s in summaries) for t in stored}
    assert encoded == stored  # each entry encoded by exactly one of them
    print("encoded per process:", [{t: s["types"][t]["new"] for t in stored} for s in summaries])
    indexed_when_the_backend_goes(url, s3, tmp_path / "d")


def test_training_stops_with_one_error_when_the_server_goes_away_mid_run(
    s3: str, url: str, tiny_path: Path, cached_data, tmp_path: Path
) -> None:
    from moto.server import ThreadedMotoServer

    from qie.cache.ssd import SsdBackend
    from qie.cache.sync import sync
    from qie.checks import compose
    from qie.stages import train as train_stage

    port = free_port()  # a server of its own, stopped after the first step
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    sync(SsdBackend(cached_data.cache), remote(url, endpoint, tmp_path / "upload"))
    overrides = [f"model.pretrained_model_name_or_path={tiny_path}", f"data.path={cached_data.data}", "cache=remote",
                 f"cache.backend.url={url}", f"cache.backend.endpoint_url={endpoint}", "cache.backend.retries=2",
                 f"cache.dir={tmp_path}", f"cache.backend.local_dir={tmp_path / 'copy'}", "data.prefetch=0",
                 "train.max_steps=4", "data.batch_size=2", "logging.report_to=none", "train.checkpoint_every=0",
                 "data.num_workers=0"]  # fmt: skip
    steps = []

    def stop_after_the_first(info) -> None:
        steps.append(info)
        if len(steps) == 1:
            server.stop()

    with pytest.raises(StorageError, match=f"{endpoint}.*unreachable after 2 tries"):
        train_stage.run(compose("train", overrides), tmp_path / "run", on_step_end=stop_after_the_first)
    assert len(steps) == 1


def test_the_precompute_failure_list_is_in_the_bucket_for_a_training_on_another_node(
    s3: str, url: str, tiny_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    from qie.cache.failures import FILE_NAME, read_failures
    from qie.checks import compose
    from qie.demo.synthetic import make_dataset
    from qie.stages import precompute, precompute_work
    from qie.stages import train as train_stage

    ds = make_dataset(tmp_path / "data", train=3, heldout=0, size=32) / "train"
    real = precompute_work.Encoder.encode_entries

    def poisoned(self, prepared, types):
        out = real(self, prepared, types)
        for p, entry in zip(prepared, out):
            if p.sample.id == "00001" and "prompt_embed" in entry:
                entry["prompt_embed"]["embed"][0, 0] = float("inf")
        return out

    monkeypatch.setattr(precompute_work.Encoder, "encode_entries", poisoned)
    model = f"model.pretrained_model_name_or_path={tiny_path}"
    base = [model, f"data.path={ds}", *on_bucket(url, s3)]
    summary = precompute.run(compose("precompute", [*base, *node(tmp_path, "a")]), tmp_path / "pre")
    assert [f.id for f in summary.failures] == ["00001"]
    assert not (tmp_path / "a" / "dir" / FILE_NAME).exists()  # not on the node: in the bucket
    listed = read_failures(remote(url, s3, tmp_path / "c"))
    assert [v["sample"] for v in listed.values()] == ["00001"]
    monkeypatch.setattr(precompute_work.Encoder, "encode_entries", real)
    training = [*TRAINING, "train.max_steps=1", "cache.on_missing=skip"]
    assert train_stage.run(compose("train", [*base, *node(tmp_path, "b"), *training]), tmp_path / "train")["step"] == 1
    assert "skipping sample '00001': precompute could not encode it" in capsys.readouterr().out
