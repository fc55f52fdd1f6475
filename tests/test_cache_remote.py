"""The remote backend against a real S3 server on 127.0.0.1 (moto's, in this process): round trips through the
bucket, the node-local copy (reused without requests, checked, evicted by size, never failing on a full disk),
claims between two backends, the index, admin actions that stay inside the prefix, and faults in one line."""

from __future__ import annotations

import logging
import os
import socket
import uuid
from pathlib import Path

import pytest
import torch
from test_cache_backends import assert_same, make_entry

from qie.cache import CACHE_TYPES
from qie.cache.keys import entry_key
from qie.cache.local_copy import LocalCopy
from qie.cache.remote import RemoteBackend
from qie.errors import CacheDirMissing, ConfigError, StorageError

pytest.importorskip("s3fs")
moto_server = pytest.importorskip("moto.server")

BUCKET = "qie-test"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def s3() -> str:
    """The endpoint of an S3 server on 127.0.0.1 holding an empty bucket `BUCKET`; stopped after the module."""
    saved = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")}
    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1")
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    port = free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    import s3fs

    try:
        s3fs.S3FileSystem(endpoint_url=endpoint, skip_instance_cache=True).mkdir(BUCKET)
    except FileExistsError:  # made by another module's server: moto's servers in one process share their buckets
        pass
    yield endpoint
    from qie.cache.remote_index import flush_live

    flush_live()  # what the tests' backends hold back is written now, not at exit when the server is gone
    server.stop()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture
def url() -> str:
    """A fresh prefix in the bucket for each test."""
    return f"s3://{BUCKET}/{uuid.uuid4().hex[:10]}"


def remote(url: str, s3: str, local: Path, **kw) -> RemoteBackend:
    return RemoteBackend(url=url, endpoint_url=s3, local_dir=local, retries=2, backoff=0.01, **kw)


def writing(url: str, s3: str, local: Path, **kw) -> RemoteBackend:
    """A backend ready to write (as precompute prepares it)."""
    b = remote(url, s3, local, **kw)
    b.check_access(write=True)
    return b


def raw_fs(s3: str):
    import s3fs

    return s3fs.S3FileSystem(endpoint_url=s3, skip_instance_cache=True, use_listings_cache=False)


def key(n: int | str = 0) -> str:
    return entry_key("pixel_latent", {"n": n})


def test_every_type_round_trips_through_the_bucket(s3: str, url: str, tmp_path: Path) -> None:
    writer = writing(url, s3, tmp_path / "a")
    entries = {t: make_entry(t, seed=i) for i, t in enumerate(CACHE_TYPES)}
    for t, e in entries.items():
        assert writer.put(t, key(t), e, {"fact": t}) > 0
    writer.flush()
    reader = remote(url, s3, tmp_path / "b")  # another node: an empty local copy
    reader.check_access()
    assert reader.intact_all([(t, key(t)) for t in CACHE_TYPES]) == [True] * len(CACHE_TYPES)
    for t, e in entries.items():
        got = reader.get(t, key(t))
        assert_same(got, e)
        assert got.meta == {"fact": t}
    assert reader.get("pixel_latent", key("absent")) is None
    assert not reader.intact("pixel_latent", key("absent"))
    stats = reader.stats()
    assert all(stats[t]["count"] == 1 for t in CACHE_TYPES)


def test_an_entry_is_fetched_once_per_node_then_read_locally(s3: str, url: str, tmp_path: Path) -> None:
    writer = writing(url, s3, tmp_path / "a")
    writer.put("pixel_latent", key(), make_entry("pixel_latent"))
    writer.flush()
    reader = remote(url, s3, tmp_path / "b")
    assert reader.get("pixel_latent", key()) is not None
    after_first = reader.store.requests
    for _ in range(3):
        assert_same(reader.get("pixel_latent", key()), make_entry("pixel_latent"))
    assert reader.store.requests == after_first  # no request after the first read
    # A later process on the node uses the copy too: the object itself is no longer needed.
    raw_fs(s3).rm_file(reader.store.path(reader.name("pixel_latent", key())))
    again = remote(url, s3, tmp_path / "b")
    assert_same(again.get("pixel_latent", key()), make_entry("pixel_latent"))


