"""Sample keys remembered by their inputs' signatures: equal to the computed keys, recomputed when an input
changes, and a warm start hashes no image and loads no image hash index."""

from __future__ import annotations

import os
from pathlib import Path

from helpers import write_solid_image

from qie.cache.keys import FileHasher
from qie.data.key_memo import KeyMemo
from qie.data.keys import KeyContext, sample_keys
from qie.data.samples import Sample

CTX = KeyContext("vae0", "te0", "tmpl", 4096, "area", 16, 4096, 4096)


def _samples(root: Path, n: int) -> list[Sample]:
    out = []
    for i in range(n):
        target = write_solid_image(root / f"t{i}.png", (i, 0, 0))
        control = write_solid_image(root / f"c{i}.png", (0, i, 0))
        out.append(Sample(id=f"s{i}", target=target, controls=(control,), prompt=f"prompt {i}"))
    out.append(Sample(id="t2i", target=root / "t0.png", controls=(), prompt="text only"))
    return out


def _memo(cache: Path, ctx: KeyContext = CTX) -> tuple[KeyMemo, FileHasher]:
    hasher = FileHasher(cache / "file_hashes.json")
    return KeyMemo(cache / "sample_keys", ctx, lambda s: sample_keys(s, ctx, hasher)), hasher


def test_remembered_keys_equal_computed_ones_and_a_warm_start_hashes_nothing(tmp_path: Path) -> None:
    samples, cache = _samples(tmp_path / "ds", 3), tmp_path / "cache"
    memo, hasher = _memo(cache)
    expected = [sample_keys(s, CTX, FileHasher()) for s in samples]
    assert [memo.keys(s) for s in samples] == expected
    assert (memo.hits, memo.misses) == (0, 4)
    memo.save()
    hasher.save()
    assert len(list((cache / "sample_keys").glob("*.safetensors"))) == 1

    warm, warm_hasher = _memo(cache)
    assert [warm.keys(s) for s in samples] == expected
    assert (warm.hits, warm.misses) == (4, 0)
    assert warm_hasher._index is None and warm_hasher.files_read == 0  # the hash index was not even read

    # Another context (another VAE) keeps its own memo: nothing is reused across contexts.
    other = KeyContext("vae1", "te0", "tmpl", 4096, "area", 16, 4096, 4096)
    memo_other, _ = _memo(cache, other)
    assert memo_other.keys(samples[0]) == sample_keys(samples[0], other, FileHasher())
    assert memo_other.misses == 1


def test_a_changed_image_or_prompt_is_a_miss_with_its_new_keys(tmp_path: Path) -> None:
    samples, cache = _samples(tmp_path / "ds", 2), tmp_path / "cache"
    memo, hasher = _memo(cache)
    before = [memo.keys(s) for s in samples]
    memo.save()
    hasher.save()
    # Rewrite a control image in place with other pixels but the same size and mtime: its ctime still moves.
    control = samples[0].controls[0]
    st = os.stat(control)
    write_solid_image(control, (99, 99, 99))
    os.utime(control, ns=(st.st_atime_ns, st.st_mtime_ns))
    reworded = Sample(id="s1", target=samples[1].target, controls=samples[1].controls, prompt="another prompt")
    warm, _ = _memo(cache)
    assert warm.keys(samples[0]) == sample_keys(samples[0], CTX, FileHasher())
    assert warm.keys(reworded) == sample_keys(reworded, CTX, FileHasher())
    assert (warm.hits, warm.misses) == (0, 2)
    assert before[0]["control_latent"] != warm.keys(samples[0])["control_latent"]
    assert before[0]["pixel_latent"] == warm.keys(samples[0])["pixel_latent"]


def test_a_damaged_memo_is_ignored(tmp_path: Path) -> None:
    samples, cache = _samples(tmp_path / "ds", 1), tmp_path / "cache"
    memo, _ = _memo(cache)
    memo.keys(samples[0])
    memo.save()
    memo.path.write_bytes(b"not a safetensors file")
    fresh, _ = _memo(cache)
    assert fresh.keys(samples[0]) == sample_keys(samples[0], CTX, FileHasher())
    assert fresh.misses == 1


def test_a_memo_written_in_any_order_is_found_row_by_row(tmp_path: Path) -> None:
    """Rows are looked up in a table sorted by signature: a memo file written unsorted (as earlier versions
    wrote it) gives the same keys as one this version wrote."""
    import numpy as np
    from safetensors.numpy import load_file, save_file

    samples, cache = _samples(tmp_path / "ds", 6), tmp_path / "cache"
    memo, _ = _memo(cache)
    expected = memo.keys_all(samples)
    memo.save()
    stored = load_file(str(memo.path))
    reverse = np.arange(len(stored["signatures"]))[::-1].copy()
    save_file({k: v[reverse] for k, v in stored.items()}, str(memo.path), metadata={"format": "qie-sample-keys/1"})
    warm, _ = _memo(cache)
    assert warm.keys_all(samples) == expected and (warm.hits, warm.misses) == (7, 0)
    assert [warm.keys(s) for s in samples] == expected and warm.misses == 0
    assert warm._load().resorted
    warm.save()  # written sorted: the next start finds it so
    again, _ = _memo(cache)
    assert not again._load().resorted and again.keys_all(samples) == expected and again.misses == 0


def _rows_of(keys: list[dict[str, str]]):
    """The rows `rows_all` gives for these keys (ROW_TYPES in order, zeros for a type a sample lacks)."""
    import numpy as np

    from qie.data.key_memo import KEY_BYTES, ROW_TYPES

    blob = b"".join(bytes.fromhex(k[t]) if t in k else bytes(KEY_BYTES) for k in keys for t in ROW_TYPES)
    return np.frombuffer(blob, np.uint8).reshape(len(keys), -1)


