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
        out.append(Sample(f"s{i}", target, (control,), f"prompt {i}"))
    out.append(Sample("t2i", root / "t0.png", (), "text only"))
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
    reworded = Sample("s1", samples[1].target, samples[1].controls, "another prompt")
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