def test_a_corrupt_object_is_refused_by_its_checksum(s3: str, url: str, tmp_path: Path, caplog) -> None:
    writer = writing(url, s3, tmp_path / "a")
    writer.put("pixel_latent", key(), make_entry("pixel_latent"))
    writer.flush()
    fs, path = raw_fs(s3), writer.store.path(writer.name("pixel_latent", key()))
    data = bytearray(fs.cat_file(path))
    data[-3] ^= 0x40  # one bit of the tensor bytes
    fs.pipe_file(path, bytes(data))
    reader = remote(url, s3, tmp_path / "b")
    with caplog.at_level(logging.WARNING):
        assert reader.get("pixel_latent", key()) is None
    assert "corrupt" in caplog.text and "checksum" in caplog.text
    assert not reader.local.has("pixel_latent", key())  # never kept
    report = reader.verify()
    assert report.checked == 1 and [c.key for c in report.corrupt] == [key()]
    assert reader.verify(fix=True).removed == 1
    assert reader.stats()["pixel_latent"]["count"] == 0
    assert not remote(url, s3, tmp_path / "c").intact("pixel_latent", key())  # the index forgot it


def test_a_truncated_transfer_is_fetched_again(s3: str, url: str, tmp_path: Path, monkeypatch) -> None:
    writer = writing(url, s3, tmp_path / "a")
    writer.put("pixel_latent", key(), make_entry("pixel_latent"))
    reader = remote(url, s3, tmp_path / "b")
    real, calls = reader.store.read, []

    def short_once(name: str) -> bytes:
        calls.append(name)
        data = real(name)
        return data[:-5] if len(calls) == 1 and name.endswith(".safetensors") else data

    monkeypatch.setattr(reader.store, "read", short_once)
    assert_same(reader.get("pixel_latent", key()), make_entry("pixel_latent"))
    assert len(calls) == 2
    # A local copy that rotted is dropped and fetched again.
    path = Path(reader.local.path("pixel_latent", key()))
    path.write_bytes(path.read_bytes()[:-5])
    assert_same(reader.get("pixel_latent", key()), make_entry("pixel_latent"))


def test_the_local_copy_evicts_the_least_recently_used(tmp_path: Path) -> None:
    copy = LocalCopy(tmp_path / "local", max_bytes=2500)
    blob = bytes(1000)
    assert copy.write("pixel_latent", "aa1", blob) and copy.write("pixel_latent", "aa2", blob)
    assert copy.read("pixel_latent", "aa1") is not None  # aa1 now more recent than aa2
    assert copy.write("pixel_latent", "aa3", blob)
    assert [copy.has("pixel_latent", k) for k in ("aa1", "aa2", "aa3")] == [True, False, True]
    assert copy.total_bytes == 2000
    assert not copy.write("pixel_latent", "big", bytes(3000))  # larger than the limit: not kept
    # A later process learns the sizes from the folder.
    assert LocalCopy(tmp_path / "local", max_bytes=2500).total_bytes == 2000


def test_a_full_local_disk_evicts_and_never_fails(s3: str, url: str, tmp_path: Path, monkeypatch) -> None:
    from qie.cache import files

    writer = writing(url, s3, tmp_path / "a")
    for n in range(3):
        writer.put("pixel_latent", key(n), make_entry("pixel_latent", n))
    reader = remote(url, s3, tmp_path / "b")
    assert reader.get("pixel_latent", key(0)) is not None
    real, failures = files.write_atomic, []

    def full_once(path: str, data: bytes, k: str) -> None:
        if not failures:
            failures.append(path)
            raise StorageError("No space left on device")
        real(path, data, k)

    monkeypatch.setattr(files, "write_atomic", full_once)
    assert_same(reader.get("pixel_latent", key(1)), make_entry("pixel_latent", 1))
    assert failures and not reader.local.has("pixel_latent", key(0))  # evicted to make room
    assert reader.local.has("pixel_latent", key(1))
    monkeypatch.setattr(files, "write_atomic", lambda *a: (_ for _ in ()).throw(StorageError("disk full")))
    assert_same(reader.get("pixel_latent", key(2)), make_entry("pixel_latent", 2))  # served, not kept


