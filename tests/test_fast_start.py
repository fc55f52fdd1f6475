"""A warm start at scale: the manifest's scan remembered by its signature, keys of samples that share images
taken with one stat per image, and a whole-set check that looks at each shared entry file once; every change
(a manifest row, an image, an entry file) is still caught."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch
from helpers import write_solid_image

import qie.data.manifest as manifest
from qie.cache import folders
from qie.cache.entries import write_entries
from qie.cache.keys import FileHasher, entry_key
from qie.cache.ssd import SsdBackend
from qie.data.key_memo import KeyMemo
from qie.data.keys import KeyContext, sample_keys
from qie.data.scan import scan_dataset
from qie.embedding.readiness import ready_samples
from qie.embedding.sources import CachedSource
from qie.errors import CacheMissError

CTX = KeyContext("vae0", "te0", "tmpl", 4096, "area", 16, 4096, 4096)
TYPES = ("pixel_latent", "control_latent", "prompt_embed", "empty_prompt_embed")


def _data_set(root: Path, pairs: int = 2, per_pair: int = 3) -> Path:
    """A manifest of `pairs` target/control image pairs, `per_pair` prompts on each."""
    rows = []
    for i in range(pairs):
        write_solid_image(root / "t" / f"{i}.png", (i, 0, 0))
        write_solid_image(root / "c" / f"{i}.png", (0, i, 0))
        for j in range(per_pair):
            rows.append({"id": f"s{i}_{j}", "target": f"t/{i}.png", "controls": [f"c/{i}.png"], "prompt": f"p{i} {j}"})
    path = root / "manifest.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _scan(path: Path, cache: Path):
    return scan_dataset(path, "manifest", index_dir=cache / "manifests")


def _no_row_parsing(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(row):
        raise AssertionError("a manifest row was parsed")

    monkeypatch.setattr(manifest, "_row_fields", refuse)


def test_a_remembered_scan_equals_the_scan_and_parses_no_row(tmp_path: Path, monkeypatch) -> None:
    path, cache = _data_set(tmp_path / "ds"), tmp_path / "cache"
    assert _scan(path, cache).samples and not (cache / "manifests").exists()  # no cache folder: nothing written
    cache.mkdir()
    first = _scan(path, cache)
    assert len(list((cache / "manifests").glob("*.safetensors"))) == 1
    with monkeypatch.context() as mp:
        _no_row_parsing(mp)
        again = _scan(path, cache)
    assert again.samples == first.samples == scan_dataset(path, "manifest").samples
    assert [s.id for s in again.samples] == ["s0_0", "s0_1", "s0_2", "s1_0", "s1_1", "s1_2"]
    assert again.samples[0].target == tmp_path / "ds" / "t" / "0.png"
    # Other settings are another scan.
    assert scan_dataset(path, "manifest", require_target=False, index_dir=cache / "manifests").samples == first.samples
    assert len(list((cache / "manifests").glob("*.safetensors"))) == 2


def test_an_edited_row_a_removed_image_or_a_damaged_index_scan_the_rows_again(tmp_path: Path) -> None:
    path, cache = _data_set(tmp_path / "ds"), tmp_path / "cache"
    cache.mkdir()
    _scan(path, cache)
    lines = path.read_text().splitlines()
    row = json.loads(lines[1])
    lines[1] = json.dumps({**row, "prompt": "an edited prompt"})
    path.write_text("\n".join(lines) + "\n")
    assert [s.prompt for s in _scan(path, cache).samples][:3] == ["p0 0", "an edited prompt", "p0 2"]
    assert [s.prompt for s in _scan(path, cache).samples][:3] == ["p0 0", "an edited prompt", "p0 2"]

    (tmp_path / "ds" / "c" / "1.png").unlink()  # the manifest is unchanged; an image it names is gone
    data = _scan(path, cache)
    assert [s.id for s in data.samples] == ["s0_0", "s0_1", "s0_2"]
    assert [p.id for p in data.problems] == ["s1_0", "s1_1", "s1_2"] and "does not exist" in data.problems[0].reason
    write_solid_image(tmp_path / "ds" / "c" / "1.png", (0, 1, 0))  # back again: its samples too
    assert len(_scan(path, cache).samples) == 6

    for index in (cache / "manifests").glob("*.safetensors"):
        index.write_bytes(b"not a safetensors file")
    assert len(_scan(path, cache).samples) == 6


def _cached(root: Path, path: Path) -> tuple[CachedSource, list, SsdBackend]:
    """A cache holding every entry of the data set's samples (tiny tensors), and a source reading it."""
    cache = root / "cache"
    backend = SsdBackend(cache)
    samples = _scan(path, cache).samples
    g = torch.Generator().manual_seed(0)
    empty = torch.randn(5, 4, generator=g)
    entries = {
        "pixel_latent": {"latent": torch.randn(4, 1, 2, 2, generator=g)},
        "control_latent": {"0": torch.randn(4, 1, 2, 2, generator=g)},
        "prompt_embed": {"embed": torch.cat([empty[:3], torch.randn(2, 4, generator=g)])},
        "empty_prompt_embed": {"embed": empty},
    }
    for s in samples:
        write_entries(backend, sample_keys(s, CTX, FileHasher()), entries)
    source = CachedSource(backend, CTX, FileHasher(cache / "file_hashes.json"), memo_dir=str(cache / "sample_keys"))
    time.sleep(2 * folders.TICK_NS / 1e9)  # a check's stamp is a clock tick behind it: let the writes fall before it
    return source, samples, backend