def test_a_whole_list_found_again_takes_no_signature_per_sample(tmp_path: Path, monkeypatch, caplog) -> None:
    """A list of samples is remembered with its rows: found again (same prompts, the same images in each role,
    each image's stat unchanged) it is answered from one file; any change to one of them looks samples up one
    by one again, and a sample whose input changed is not remembered (None)."""
    import numpy as np

    import qie.data.key_memo as km

    samples, cache = _samples(tmp_path / "ds", 4), tmp_path / "cache"
    memo, _ = _memo(cache)
    expected = memo.keys_all(samples)
    memo.save()
    warm, _ = _memo(cache)
    assert np.array_equal(warm.rows_all(samples), _rows_of(expected))  # by signature, row by row
    assert not list((cache / "sample_keys" / "lists").glob("*"))  # learnt, not yet saved
    warm.save()
    assert len(list((cache / "sample_keys" / "lists").glob("*.safetensors"))) == 1

    real = km._signatures
    calls: list[int] = []
    monkeypatch.setattr(km, "_signatures", lambda s, seen=None: calls.append(len(s)) or real(s, seen))
    again, _ = _memo(cache)
    assert np.array_equal(again.rows_all(samples), _rows_of(expected)) and calls == []
    # Another order is another list: looked up sample by sample, its rows in its own order.
    shuffled = samples[::-1]
    assert np.array_equal(again.rows_all(shuffled), _rows_of(expected[::-1])) and calls == [5]
    # A sample naming another image in a role (the target as its control): another list.
    swapped = [
        *samples[:-2],
        Sample(id="s3", target=samples[3].target, controls=(samples[3].target,), prompt=samples[3].prompt),
        samples[-1],
    ]
    assert again.rows_all(swapped) is None and calls == [5, 5]
    # An image rewritten in place, its size and mtime put back: its ctime moves, so the list is looked up again
    # and the sample naming it is no longer remembered.
    control = samples[1].controls[0]
    st = os.stat(control)
    write_solid_image(control, (77, 77, 77))
    os.utime(control, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert again.rows_all(samples) is None and calls == [5, 5, 5]

    # A damaged list file is reported and ignored.
    calls.clear()
    write_solid_image(control, (0, 1, 0))  # the pixels it had: keyed as before, under a new signature
    fresh, _ = _memo(cache)
    fresh.keys_all(samples)
    fresh.save()
    fresh2, _ = _memo(cache)
    fresh2.rows_all(samples)
    fresh2.save()
    newest = max((cache / "sample_keys" / "lists").glob("*.safetensors"), key=lambda p: p.stat().st_mtime_ns)
    newest.write_bytes(b"damaged")
    last, _ = _memo(cache)
    with caplog.at_level("WARNING"):
        assert np.array_equal(last.rows_all(samples), _rows_of(expected))
    assert "unreadable" in caplog.text and calls == [5, 5, 5]  # keys_all, the save, and the damaged list


def test_only_the_newest_lists_are_kept(tmp_path: Path) -> None:
    from qie.data.sample_lists import LISTS_KEPT

    samples, cache = _samples(tmp_path / "ds", 6), tmp_path / "cache"
    memo, _ = _memo(cache)
    memo.keys_all(samples)
    memo.save()
    for n in range(2, 2 + LISTS_KEPT + 2):  # six different lists, each saved
        warm, _ = _memo(cache)
        assert warm.rows_all(samples[:n]) is not None
        warm.save()
    kept = list((cache / "sample_keys" / "lists").glob("*.safetensors"))
    assert len(kept) == LISTS_KEPT


def test_one_start_up_stats_each_image_once_but_rechecks_after_hashing(tmp_path: Path, monkeypatch) -> None:
    """Inside `file_stats.once()` the scan's check that an image is a file and the key memo's signature share one
    stat; the memo's check after hashing a sample stats anew, so an image rewritten while it was hashed is not
    remembered under the signature it had before."""
    import time

    from qie.data import file_stats

    samples, cache = _samples(tmp_path / "ds", 3), tmp_path / "cache"
    hasher = FileHasher(cache / "file_hashes.json")
    target, rewrites = samples[0].target, [1]

    def compute(s: Sample) -> dict[str, str]:
        keys = sample_keys(s, CTX, hasher)
        if s.target == target and rewrites:  # rewritten in place (once) while it is keyed
            rewrites.pop()
            time.sleep(0.02)
            target.write_bytes(target.read_bytes())
        return keys

    memo = KeyMemo(cache / "sample_keys", CTX, compute)
    with file_stats.once():
        memo.keys_all(samples)
    assert len(memo._new) == 2  # s1 and s2: not s0 nor the text-only sample, whose target changed meanwhile
    memo.keys_all(samples)  # s0 keyed again, after the rewrite
    memo.save()

    warm, _ = _memo(cache)
    images = {os.fspath(p) for s in samples for p in (s.target, *s.controls)}
    real, stats = os.stat, []
    monkeypatch.setattr(os, "stat", lambda p, *a, **k: stats.append(os.fspath(p)) or real(p, *a, **k))
    with file_stats.once():
        assert all(file_stats.isfile(p) for s in samples for p in (s.target, *s.controls))
        assert warm.rows_all(samples) is not None
    assert sorted(p for p in stats if p in images) == sorted(images)  # one stat each for both
    stats.clear()
    file_stats.isfile(target)
    file_stats.isfile(target)
    assert stats == [os.fspath(target)] * 2  # outside the block every call stats