def test_claims_are_exclusive_between_machines_and_expire(s3: str, url: str, tmp_path: Path) -> None:
    a = remote(url, s3, tmp_path / "a", lease_seconds=600)
    b = remote(url, s3, tmp_path / "b", lease_seconds=600)
    held = a.claim("pixel_latent", key())
    assert held is not None
    assert b.claim("pixel_latent", key()) is None
    assert a.claim("pixel_latent", key()) is None  # a second claim of one process is refused too
    held.release()
    again = b.claim("pixel_latent", key())
    assert again is not None
    again.release()
    # A claimer that dies: its lease expires, and exactly one other process takes it over.
    dead = remote(url, s3, tmp_path / "c", lease_seconds=0.05)
    assert dead.claim("pixel_latent", key(1)) is not None
    import time

    time.sleep(0.1)
    taken = [a.claim("pixel_latent", key(1)), b.claim("pixel_latent", key(1))]
    assert sum(c is not None for c in taken) == 1
    for c in taken:
        if c is not None:
            c.release()
    assert b.claim("pixel_latent", key(1)) is not None
    # What dead writers leave is swept: an expired lease in the bucket, a temp file in the node's copy.
    gone = remote(url, s3, tmp_path / "d", lease_seconds=0.01)
    assert gone.claim("pixel_latent", key(2)) is not None
    from qie.cache.files import temp_name

    (tmp_path / "d" / "pixel_latent" / "ab").mkdir(parents=True)
    (tmp_path / "d" / "pixel_latent" / "ab" / temp_name(key(3), pid=2**22 + 1)).write_bytes(b"half")
    time.sleep(0.05)
    assert gone.sweep_temp() == 2
    assert a.claim("pixel_latent", key(2)) is not None and not list((tmp_path / "d").rglob("*.tmp"))


def test_the_start_up_check_reads_the_index_not_each_entry(s3: str, url: str, tmp_path: Path) -> None:
    writer = writing(url, s3, tmp_path / "a")
    items = [("pixel_latent", key(n)) for n in range(40)]
    for t, k in items:
        writer.put(t, k, {"latent": torch.full((2,), float(len(k)))})
    writer.flush()
    reader = remote(url, s3, tmp_path / "b")
    assert reader.intact_all(items + [("pixel_latent", key("x"))], remember=True) == [True] * 40 + [False]
    assert reader.store.requests <= 4  # a listing of the index and its segment(s), and one probe of the miss
    # Entries written by a writer whose index never reached the store are found by their headers and, with
    # `remember`, indexed: the next check again reads the index only.
    lost = remote(url, s3, tmp_path / "c")
    lost.index.flush_every = 10**9
    lost.put("pixel_latent", key("late"), make_entry("pixel_latent"))
    lost.index._pending.clear()
    more = [*items, ("pixel_latent", key("late"))]
    assert remote(url, s3, tmp_path / "d").intact_all(more, remember=True) == [True] * 41
    fresh = remote(url, s3, tmp_path / "e")
    assert fresh.intact_all(more) == [True] * 41 and fresh.store.requests <= 4


def test_the_index_of_every_type_a_start_up_checks_is_two_requests(s3: str, url: str, tmp_path: Path) -> None:
    """One listing of the index folder and one read of all the types' segments at once, however many segments
    (several writers) and types there are; each entry's record as its writer indexed it."""
    types = ["pixel_latent", "control_latent", "prompt_embed", "empty_prompt_embed"]
    items = [(t, key(f"{t}{n}")) for t in types for n in range(3)]
    for w in range(3):  # three writers: three segments of each type
        writer = writing(url, s3, tmp_path / f"w{w}")
        for t, k in items[w::3]:
            writer.put(t, k, make_entry(t))
        writer.flush()
    assert len(raw_fs(s3).find(f"{url}/.index/")) == 12
    reader = remote(url, s3, tmp_path / "r")
    assert reader.intact_all(items) == [True] * len(items)
    assert reader.store.requests == 2
    one_by_one = remote(url, s3, tmp_path / "o")
    assert {t: one_by_one.index.records(t) for t in types} == {t: reader.index.records(t) for t in types}
    assert one_by_one.store.requests == 2 * len(types)  # per type a listing and one read of its 3 segments
    assert reader.intact_all([*items, ("pixel_latent", key("x"))])[-1] is False