def test_keys_of_samples_sharing_images_take_one_stat_per_image(tmp_path: Path, monkeypatch) -> None:
    path = _data_set(tmp_path / "ds", pairs=2, per_pair=3)
    source, samples, _ = _cached(tmp_path, path)
    expected = [sample_keys(s, CTX, FileHasher()) for s in samples]
    assert source.keys_all(samples) == expected
    stats: list[str] = []
    real_stat = os.stat
    monkeypatch.setattr(os, "stat", lambda p, *a, **k: stats.append(os.fspath(p)) or real_stat(p, *a, **k))
    assert source.keys_all(samples) == expected
    assert sorted(stats) == sorted(str(tmp_path / "ds" / d / f"{i}.png") for d in "tc" for i in range(2))
    assert (source.memo.hits, source.memo.misses) == (6, 6)
    monkeypatch.undo()

    # A touched image (rewritten with other pixels) re-keys exactly the samples that use it.
    source.remember_keys()
    write_solid_image(tmp_path / "ds" / "t" / "1.png", (9, 9, 9))
    warm = CachedSource(source.backend, CTX, FileHasher(), memo_dir=str(tmp_path / "cache" / "sample_keys"))
    got = warm.keys_all(samples)
    assert (warm.memo.hits, warm.memo.misses) == (3, 3)
    assert got[:3] == expected[:3] and got[3:] == [sample_keys(s, CTX, FileHasher()) for s in samples[3:]]
    assert all(g["pixel_latent"] != e["pixel_latent"] for g, e in zip(got[3:], expected[3:]))

    (tmp_path / "ds" / "c" / "0.png").unlink()  # an image gone: its samples are unreadable, the others keyed
    got = warm.keys_all(samples)
    assert all(isinstance(k, FileNotFoundError) for k in got[:3]) and all(isinstance(k, dict) for k in got[3:])


