# ruff: noqa: F811 - the tests take the imported fixtures `s3` and `url` as arguments
"""The cache against faults of trust: another entry's file under a key's name (ssd and bucket), links out of a
`file://` store, objects deleted from the bucket, claims left by an outage and the wait for others' claims, the
start-up check by files, a sync into its own source, a damaged teacher output, and a `cache.backend.url` without a
scheme."""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path

import pytest
import torch
from test_cache_backends import make_entry
from test_cache_remote import free_port, moto_server, raw_fs, remote, s3, url, writing  # noqa: F401 - fixtures
from test_cache_remote_stages import indexed_when_the_backend_goes, node, on_bucket

from qie.cache import folders
from qie.cache.codec import encode
from qie.cache.keys import entry_key
from qie.cache.remote import RemoteBackend
from qie.cache.ssd import SsdBackend
from qie.checks import compose
from qie.errors import CacheMissError, ConfigError, StorageError
from qie.stages.cache_admin import run as cache_cli

T = "pixel_latent"


def key(n: int) -> str:
    return entry_key(T, {"n": n})


# --- an entry under another key's name --------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["copied", "renamed"])
@pytest.mark.parametrize("check", ["folders", "files"])
def test_another_entrys_file_under_a_keys_name_is_refused_by_read_start_up_check_and_verify(
    tmp_path: Path, how: str, check: str
) -> None:
    b = SsdBackend(tmp_path, startup_check=check)
    b.put(T, key(0), make_entry(T, 0))
    b.put(T, key(1), make_entry(T, 1))
    time.sleep(2 * folders.TICK_NS / 1e9)
    assert b.intact_all([(T, key(0))], remember=True) == [True]  # stamped whole
    if how == "copied":
        shutil.copy(b.path(T, key(1)), b.path(T, key(0)))
    else:
        os.replace(b.path(T, key(1)), b.path(T, key(0)))
    assert b.get(T, key(0)) is None
    assert not b.intact(T, key(0))
    # A copy over the file writes it in place: the check by folders leaves that to the read (as any in-place write).
    assert b.intact_all([(T, key(0))]) == [check == "folders" and how == "copied"]
    (bad,) = b.verify().corrupt
    assert bad.key == key(0) and f"holds the entry of key {key(1)}" in bad.reason


def test_entries_written_before_keys_were_recorded_still_read_and_verify(tmp_path: Path) -> None:
    b = SsdBackend(tmp_path)
    entry = make_entry(T)
    b.path(T, key(0)).parent.mkdir(parents=True)
    b.path(T, key(0)).write_bytes(encode(entry, T))  # the header of before: no key
    assert torch.equal(b.get(T, key(0))["latent"], entry["latent"])
    assert b.intact_all([(T, key(0))], remember=True) == [True]
    assert b.verify().corrupt == []


def test_an_object_copied_over_another_keys_in_the_bucket_is_refused(s3: str, url: str, tmp_path: Path) -> None:
    b = writing(url, s3, tmp_path / "a")
    b.put(T, key(0), make_entry(T, 0))
    b.put(T, key(1), make_entry(T, 1))
    b.flush()
    fs = raw_fs(s3)
    root = url.removeprefix("s3://")
    fs.copy(f"{root}/{b.name(T, key(1))}", f"{root}/{b.name(T, key(0))}")
    fresh = remote(url, s3, tmp_path / "b")  # a node without a copy of its own
    assert fresh.get(T, key(0)) is None
    assert fresh.probe(T, key(0), local=False) is None  # what a start-up check of unindexed entries reads
    (bad,) = fresh.verify().corrupt
    assert bad.key == key(0) and f"holds the entry of key {key(1)}" in bad.reason


# --- a file:// store's links, objects deleted from the bucket ---------------------------------------------------------