def test_precompute_plans_from_the_index_and_checks_the_store_under_a_claim(s3: str, url: str, tmp_path: Path) -> None:
    writer = writing(url, s3, tmp_path / "a")
    writer.put("pixel_latent", key(0), make_entry("pixel_latent"))
    writer.flush()
    reader = remote(url, s3, tmp_path / "b")
    assert reader.intact("pixel_latent", key(0)) and not reader.intact("pixel_latent", key(1))
    before = reader.store.requests
    assert [reader.intact("pixel_latent", key(n)) for n in range(2, 50)] == [False] * 48
    assert reader.store.requests == before  # planning a set costs no request per entry
    other = writing(url, s3, tmp_path / "c")
    held = other.claim("pixel_latent", key(1))
    other.put("pixel_latent", key(1), make_entry("pixel_latent", 1))
    held.release()  # indexed before the claim goes
    assert not reader.intact("pixel_latent", key(1))  # this reader's index was read before
    mine = reader.claim("pixel_latent", key(1))
    assert mine is not None and reader.intact("pixel_latent", key(1))  # under a claim: the store itself
    mine.release()
    assert remote(url, s3, tmp_path / "d").intact("pixel_latent", key(1))


def test_admin_actions_stay_inside_the_prefix(s3: str, url: str, tmp_path: Path) -> None:
    fs = raw_fs(s3)
    prefix = url.removeprefix("s3://")
    foreign = [f"{prefix}-other/pixel_latent/{key()[:2]}/{key()}.safetensors", f"{BUCKET}/unrelated.txt",
               f"{prefix}/pixel_latent/notes.txt", f"{prefix}/README"]  # fmt: skip
    for name in foreign:
        fs.pipe_file(name, b"not ours")
    b = remote(url, s3, tmp_path / "a")
    b.check_access(write=True)
    for n in range(3):
        b.put("pixel_latent", key(n), make_entry("pixel_latent", n))
    assert b.stats()["pixel_latent"]["count"] == 3
    assert b.verify().corrupt == []
    dry = b.unused({"pixel_latent": {key(0)}})
    assert dry["pixel_latent"]["count"] == 2 and b.stats()["pixel_latent"]["count"] == 3
    assert b.unused({"pixel_latent": {key(0)}}, remove=True)["pixel_latent"]["count"] == 2
    assert b.keys("pixel_latent") == [key(0)]
    assert b.clear() == 1
    assert b.stats()["pixel_latent"]["count"] == 0
    assert all(fs.cat_file(name) == b"not ours" for name in foreign)


def test_build_backend_passes_the_remote_settings(s3: str, url: str, tmp_path: Path) -> None:
    from qie.checks import compose
    from qie.config import typed
    from qie.config.backend import build_backend

    remote = [
        "cache=remote",
        f"cache.backend.url={url}",
        f"cache.backend.endpoint_url={s3}",
        f"cache.backend.local_dir={tmp_path / 'l'}",
    ]
    cfg = compose("train", [*remote, "cache.backend.local_max_gb=0.5", f"cache.dir={tmp_path}"])
    b = build_backend(typed(cfg.cache))  # as the stages build it: the yaml's keys are the backend's own
    assert isinstance(b, RemoteBackend) and b.local.max_bytes == 2**29
    with pytest.raises(CacheDirMissing, match="nothing is cached"):
        b.check_access()
    # The node-local copy's limit is the backend's setting: its range is checked when the stage builds it.
    bad = compose("train", [*remote, "cache.backend.local_max_gb=-1", f"cache.dir={tmp_path}"])
    with pytest.raises(ConfigError) as refused:
        build_backend(typed(bad.cache))
    assert str(refused.value) == (
        "cache.backend.local_max_gb=-1.0 is out of range: give the node-local copy's limit in GiB, above 0 (e.g. "
        "500), or leave it unset for no limit"
    )


def test_an_unreachable_endpoint_is_named_in_one_line(url: str, tmp_path: Path) -> None:
    endpoint = f"http://127.0.0.1:{free_port()}"
    b = RemoteBackend(url=url, endpoint_url=endpoint, local_dir=tmp_path, retries=2, backoff=0.01, timeout=1)
    with pytest.raises(StorageError) as e:
        b.check_access(write=True)
    message = str(e.value)
    assert endpoint in message and "unreachable after 2 tries" in message and "\n" not in message


def test_a_missing_bucket_is_named(s3: str, tmp_path: Path) -> None:
    b = remote("s3://no-such-bucket/cache", s3, tmp_path)
    with pytest.raises(StorageError, match="no-such-bucket.*the bucket does not exist"):
        b.check_access(write=True)
    with pytest.raises(CacheDirMissing, match="nothing is cached"):
        b.check_access()


def test_wrong_credentials_are_named_in_one_line(s3: str, url: str, tmp_path: Path, monkeypatch) -> None:
    from moto import settings

    monkeypatch.setattr(settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)  # the server now checks every request's key
    b = remote(url, s3, tmp_path)
    with pytest.raises(StorageError) as e:
        b.check_access(write=True)
    message = str(e.value)
    assert s3 in message and "denied" in message and "credentials" in message and "\n" not in message
    assert b.store.requests == 1  # refused credentials are not retried