@pytest.mark.parametrize("check", ["folders", "files"])
def test_a_removed_or_rewritten_entry_file_is_refused_by_name(tmp_path: Path, monkeypatch, check: str) -> None:
    path = _data_set(tmp_path / "ds", pairs=2, per_pair=3)
    source, samples, backend = _cached(tmp_path, path)
    source.backend = backend = SsdBackend(tmp_path / "cache", verify_reads=True, startup_check=check)
    run = tmp_path / "run"
    assert ready_samples(source, samples, run, "stop") == samples  # stamps the set
    with monkeypatch.context() as mp:
        # Remembered keys: the set is checked in bulk, under the stamp the sample-by-sample check wrote (one
        # stat per folder of the set, or per distinct entry file; no header read).
        def refuse(*args, **kwargs):
            raise AssertionError("checked sample by sample, or a header read")

        mp.setattr(SsdBackend, "intact_all", refuse)
        mp.setattr(SsdBackend, "_quick", refuse)
        mp.setattr(os, "listdir", refuse)  # every entry existed: no folder is listed
        stats: list[str] = []
        real_stat = os.stat
        mp.setattr(os, "stat", lambda p, *a, **k: stats.append(os.fspath(p)) or real_stat(p, *a, **k))
        assert ready_samples(source, samples, run, "stop") == samples
    entry_files = [p for p in stats if p.endswith(".safetensors") and "/sample_keys/" not in p]
    keys = [source.keys(s) for s in samples]
    distinct = {(t, k[t]) for k in keys for t in TYPES}
    assert len(distinct) == 2 * 3 + 6  # a prompt each, the latents and the empty prompt of each image pair
    if check == "files":
        assert len(entry_files) == len(distinct)
    else:
        folders = {f"{tmp_path}/cache/{t}" for t in TYPES} | {f"{tmp_path}/cache/{t}/{k[:2]}" for t, k in distinct}
        assert entry_files == [] and sorted(p for p in stats if p in folders) == sorted(folders)

    # A shared entry rewritten in place (damaged): found before the first step file by file, else by its read
    # (header and size, or the checksum alone for the same size).
    shared = backend.path("control_latent", keys[0]["control_latent"])
    good = shared.read_bytes()
    shared.write_bytes(good[:40])
    if check == "files":
        with pytest.raises(CacheMissError, match="3 of 6 samples"):
            ready_samples(source, samples, run, "stop")
    else:
        assert ready_samples(source, samples, run, "stop") == samples
    with pytest.raises(CacheMissError, match="(?s)'s0_0' .* a damaged cached control_latent .* cache.repair=true"):
        source.get(samples[:1])
    shared.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))  # the same size: only the checksum can tell
    with pytest.raises(CacheMissError, match="'s0_1' .* a damaged cached control_latent"):
        source.get(samples[1:2])
    shared.write_bytes(good[:40])

    # An entry removed changes its shard folder: the set is looked at file by file, the rewrite found too.
    backend.path("prompt_embed", keys[4]["prompt_embed"]).unlink()
    with pytest.raises(CacheMissError, match="4 of 6 samples .* the first is 's1_1' \\(prompt_embed\\)"):
        ready_samples(source, samples, run, "stop")
    report = json.loads((run / "cache_report.json").read_text())
    assert report["missing"] == [{"id": "s1_1", "types": ["prompt_embed"]}]
    assert [r["id"] for r in report["damaged"]] == ["s0_0", "s0_1", "s0_2"]
    assert report["damaged"][0]["types"] == ["control_latent"]


def test_a_folder_check_sees_entries_added_removed_or_replaced_and_lists_only_a_set_with_gaps(tmp_path: Path) -> None:
    b = SsdBackend(tmp_path)
    items = [(t, entry_key(t, {"i": i})) for t in ("pixel_latent", "prompt_embed") for i in range(6)]
    for t, k in items[:-1]:  # the last is never written
        b.put(t, k, {"x" if t == "pixel_latent" else "embed": torch.zeros(2)})
    time.sleep(2 * folders.TICK_NS / 1e9)  # a stamp is a clock tick behind its check: writes fall before it
    assert b.intact_all(items, remember=True) == [True] * 11 + [False]
    stamp = next((tmp_path / ".checked").iterdir())
    assert folders.read_stamp(str(stamp))[1] == {"folders", "keys"}  # a set with a gap: its folders are listed
    listed: list[str] = []
    real = os.listdir
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(os, "listdir", lambda p: listed.append(p) or real(p))
        mp.setattr(SsdBackend, "_quick", lambda *a: pytest.fail("a header was read"))
        assert b.intact_all(items) == [True] * 11 + [False]
    assert sorted(listed) == sorted({str(b.path(t, k).parent) for t, k in items[:-1]})  # an absent one: not listed
    assert not b.path(*items[-1]).parent.exists()

    # Replaced (a finished file renamed over it), removed, or added: that set is checked file by file again.
    t, k = items[0]
    other = tmp_path / "other.safetensors"
    other.write_bytes(b.path(t, k).read_bytes()[:30])
    os.replace(other, b.path(t, k))
    assert b.intact_all(items, remember=True) == [False] * 1 + [True] * 10 + [False]
    b.put(t, k, {"x": torch.zeros(2)})
    b.put(*items[-1], {"embed": torch.zeros(2)})
    time.sleep(2 * folders.TICK_NS / 1e9)
    assert b.intact_all(items, remember=True) == [True] * 12
    assert folders.read_stamp(str(stamp))[1] == {"all", "folders", "keys"}  # every entry there: nothing is listed
    since = folders.read_stamp(str(stamp))[0]

    def entry_stats(check) -> int:
        seen: list[str] = []
        real = os.stat
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(os, "stat", lambda p, *a, **k: seen.append(os.fspath(p)) or real(p, *a, **k))
            mp.setattr(SsdBackend, "_quick", lambda *a: pytest.fail("a header was read"))
            assert check() == [True] * 12
        return len([p for p in seen if p.endswith(".safetensors")])

    # A stamp of before headers named their keys (its time alone): the headers are read once, and stamped anew.
    stamp.write_text(str(since))
    assert b.intact_all(items, remember=True) == [True] * 12
    assert folders.read_stamp(str(stamp))[1] == {"all", "folders", "keys"}
    # A stamp that does not say what the folders showed: checked file by file once, then it says what it found.
    stamp.write_text(f"{since} keys")
    assert entry_stats(lambda: b.intact_all(items, remember=True)) == 12
    assert folders.read_stamp(str(stamp)) == (since, {"all", "folders", "keys"})
    assert entry_stats(lambda: b.intact_all(items)) == 0

    # A file system that does not keep folder times (the folders older than their files): file by file, always.
    real_ctimes = folders.ctimes
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(folders, "ctimes", lambda ps: [0 if not p.endswith(".safetensors") else c
                                                  for p, c in zip(ps, real_ctimes(ps))])  # fmt: skip
        stamp.write_text(f"{since} keys")
        assert entry_stats(lambda: b.intact_all(items, remember=True)) == 12
        assert folders.read_stamp(str(stamp)) == (since, {"all", "keys"})
        assert entry_stats(lambda: b.intact_all(items, remember=True)) == 12
    assert entry_stats(lambda: SsdBackend(tmp_path, startup_check="files").intact_all(items, remember=True)) == 12
    assert folders.read_stamp(str(stamp)) == (since, {"all", "keys"})  # the files check says nothing of folders

    b.path(*items[5]).unlink()
    assert b.intact_all(items) == [True] * 5 + [False] + [True] * 6