@pytest.mark.parametrize("action", ["clear", "verify", "unused"])
def test_admin_actions_of_a_file_store_never_follow_a_linked_type_folder(tmp_path: Path, action: str) -> None:
    store, outside = tmp_path / "store", tmp_path / "elsewhere"
    b = RemoteBackend(url=f"file://{store}", local_dir=tmp_path / "copy")
    b.check_access(write=True)
    b.put("prompt_embed", entry_key("prompt_embed", {"n": 0}), make_entry("prompt_embed"))
    victim = outside / key(0)[:2] / f"{key(0)}.safetensors"
    victim.parent.mkdir(parents=True)
    victim.write_bytes(b"not an entry of this store")
    (store / T).symlink_to(outside)
    if action == "clear":
        b.index.add(T, key(0), (1, "xxh3_64:0", ""))
        assert b.clear([T]) == 0
        assert key(0) in b.index.records(T)  # its index is left as it is too
    elif action == "verify":
        report = b.verify([T], fix=True)
        assert report.corrupt == [] and report.skipped == [f"{store}/{T}"]
    else:
        assert b.unused({}, [T], remove=True)[T]["count"] == 0
    assert victim.read_bytes() == b"not an entry of this store"
    assert b.keys("prompt_embed") == [entry_key("prompt_embed", {"n": 0})]  # the store's own entries still listed


def test_verify_reports_an_indexed_object_that_is_missing_and_fix_drops_it(s3: str, url: str, tmp_path: Path) -> None:
    b = writing(url, s3, tmp_path / "a")
    b.put(T, key(0), make_entry(T, 0))
    b.put(T, key(1), make_entry(T, 1))
    b.flush()
    raw_fs(s3).rm_file(f"{url.removeprefix('s3://')}/{b.name(T, key(0))}")
    fresh = remote(url, s3, tmp_path / "b")
    report = fresh.verify([T])
    assert report.checked == 2 and [c.key for c in report.corrupt] == [key(0)] and report.unfixed == 1
    assert "listed in the cache's index, but its object is missing" in report.corrupt[0].reason
    assert fresh.verify([T], fix=True).unfixed == 0
    assert set(remote(url, s3, tmp_path / "c").index.records(T)) == {key(1)}
    assert remote(url, s3, tmp_path / "d").verify([T]).corrupt == []


def test_a_fresh_node_missing_a_deleted_object_is_told_it_was_deleted_and_how_to_repair(
    s3: str, url: str, tiny_path: Path, cached_data, tmp_path: Path
) -> None:
    from qie.stages import precompute
    from qie.stages import train as train_stage

    base = [f"model.pretrained_model_name_or_path={tiny_path}", f"data.path={cached_data.data}"]
    bucket = on_bucket(url, s3)
    precompute.run(compose("precompute", [*base, *bucket, *node(tmp_path, "a")]), tmp_path / "pre")
    indexed_when_the_backend_goes(url, s3, tmp_path / "c")
    fs, root = raw_fs(s3), url.removeprefix("s3://")
    for victim in fs.find(f"{root}/pixel_latent"):  # whichever sample comes first
        fs.rm_file(victim)
    training = ["train.max_steps=1", "logging.report_to=none", "train.checkpoint_every=0", "data.num_workers=0"]
    with pytest.raises(CacheMissError) as info:
        train_stage.run(compose("train", [*base, *bucket, *node(tmp_path, "b"), *training]), tmp_path / "run")
    message = str(info.value)
    assert "no cached pixel_latent (the cache lists it, but its stored object was deleted)" in message
    assert "its bytes changed" not in message and " cache.repair=true\n" in message


# --- claims after an outage, and the wait for others' claims ----------------------------------------------------------


