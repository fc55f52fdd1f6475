"""Cache backends: exact round trips, the on-disk layout, atomic writes, corrupt files, stats and clear."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import safetensors.torch
import torch
import xxhash

from qie.cache import CACHE_TYPES, SCHEMA_VERSION, CacheBackend
from qie.cache.keys import entry_key
from qie.cache.memory import MemoryBackend
from qie.cache.none import NoneBackend
from qie.cache.ssd import SsdBackend, temp_name
from qie.config.backend import build_backend
from qie.errors import ConfigError


def make_entry(type: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """A realistic entry of `type`, with special values so a bitwise comparison means something."""
    g = torch.Generator().manual_seed(seed)
    if type == "pixel_latent":
        return {"latent": torch.randn(1, 16, 1, 8, 6, generator=g).bfloat16()}
    if type == "control_latent":
        return {"0": torch.randn(1, 16, 1, 8, 8, generator=g).bfloat16(), "1": torch.randn(1, 16, 1, 4, 6)}
    if type.endswith("mask"):
        return {"mask": torch.tensor([1, 1, 1, 0, 2**40], dtype=torch.int64)}
    embed = torch.randn(7, 12, generator=g).bfloat16()
    embed[0, :4] = torch.tensor([float("nan"), float("inf"), -0.0, 1e-40])
    return {"embed": embed, "fp32": torch.randn(3, generator=g)}


def bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def assert_same(got: dict[str, torch.Tensor] | None, want: dict[str, torch.Tensor]) -> None:
    assert got is not None
    assert list(got) == list(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
        assert bits(got[name]) == bits(t), name


def key(n: int | str = 0) -> str:
    return entry_key("pixel_latent", {"n": n})


@pytest.fixture(params=["ssd", "memory"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> CacheBackend:
    return SsdBackend(tmp_path / "cache") if request.param == "ssd" else MemoryBackend()


def all_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def test_every_type_round_trips_bitwise(backend: CacheBackend) -> None:
    for i, type in enumerate(CACHE_TYPES):
        k = entry_key(type, {"i": i})
        entry = make_entry(type, seed=i)
        assert backend.get(type, k) is None and not backend.exists(type, k)
        backend.put(type, k, entry)
        assert backend.exists(type, k)
        assert_same(backend.get(type, k), entry)
    assert backend.get("prompt_embed", entry_key("prompt_embed", {"i": 0})) is None  # types are separate
    assert {t: s["count"] for t, s in backend.stats().items()} == dict.fromkeys(CACHE_TYPES, 1)


def test_views_non_contiguous_and_empty_tensors_round_trip(backend: CacheBackend) -> None:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    entry = {"t": base.t(), "row": base[1], "same": base[1:3], "empty": torch.zeros(0, 5), "scalar": base[0, 0]}
    backend.put("prompt_embed", key(), entry)
    assert_same(backend.get("prompt_embed", key()), entry)


def test_stored_copies_are_independent_of_callers(backend: CacheBackend) -> None:
    entry = make_entry("prompt_embed")
    want = {n: t.clone() for n, t in entry.items()}
    backend.put("prompt_embed", key(), entry)
    entry["embed"].zero_()
    backend.get("prompt_embed", key())["embed"].zero_()
    assert_same(backend.get("prompt_embed", key()), want)


def test_put_returns_bytes_and_stats_are_exact(backend: CacheBackend, tmp_path: Path) -> None:
    written = {t: 0 for t in CACHE_TYPES}
    for i in range(3):
        written["prompt_embed"] += backend.put("prompt_embed", key(i), make_entry("prompt_embed", i))
    written["prompt_embeds_mask"] += backend.put("prompt_embeds_mask", key(), make_entry("prompt_embeds_mask"))
    stats = backend.stats()
    assert list(stats) == CACHE_TYPES
    assert stats == {t: {"count": {"prompt_embed": 3, "prompt_embeds_mask": 1}.get(t, 0), "bytes": b}
                     for t, b in written.items()}  # fmt: skip
    if isinstance(backend, SsdBackend):
        assert sum(written.values()) == sum(p.stat().st_size for p in all_files(tmp_path / "cache"))
    else:
        assert written["prompt_embeds_mask"] == 5 * 8
    mask_stats = {"count": 1, "bytes": written["prompt_embeds_mask"]}
    assert backend.stats(["prompt_embeds_mask"]) == {"prompt_embeds_mask": mask_stats}


def test_clear_per_type_removes_only_that_type(backend: CacheBackend) -> None:
    for i in range(3):
        backend.put("prompt_embed", key(i), make_entry("prompt_embed", i))
    backend.put("pixel_latent", key(), make_entry("pixel_latent"))
    assert backend.clear(["prompt_embed"]) == 3
    assert backend.stats()["prompt_embed"] == {"count": 0, "bytes": 0}
    assert backend.get("prompt_embed", key(0)) is None
    assert_same(backend.get("pixel_latent", key()), make_entry("pixel_latent"))
    assert backend.clear() == 1
    assert all(s["count"] == 0 for s in backend.stats().values())


def test_unknown_type_and_bad_key_are_rejected(backend: CacheBackend) -> None:
    with pytest.raises(ValueError, match="valid types are pixel_latent, control_latent"):
        backend.get("latents", key())
    with pytest.raises(ValueError, match="unknown cache type 'latents'"):
        backend.stats(["prompt_embed", "latents"])
    with pytest.raises(ValueError, match="bad cache key"):
        backend.put("prompt_embed", "../escape", make_entry("prompt_embed"))
    with pytest.raises(ValueError, match="non-empty dict"):
        backend.put("prompt_embed", key(), {})


def test_none_backend_always_misses(tmp_path: Path) -> None:
    b = NoneBackend()
    assert b.put("prompt_embed", key(), make_entry("prompt_embed")) == 0
    assert b.get("prompt_embed", key()) is None and not b.exists("prompt_embed", key())
    assert b.stats() == {t: {"count": 0, "bytes": 0} for t in CACHE_TYPES}
    assert b.clear() == 0 and b.verify().checked == 0
    assert list(tmp_path.iterdir()) == []


def test_ssd_layout_and_no_temp_files(tmp_path: Path) -> None:
    root = tmp_path / "c"
    b = SsdBackend(str(root))
    assert not root.exists()  # nothing is created until a put
    keys = [entry_key("control_latent", {"n": i}) for i in range(20)]
    for k in keys:
        b.put("control_latent", k, make_entry("control_latent"))
    want = sorted(root / "control_latent" / k[:2] / f"{k}.safetensors" for k in keys)
    assert all_files(root) == want
    assert b.path("control_latent", keys[0]) == root / "control_latent" / keys[0][:2] / f"{keys[0]}.safetensors"
    header = safetensors.safe_open(str(want[0]), "pt").metadata()
    assert header["schema"] == str(SCHEMA_VERSION) and header["type"] == "control_latent"
    assert json.loads(header["tensors"]) == {"0": ["BF16", [1, 16, 1, 8, 8]], "1": ["F32", [1, 16, 1, 4, 6]]}
    stored = safetensors.torch.load_file(str(want[0]))
    want_sum = xxhash.xxh3_64(bits(stored["0"]) + bits(stored["1"]))
    assert header["checksum"] == f"xxh3_64:{want_sum.hexdigest()}" and json.loads(header["meta"]) == {}


def test_temp_files_of_killed_writers_are_ignored_then_swept(tmp_path: Path) -> None:
    b = SsdBackend(tmp_path)
    k = key()
    b.put("pixel_latent", k, make_entry("pixel_latent"))
    folder = b.path("pixel_latent", k).parent
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    dead_tmp = folder / temp_name(k, pid=dead.pid)
    old_tmp = folder / temp_name(key(1), pid=1)  # another host's or a long-gone writer: judged by age
    live_tmp = folder / temp_name(key(2))  # this process is still writing it
    for p in (dead_tmp, old_tmp, live_tmp):
        p.write_bytes(b"partial")
    hour_ago = time.time() - 2 * 3600
    os.utime(old_tmp, (hour_ago, hour_ago))

    assert b.stats()["pixel_latent"]["count"] == 1
    assert_same(b.get("pixel_latent", k), make_entry("pixel_latent"))
    report = b.verify()
    assert report.checked == 1 and report.corrupt == []
    assert sorted(report.stale_temp) == sorted([str(dead_tmp), str(old_tmp)])
    report = b.verify(fix=True)
    assert report.temp_removed == 2 and report.removed == 0
    assert sorted(folder.iterdir()) == sorted([b.path("pixel_latent", k), live_tmp])


def test_failed_write_leaves_no_temp_and_keeps_old_entry(tmp_path: Path, monkeypatch) -> None:
    b = SsdBackend(tmp_path)
    b.put("prompt_embed", key(), make_entry("prompt_embed", 0))

    def boom(src: str, dst: str) -> None:
        raise OSError("disk full")

    monkeypatch.setattr("qie.cache.ssd.os.replace", boom)
    with pytest.raises(OSError, match="disk full"):
        b.put("prompt_embed", key(), make_entry("prompt_embed", 1))
    assert len(all_files(tmp_path)) == 1
    assert_same(b.get("prompt_embed", key()), make_entry("prompt_embed", 0))


def corrupt_cache(b: SsdBackend) -> dict[str, str]:
    """Three good entries and five bad ones; returns {key of bad entry: expected reason text}."""
    good = make_entry("prompt_embed")
    for i in range(3):
        b.put("prompt_embed", key(f"good{i}"), good)
    bad = {}
    k = key("truncated")
    b.put("prompt_embed", k, good)
    data = b.path("prompt_embed", k).read_bytes()
    b.path("prompt_embed", k).write_bytes(data[: len(data) - 10])
    bad[k] = "truncated"
    k = key("garbage")
    b.put("prompt_embed", k, good)
    b.path("prompt_embed", k).write_bytes(os.urandom(300))
    bad[k] = "exceeds the file size"
    k = key("schema")
    b.put("prompt_embed", k, good)
    meta = safetensors.safe_open(str(b.path("prompt_embed", k)), "pt").metadata() | {"schema": "999"}
    safetensors.torch.save_file(good, str(b.path("prompt_embed", k)), metadata=meta)
    bad[k] = f"schema '999', expected {SCHEMA_VERSION}"
    k = key("plain")
    b.path("prompt_embed", k).parent.mkdir(parents=True, exist_ok=True)
    safetensors.torch.save_file(good, str(b.path("prompt_embed", k)))
    bad[k] = "unreadable header or metadata"
    k = key("wrongtype")
    b.put("pixel_latent", k, make_entry("pixel_latent"))
    b.path("prompt_embed", k).parent.mkdir(parents=True, exist_ok=True)
    os.replace(b.path("pixel_latent", k), b.path("prompt_embed", k))
    bad[k] = "holds a 'pixel_latent' entry, expected 'prompt_embed'"
    return bad


def test_corrupt_files_miss_with_warning_and_verify_fixes_them(tmp_path: Path, caplog) -> None:
    b = SsdBackend(tmp_path)
    bad = corrupt_cache(b)
    with caplog.at_level(logging.WARNING, logger="qie.cache"):
        for k in bad:
            assert b.get("prompt_embed", k) is None
    assert [r.getMessage().split(" is unreadable")[0] for r in caplog.records] == [
        f"cache entry {b.path('prompt_embed', k)}" for k in bad
    ]
    assert_same(b.get("prompt_embed", key("good0")), make_entry("prompt_embed"))

    report = b.verify()
    assert report.checked == 8 and report.removed == 0 and report.unfixed == 5
    reasons = {c.key: c.reason for c in report.corrupt}
    assert set(reasons) == set(bad)
    for k, text in bad.items():
        assert text in reasons[k], (k, reasons[k])
        assert {c.path for c in report.corrupt if c.key == k} == {str(b.path("prompt_embed", k))}
    assert b.stats()["prompt_embed"]["count"] == 8  # verify without fix changes nothing

    report = b.verify(["prompt_embed"], fix=True)
    assert report.removed == 5 and report.unfixed == 0
    assert b.stats()["prompt_embed"]["count"] == 3
    again = b.verify()
    assert again.checked == 3 and again.corrupt == []


def test_misplaced_and_foreign_files(tmp_path: Path) -> None:
    b = SsdBackend(tmp_path)
    k = key()
    b.put("pixel_latent", k, make_entry("pixel_latent"))
    wrong = tmp_path / "pixel_latent" / "zz" / f"{k}.safetensors"
    wrong.parent.mkdir()
    wrong.write_bytes(b.path("pixel_latent", k).read_bytes())
    (tmp_path / "pixel_latent" / "zz" / "notes.txt").write_text("ignored")
    report = b.verify()
    reason = f"misplaced: belongs in folder {k[:2]}/ (left in place: move or delete it)"
    assert [(c.path, c.reason) for c in report.corrupt] == [(str(wrong), reason)]
    assert b.verify(fix=True).unfixed == 1 and wrong.is_file()  # fix deletes only files in their own folder


def node(target: str, dir: str | None = None, **own: object):
    """A typed `cache` group: `dir` given, and the backend `target` with its `own` settings."""
    from qie.config.cache import CacheConfig

    return CacheConfig(dir=dir, backend={"_target_": target, **own})


def test_build_backend(tmp_path: Path) -> None:
    assert isinstance(build_backend(node("qie.cache.ssd.SsdBackend", str(tmp_path))), SsdBackend)
    assert build_backend(node("qie.cache.ssd.SsdBackend", str(tmp_path)), verify_reads=True).verify_reads
    # dir and verify_reads go only to a constructor that names them: memory and none take no settings.
    assert isinstance(build_backend(node("qie.cache.memory.MemoryBackend", None)), MemoryBackend)
    assert isinstance(build_backend(node("qie.cache.none.NoneBackend", str(tmp_path)), verify_reads=True), NoneBackend)
    with pytest.raises(ConfigError, match="cache.dir is not set"):
        build_backend(node("qie.cache.ssd.SsdBackend", None))
    assert build_backend(node("qie.cache.ssd.SsdBackend", str(tmp_path))).startup_check == "folders"
    files = node("qie.cache.ssd.SsdBackend", str(tmp_path), startup_check="files")
    assert build_backend(files).startup_check == "files"
    with pytest.raises(ConfigError, match="cache.backend.startup_check='entries': expected one of folders, files"):
        build_backend(node("qie.cache.ssd.SsdBackend", str(tmp_path), startup_check="entries"))
    for target in ("qie.cache.nope.Backend", "qie.cache.ssd.Nope", "SsdBackend", "qie.cache.ssd.encode"):
        with pytest.raises(ConfigError, match=rf"cache\.backend\._target_='{target}'"):
            build_backend(node(target, str(tmp_path)))
    with pytest.raises(ConfigError, match="does not implement the CacheBackend protocol"):
        build_backend(node("tempfile.TemporaryDirectory", str(tmp_path)))
    with pytest.raises(ConfigError, match=r"cache\.backend\._target_='qie.cache.memory.MemoryBackend' cannot be built"):
        build_backend(node("qie.cache.memory.MemoryBackend", None, size=3))


def test_damaged_headers_never_raise_or_return_wrong_shapes(tmp_path: Path) -> None:
    b = SsdBackend(tmp_path)
    entry = make_entry("control_latent")
    b.put("control_latent", key(), entry)
    path = b.path("control_latent", key())
    good = path.read_bytes()
    header_end = 8 + int.from_bytes(good[:8], "little")
    g = torch.Generator().manual_seed(0)
    for i in range(300):
        data = bytearray(good)
        if i % 3 == 0:
            data = data[: int(torch.randint(0, len(good), (1,), generator=g))]
        else:
            for pos in torch.randint(0, header_end, (1 + i % 4,), generator=g).tolist():
                data[pos] = int(torch.randint(0, 256, (1,), generator=g))
        path.write_bytes(bytes(data))
        got = b.get("control_latent", key())
        if got is not None:  # a flip that leaves the header meaning the same (e.g. inside a JSON space)
            assert_same(got, entry)