def test_the_check_token_counts_each_entry_as_often_as_it_is_named() -> None:
    """Shared entries are stat'ed once, but the token of the set is the one repeated items always gave (stamps
    written before stay valid)."""
    a, b = ("pixel_latent", "ab" * 32), ("prompt_embed", "cd" * 32)
    salt = folders._TYPE_SALT
    total = 3 * (int(a[1][:16], 16) ^ salt[a[0]]) + (int(b[1][:16], 16) ^ salt[b[0]])
    assert folders.checked_token([a, b, a, a]) == f"4-{total % (1 << 64):016x}"
    assert folders.checked_token([a, a, b, a]) == folders.checked_token([b, a, a, a])
    assert folders.checked_token([a, b]) != folders.checked_token([a, b, a])
    memo = KeyMemo(None, CTX, lambda s: {})
    assert memo.keys_all([]) == []


def test_the_bulk_check_counts_and_names_entries_as_the_item_by_item_one() -> None:
    """The bulk check's distinct keys and counts equal `np.unique`'s (also when two keys share their first 8
    bytes), and the token of its per-type arrays is the one the mapping of the same entries gives."""
    import numpy as np

    from qie.cache.base import EntryCounts
    from qie.embedding.readiness import distinct_rows

    rng = np.random.default_rng(0)
    rows = rng.integers(0, 256, (300, 32), dtype=np.uint8)[rng.integers(0, 300, 2000)]
    rows[5, :8] = rows[6, :8]  # the same first 8 bytes, other keys
    rows[5, 31] = rows[6, 31] ^ 1
    for case in (rows, rows[7:]):
        distinct, times = distinct_rows(case)
        expected, counts = np.unique(case, axis=0, return_counts=True)
        order = np.lexsort(distinct.T[::-1])
        assert np.array_equal(distinct[order], expected) and np.array_equal(times[order], counts)
    distinct, times = distinct_rows(rows[7:])
    keys = [bytes(r).hex() for r in distinct]
    prefixes = np.ascontiguousarray(distinct[:, :8]).view(">u8").reshape(-1).astype(np.uint64)
    sevens = times[:3] * 0 + 7
    bulk = EntryCounts({"prompt_embed": (keys, times, prefixes), "pixel_latent": (keys[:3], sevens, prefixes[:3])})
    plain = {("prompt_embed", k): int(n) for k, n in zip(keys, times)}
    plain.update({("pixel_latent", k): 7 for k in keys[:3]})
    assert folders.counted_token(bulk) == folders.counted_token(plain) == folders.counted_token(EntryCounts.of(plain))
    assert dict(bulk) == plain and len(bulk) == len(plain)