def test_claims_left_by_an_outage_are_released_when_the_store_answers_again(s3: str, url: str, tmp_path: Path) -> None:
    port = free_port()  # a server of its own, stopped and started again (moto's servers share their buckets)
    endpoint = f"http://127.0.0.1:{port}"
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    kw = dict(url=url, endpoint_url=endpoint, retries=2, backoff=0.01, timeout=1)
    a = RemoteBackend(local_dir=tmp_path / "node", **kw)
    a.check_access(write=True)
    held = [a.claim(T, key(n)) for n in range(3)]
    server.stop()
    with pytest.raises(StorageError, match="unreachable"):
        held[0].release()
    started = time.monotonic()
    for lease in held[1:]:  # noted at once, without another round of retries each
        with pytest.raises(StorageError):
            lease.release()
    assert time.monotonic() - started < 1
    assert len(list((tmp_path / "node" / ".unreleased-claims").iterdir())) == 3
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        other = RemoteBackend(local_dir=tmp_path / "other-node", **kw)
        assert other.claim(T, key(0)) is None  # still held, for 600 s
        again = RemoteBackend(local_dir=tmp_path / "node", **kw)  # the next run of the node
        assert again.sweep_temp() >= 3
        assert all(other.claim(T, key(n)) is not None for n in range(3))
        assert list((tmp_path / "node" / ".unreleased-claims").iterdir()) == []
    finally:
        server.stop()


def test_a_wait_for_another_runs_claim_names_whose_and_until_when(s3: str, url: str, tmp_path: Path, caplog) -> None:
    import socket

    holder = writing(url, s3, tmp_path / "a", lease_seconds=1.0)
    waiter = writing(url, s3, tmp_path / "b", lease_seconds=1.0)
    assert holder.claim(T, key(0)) is not None
    with caplog.at_level(logging.WARNING, logger="qie.cache.remote"):
        lease = waiter.claim(T, key(0), wait=True)  # the holder never releases: its lease expires
    assert lease is not None
    (message,) = [r.getMessage() for r in caplog.records if "waiting for claims held by" in r.getMessage()]
    assert f"process {os.getpid()} on {socket.gethostname()}" in message and holder.owner in message
    assert f"{T}/{key(0)} lasts until 20" in message and " UTC" in message


def test_precompute_says_how_many_entries_wait_for_other_runs_claims(caplog) -> None:
    from qie.stages.precompute_work import PrecomputeSummary, encode_groups

    class Busy:
        """A backend whose every entry another run holds until the first wait."""

        def claim(self, type, key, wait=False):
            return _Released() if wait else None

    class _Released:
        def release(self) -> None:
            pass

    samples = [(f"s{i}", {"pixel_latent": "a", "prompt_embed": "b"}) for i in range(3)]
    groups = {("pixel_latent", "prompt_embed"): samples}
    calls = []

    def claim(backend, batch, types, summary, repair=False):
        calls.append(len(batch))
        return ([], batch, []) if len(calls) == 1 else ([], [], [])

    with caplog.at_level(logging.WARNING, logger="qie.stages.precompute_work"), pytest.MonkeyPatch.context() as mp:
        mp.setattr("qie.stages.precompute_work.claim", claim)
        encode_groups(lambda: None, groups, Busy(), None, PrecomputeSummary(), 8, False, lambda n: None)
    assert "6 entries of 3 samples are claimed by other runs" in caplog.text


def test_a_batch_stopped_by_an_outage_releases_every_claim_and_tells_the_outage(monkeypatch) -> None:
    from qie.stages import precompute_work

    released = []

    class Claim:
        def __init__(self, n: int) -> None:
            self.n = n

        def release(self) -> None:
            released.append(self.n)
            if self.n == 0:
                raise StorageError("releasing the first claim failed too")

    def encode_batch(*args) -> None:
        raise StorageError("writing an entry failed: the store stopped answering")

    batch = [("s0", {"pixel_latent": "a"})]
    monkeypatch.setattr(
        precompute_work, "claim", lambda *a: ([(*batch[0], ("pixel_latent",))], [], [Claim(0), Claim(1)])
    )
    monkeypatch.setattr(precompute_work, "_encode_batch", encode_batch)
    groups = {("pixel_latent",): batch}
    with pytest.raises(StorageError, match="writing an entry failed"):
        precompute_work.encode_groups(lambda: None, groups, None, None, None, 8, False, lambda n: None)
    assert released == [0, 1]