def test_a_server_that_dies_mid_run_ends_in_one_error_after_bounded_retries(s3: str, url: str, tmp_path: Path) -> None:
    import time

    port = free_port()  # a second server of its own (moto's servers in one process share their buckets)
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    b = RemoteBackend(url=url, endpoint_url=endpoint, local_dir=tmp_path, retries=3, backoff=0.05, timeout=1)
    b.check_access(write=True)
    b.put("pixel_latent", key(0), make_entry("pixel_latent"))
    server.stop()
    assert b.get("pixel_latent", key(0)) is not None  # this node's copy needs no server
    start = time.monotonic()
    with pytest.raises(StorageError, match=f"{endpoint}.*unreachable after 3 tries"):
        b.get("pixel_latent", key(1))
    assert time.monotonic() - start < 30
    b.index._pending.clear()  # nothing can be written there any more


def _read_in_child(backend: RemoteBackend, k: str, out) -> None:
    entry = backend.get("pixel_latent", k)
    out.put(None if entry is None else entry.checksum)


def test_a_forked_loader_worker_reads_through_its_own_connection(s3: str, url: str, tmp_path: Path) -> None:
    import multiprocessing

    writer = writing(url, s3, tmp_path / "a")
    writer.put("pixel_latent", key(1), make_entry("pixel_latent", 1))
    reader = remote(url, s3, tmp_path / "b")
    assert reader.intact_all([("pixel_latent", key(1))]) == [True]  # the parent used its client before the fork
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=_read_in_child, args=(reader, key(1), out))
    child.start()
    got = out.get(timeout=60)
    child.join(timeout=60)
    assert got == writer.get("pixel_latent", key(1)).checksum and child.exitcode == 0


def test_the_start_up_check_of_counted_entries_reads_the_index_type_by_type(s3: str, url: str, tmp_path: Path) -> None:
    """The bulk check (`intact_counted` of per-type key lists) answers from the index in two requests, checks each
    prompt entry's base (present, under the checksum the prompt entry recorded), and a miss falls back to the
    entry-by-entry check, which names it."""
    from qie.cache.base import EntryCounts
    from qie.cache.entries import write_entries

    writer = writing(url, s3, tmp_path / "w")
    base, prompts = key("base"), [key(f"p{n}") for n in range(3)]
    for n, k in enumerate(prompts):
        empty = torch.arange(8.0).reshape(4, 2)
        embeds = {"empty_prompt_embed": {"embed": empty}, "prompt_embed": {"embed": torch.cat([empty, empty + n])}}
        write_entries(writer, {"empty_prompt_embed": base, "prompt_embed": k}, embeds)
    writer.flush()
    assert all(writer.index.get("prompt_embed", k)[2].startswith(f"empty_prompt_embed/{base}/") for k in prompts)
    counts = EntryCounts({"prompt_embed": (prompts, [2, 1, 1]), "empty_prompt_embed": ([base], [4])})
    reader = remote(url, s3, tmp_path / "r")
    assert reader.intact_counted(counts) and reader.store.requests == 2
    missing = EntryCounts({"prompt_embed": ([*prompts, key("gone")], [1, 1, 1, 1])})
    assert not remote(url, s3, tmp_path / "m").intact_counted(missing)
    # The base rewritten under another checksum: its prompt entries are no longer whole.
    writer.put("empty_prompt_embed", base, {"embed": torch.ones(4, 2)})
    writer.flush()
    assert not remote(url, s3, tmp_path / "b").intact_counted(counts)


def test_an_index_segment_of_the_json_form_is_read_and_merged_into_the_columns(s3: str, url: str, tmp_path: Path,
                                                                                caplog) -> None:  # fmt: skip
    """Segments written in the JSON form before are read as they were, and the next merge replaces them with a
    segment of columns; a damaged segment is ignored with a warning (its entries then found by their headers)."""
    import json

    from qie.cache import remote_index, remote_segments

    writer = writing(url, s3, tmp_path / "w")
    items = [("pixel_latent", key(n)) for n in range(remote_index.MERGE_ABOVE + 2)]
    for t, k in items:
        writer.put(t, k, make_entry(t))
    writer.flush()
    records = remote(url, s3, tmp_path / "r").index.records("pixel_latent")
    fs = raw_fs(s3)
    for name in fs.find(f"{url}/.index/pixel_latent/"):
        fs.rm(name)
    for n, (k, record) in enumerate(records.items()):  # one JSON segment per entry, as writers of that form left
        doc = {"format": remote_segments.FORMAT_JSON, "type": "pixel_latent", "entries": {k: list(record)}}
        fs.pipe(f"{url}/.index/pixel_latent/old-{n}.json", json.dumps(doc).encode())
    reader = remote(url, s3, tmp_path / "j")
    assert reader.index.records("pixel_latent") == records  # read, and merged (more than MERGE_ABOVE segments)
    left = fs.find(f"{url}/.index/pixel_latent/")
    assert len(left) == 1 and left[0].endswith(".safetensors")
    assert remote(url, s3, tmp_path / "k").index.records("pixel_latent") == records
    fs.pipe(f"{url}/.index/pixel_latent/bad.safetensors", b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}")
    with caplog.at_level(logging.WARNING):
        assert remote(url, s3, tmp_path / "d").intact_all(items) == [True] * len(items)
    assert "bad.safetensors is unreadable" in caplog.text


def test_an_index_segment_round_trips_packed_or_as_text() -> None:
    """Hex-digest keys and one-algorithm checksums are kept as their bytes (a segment half the size of text);
    any other keys or checksums as text; every form reads back to the same records."""
    import json
    import struct

    from qie.cache.remote_segments import decode, encode

    def meta(data: bytes) -> dict:
        (n,) = struct.unpack("<Q", data[:8])
        return json.loads(data[8 : 8 + n])["__metadata__"]

    base = f"empty_prompt_embed/{key('b')}/xxh3_64:{0:016x}"
    digests = {key(n): (100 + n, f"xxh3_64:{n:016x}", "" if n % 2 else base) for n in range(50)}
    packed = encode(digests, "prompt_embed")
    assert decode(packed, "prompt_embed") == digests
    assert meta(packed)["keys"] == "hex:" and meta(packed)["checksums"] == "hex:xxh3_64:"
    names = {f"k{n}": (n, f"xxh3_64:{n:016x}", "") for n in range(50)}  # keys that are no digests
    mixed = {key(0): (1, "xxh3_64:00", ""), key(1): (2, "blake3:0011", "")}  # two algorithms, odd widths
    for entries in (names, mixed, {}):
        data = encode(entries, "pixel_latent")
        assert decode(data, "pixel_latent") == entries
    assert "keys" not in meta(encode(names, "pixel_latent")) and "checksums" not in meta(encode(mixed, "t"))
    assert len(packed) < 0.7 * len(encode({k.upper(): v for k, v in digests.items()}, "prompt_embed"))  # keys as text
    with pytest.raises(ValueError, match="not an index segment of this type"):
        decode(packed, "pixel_latent")


def test_a_backend_told_to_read_ahead_reads_the_index_once_beside_the_caller(s3: str, url: str, tmp_path: Path) -> None:
    """With `read_ahead` the index of the named types is read on a thread of its own as the backend is built; the
    start-up check then takes what it read (no request of its own). Against a server that is not there, building
    still returns at once, and the check names the endpoint as before."""
    types = ["pixel_latent", "prompt_embed"]
    items = [(t, key(f"{t}{n}")) for t in types for n in range(3)]
    writer = writing(url, s3, tmp_path / "w")
    for t, k in items:
        writer.put(t, k, make_entry(t))
    writer.flush()
    ahead = remote(url, s3, tmp_path / "a", read_ahead=types)
    ahead.index._ahead[1].wait(30)
    made = ahead.store.requests
    assert made == 2  # one listing of the index folder, one read of all the segments
    assert ahead.intact_all(items) == [True] * len(items) and ahead.store.requests == made
    assert ahead.index._ahead is None  # used once
    assert remote(url, s3, tmp_path / "b").intact_all(items) == [True] * len(items)

    import time

    gone = f"http://127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    dead = RemoteBackend(url=url, endpoint_url=gone, local_dir=tmp_path / "d", retries=1, backoff=0.01,
                         read_ahead=types)  # fmt: skip
    assert time.monotonic() - t0 < 2
    with pytest.raises(StorageError, match="127.0.0.1"):
        dead.check_access()
    dead.index._ahead[1].wait(30)
    with pytest.raises(StorageError, match="127.0.0.1"):
        dead.intact_all(items)