# --- the start-up check by files --------------------------------------------------------------------------------------


def test_the_files_check_finds_a_same_size_change_before_the_first_step(tmp_path: Path) -> None:
    for check in ("files", "folders"):
        b = SsdBackend(tmp_path / check, verify_reads=True, startup_check=check)
        b.put(T, key(0), make_entry(T))
        time.sleep(2 * folders.TICK_NS / 1e9)
        assert b.intact_all([(T, key(0))], remember=True) == [True]
        with open(b.path(T, key(0)), "r+b") as f:  # a byte of the tensor data, in place
            f.seek(-1, os.SEEK_END)
            last = f.read(1)
            f.seek(-1, os.SEEK_END)
            f.write(bytes([last[0] ^ 1]))
        # files: read whole, as it changed since the check; folders: its folder is unchanged, its read finds it.
        assert b.intact_all([(T, key(0))]) == [check == "folders"]
        assert b.get(T, key(0)) is None


# --- a sync into its own source ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["inside", "around", "same"])
def test_a_sync_into_its_own_source_or_around_it_is_refused(tmp_path: Path, where: str) -> None:
    source = tmp_path / "cache"
    SsdBackend(source).put(T, key(0), make_entry(T))
    to = {"inside": source / T / "zz", "around": tmp_path, "same": source}[where]
    with pytest.raises(ConfigError, match="sync.to") as info:
        cache_cli(compose("cache", [f"cache.dir={source}", "action=sync", f"sync.to={to}"]))
    assert "\n" not in str(info.value)
    assert not (source / T / "zz").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["cache"]


def test_a_sync_into_a_link_of_its_own_source_is_refused(tmp_path: Path) -> None:
    source = tmp_path / "cache"
    SsdBackend(source).put(T, key(0), make_entry(T))
    (tmp_path / "alias").symlink_to(source)
    with pytest.raises(ConfigError, match="lies inside the cache it copies"):
        cache_cli(compose("cache", [f"cache.dir={source}", "action=sync", f"sync.to={tmp_path / 'alias' / 'sub'}"]))


# --- a damaged teacher output, a url without a scheme -----------------------------------------------------------------


def test_a_damaged_teacher_output_is_named_with_the_repair_command(small_cfg, cached_data, tmp_path: Path) -> None:
    from qie.stages import train

    distill = ["train/objective=distill", "train.objective.student_steps=2", "train.objective.teacher_steps=2"]
    distill += ["train.objective.teacher_cfg=4", "train.max_steps=1"]
    shutil.copytree(cached_data.cache, tmp_path / "cache")
    overrides = [*cached_data.overrides, *distill, f"cache.dir={tmp_path / 'cache'}"]
    train.run(small_cfg("train", *overrides, "cache.mode=lazy"), tmp_path / "lazy")  # writes teacher outputs
    written = sorted((tmp_path / "cache" / "teacher_latent").rglob("*.safetensors"))
    assert written
    for path in written:
        path.write_bytes(path.read_bytes()[:40])
    with pytest.raises(CacheMissError, match=r"teacher output \(seed \d\) is damaged in the cache") as info:
        train.run(small_cfg("train", *overrides), tmp_path / "run")
    assert "precompute.teachers=true cache.repair=true" in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("value", ["bucket/prefix", "/abs/folder", "relative"])
def test_a_cache_url_without_a_scheme_is_refused_in_one_line(value: str, tmp_path: Path) -> None:
    with pytest.raises(
        ConfigError, match=r"cache.backend.url=.* has no scheme: use s3://BUCKET/PREFIX .*file:///FOLDER"
    ):
        RemoteBackend(url=value, local_dir=tmp_path)
