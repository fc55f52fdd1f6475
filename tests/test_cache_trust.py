"""Cache format v2 and admin safety: checksums find bit flips, the shared prompt prefix reads back
bit-identical, masks are derived, admin actions stay inside cache.dir, claims, storage errors."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from qie.cache.admin import run_admin
from qie.cache.entries import read_entries, read_logical, shared_rows, write_entries
from qie.cache.keys import entry_key
from qie.cache.memory import MemoryBackend
from qie.cache.ssd import SsdBackend
from qie.errors import StorageError
from qie.types import CACHE_TYPES, SampleEmbeddings, pad_prompt_embeds


def bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def sample(seed: int, prefix: torch.Tensor, prompt_rows: int = 5, dtype=torch.float32) -> dict[str, dict]:
    """A sample's entries as the Encoder gives them: prompt and empty prompt share `prefix`."""
    g = torch.Generator().manual_seed(seed)
    return {
        "pixel_latent": {"latent": torch.randn(16, 1, 4, 6, generator=g).to(dtype)},
        "control_latent": {"0": torch.randn(16, 1, 4, 6, generator=g).to(dtype)},
        "prompt_embed": {"embed": torch.cat([prefix, torch.randn(prompt_rows, 8, generator=g).to(dtype)])},
        # the empty prompt's rows depend on the control images only
        "empty_prompt_embed": {"embed": torch.cat([prefix, prefix[:3].flip(0) * 0.5])},
    }


def keys_of(control: int, prompt: int) -> dict[str, str]:
    keys = {
        "pixel_latent": entry_key("pixel_latent", {"p": prompt}),
        "control_latent": entry_key("control_latent", {"c": control}),
        "prompt_embed": entry_key("prompt_embed", {"c": control, "p": prompt}),
        "empty_prompt_embed": entry_key("empty_prompt_embed", {"c": control}),
    }
    keys["prompt_embeds_mask"], keys["empty_prompt_embeds_mask"] = keys["prompt_embed"], keys["empty_prompt_embed"]
    return keys


@pytest.fixture(params=["ssd", "memory"])
def backend(request: pytest.FixtureRequest, tmp_path: Path):
    return SsdBackend(tmp_path / "cache") if request.param == "ssd" else MemoryBackend()


def test_shared_prefix_reads_back_bit_identical_and_stores_half_the_rows(backend) -> None:
    prefix = torch.randn(40, 8, generator=torch.Generator().manual_seed(9))
    prefix[0, :3] = torch.tensor([-0.0, 1e-40, 3.0e38])
    written = {}
    for p in range(3):  # three instructions on one control image
        entries = sample(p, prefix, prompt_rows=4 + p)
        written[p] = (entries, write_entries(backend, keys_of(0, p), entries))
    for p, (entries, _) in written.items():
        found, missing = read_entries(backend, keys_of(0, p), ["pixel_latent", "prompt_embed", "empty_prompt_embed"])
        assert missing == []
        prefix_view, suffix = found["prompt_embed"]["embed"]
        assert prefix_view.shape == (40, 8) and suffix.shape == (4 + p, 8)
        item = SampleEmbeddings("s", found["pixel_latent"]["latent"], (), found["prompt_embed"]["embed"],
                                found["empty_prompt_embed"]["embed"])  # fmt: skip
        assert bits(item.prompt_embed) == bits(entries["prompt_embed"]["embed"])
        assert bits(item.empty_prompt_embed) == bits(entries["empty_prompt_embed"]["embed"])
        assert bits(read_logical(backend, "prompt_embed", keys_of(0, p)["prompt_embed"])) == bits(
            entries["prompt_embed"]["embed"]
        )
        assert read_logical(backend, "prompt_embeds_mask", keys_of(0, p)["prompt_embed"]).tolist() == [1] * (44 + p)
        assert read_logical(backend, "empty_prompt_embeds_mask", keys_of(0, p)["empty_prompt_embed"]).sum() == 43
    stats = backend.stats()
    assert stats["prompt_embeds_mask"]["count"] == stats["empty_prompt_embeds_mask"]["count"] == 0
    assert stats["prompt_embed"]["count"] == 3 and stats["empty_prompt_embed"]["count"] == 1
    if isinstance(backend, MemoryBackend):  # payload bytes: 3 suffixes of 4..6 rows + one base of 43 rows
        assert stats["prompt_embed"]["bytes"] == (4 + 5 + 6) * 8 * 4
        assert stats["empty_prompt_embed"]["bytes"] == 43 * 8 * 4
    # collate copies the pieces straight into its batch
    batch, mask = pad_prompt_embeds([found["prompt_embed"]["embed"], entries["prompt_embed"]["embed"][:10]])
    assert bits(batch[0]) == bits(entries["prompt_embed"]["embed"]) and mask[1].sum() == 10


def test_prefix_equal_within_the_dtype_is_shared_and_its_difference_recorded(tmp_path: Path) -> None:
    prefix = torch.randn(30, 8, generator=torch.Generator().manual_seed(1)).bfloat16()
    entries = sample(0, prefix, dtype=torch.bfloat16)
    nudged = entries["prompt_embed"]["embed"].clone()
    nudged.view(torch.int16)[7, 2] += 1  # one last bit, as another GPU kernel may give
    entries["prompt_embed"]["embed"] = nudged
    b = SsdBackend(tmp_path)
    write_entries(b, keys_of(0, 0), entries)
    meta = b.get("prompt_embed", keys_of(0, 0)["prompt_embed"]).meta
    assert meta["prefix_rows"] == "30" and float(meta["prefix_max_diff"]) > 0
    got = read_logical(b, "prompt_embed", keys_of(0, 0)["prompt_embed"])
    assert bits(got[30:]) == bits(nudged[30:]) and bits(got[:30]) == bits(prefix)
    other = torch.randn(12, 8).bfloat16()  # nothing in common: stored whole
    assert shared_rows(other, prefix) == (0, 0.0)


def test_a_rewritten_base_makes_its_prompts_misses(tmp_path: Path) -> None:
    b = SsdBackend(tmp_path)
    prefix = torch.randn(20, 8)
    write_entries(b, keys_of(0, 0), sample(0, prefix))
    k = keys_of(0, 0)
    assert b.intact("prompt_embed", k["prompt_embed"])
    b.put("empty_prompt_embed", k["empty_prompt_embed"], {"embed": torch.randn(23, 8)})  # another base
    assert not b.intact("prompt_embed", k["prompt_embed"])
    assert read_entries(b, k, ["prompt_embed", "empty_prompt_embed"])[1] == ["prompt_embed"]
    report = b.verify(["prompt_embed"])
    assert [c.reason.split(" (")[0] for c in report.corrupt] == [
        f"its base entry empty_prompt_embed/{k['empty_prompt_embed']} was rewritten"
    ]
    b.path("empty_prompt_embed", k["empty_prompt_embed"]).unlink()
    assert "is missing or damaged" in b.verify(["prompt_embed"], fix=True).corrupt[0].reason
    assert not b.exists("prompt_embed", k["prompt_embed"])


@pytest.mark.parametrize("type", ["pixel_latent", "control_latent", "prompt_embed"])
def test_every_flipped_data_bit_is_found_by_verify_and_by_verified_reads(tmp_path: Path, type: str) -> None:
    b = SsdBackend(tmp_path)
    k = entry_key(type, {"t": type})
    b.put(type, k, {"0" if type == "control_latent" else "x": torch.randn(3, 5).bfloat16()})
    path = b.path(type, k)
    good = path.read_bytes()
    data_start = 8 + int.from_bytes(good[:8], "little")
    checking = SsdBackend(tmp_path, verify_reads=True)
    for pos in range(data_start, len(good)):
        for bit in range(8):
            flipped = bytearray(good)
            flipped[pos] ^= 1 << bit
            path.write_bytes(bytes(flipped))
            assert b.intact(type, k)  # the header cannot tell
            assert checking.get(type, k) is None
            report = b.verify([type])
            assert len(report.corrupt) == 1 and "checksum mismatch" in report.corrupt[0].reason, (pos, bit)
    path.write_bytes(good)
    assert b.verify().corrupt == [] and checking.get(type, k) is not None


def test_admin_never_follows_a_symlinked_type_folder_nor_touches_foreign_files(tmp_path: Path) -> None:
    cache, elsewhere = tmp_path / "cache", tmp_path / "precious"
    b = SsdBackend(cache)
    write_entries(b, keys_of(0, 0), sample(0, torch.randn(4, 8)))
    (elsewhere / "ab").mkdir(parents=True)
    foreign = [elsewhere / "ab" / f"{'ab' * 32}.safetensors", elsewhere / "ab" / "model.safetensors"]
    for f in foreign:
        f.write_bytes(b"not mine")
    os.symlink(elsewhere, cache / "prompt_embeds_mask")
    shard = b.path("pixel_latent", keys_of(0, 0)["pixel_latent"]).parent
    mine_not = [shard / "notes.safetensors", shard / "README.txt"]  # not key-named: never an entry
    for f in mine_not:
        f.write_bytes(b"user file")
    report = run_admin(b, "verify", fix=True)
    assert f"skipped {cache / 'prompt_embeds_mask'}: a symlink" in report.text
    assert run_admin(b, "clear").exit_code == 0
    assert all(f.read_bytes() == b"not mine" for f in foreign)
    assert all(f.read_bytes() == b"user file" for f in mine_not)
    assert all(s["count"] == 0 for s in b.stats().values())


@pytest.mark.parametrize("action", ["stats", "verify", "clear"])
def test_admin_on_a_missing_dir_fails_and_creates_nothing(tmp_path: Path, action: str) -> None:
    missing = tmp_path / "typo"
    with pytest.raises(StorageError, match=f"cache.dir '{missing}' does not exist"):
        run_admin(SsdBackend(missing), action)
    assert not missing.exists()


def test_access_checks_name_the_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    a_file = tmp_path / "file"
    a_file.write_text("x")
    for write in (False, True):
        with pytest.raises(StorageError, match=f"cache.dir '{a_file}' is a file, not a folder"):
            SsdBackend(a_file).check_access(write=write)
    SsdBackend(tmp_path / "new").check_access(write=True)
    assert (tmp_path / "new").is_dir() and list((tmp_path / "new").iterdir()) == []

    real_open = os.open

    def denied(path, flags, *a):
        if str(path).startswith(str(tmp_path / "ro")) and flags & os.O_CREAT:
            raise OSError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, flags, *a)

    (tmp_path / "ro").mkdir()
    monkeypatch.setattr(os, "open", denied)
    with pytest.raises(StorageError, match=f"cache.dir '{tmp_path / 'ro'}' is not writable .Permission denied."):
        SsdBackend(tmp_path / "ro").check_access(write=True)


def test_a_full_disk_is_a_storage_error_and_keeps_what_was_cached(tmp_path: Path, monkeypatch) -> None:
    b = SsdBackend(tmp_path)
    k = entry_key("pixel_latent", {})
    b.put("pixel_latent", k, {"latent": torch.ones(3)})

    def full(src: str, dst: str) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("qie.cache.files.os.replace", full)
    with pytest.raises(StorageError, match="No space left on device while writing a cache entry in .* free space"):
        b.put("pixel_latent", k, {"latent": torch.zeros(3)})
    assert b.get("pixel_latent", k)["latent"].tolist() == [1, 1, 1]
    assert [p.name for p in b.path("pixel_latent", k).parent.iterdir()] == [f"{k}.safetensors"]


def test_claims_exclude_other_holders_until_released(tmp_path: Path) -> None:
    b = SsdBackend(tmp_path)
    k = entry_key("pixel_latent", {})
    first = b.claim("pixel_latent", k)
    assert first is not None
    holder = subprocess.run(
        [sys.executable, "-c", f"from qie.cache.ssd import SsdBackend; print(SsdBackend({str(tmp_path)!r})"
         f".claim('pixel_latent', {k!r}) is None)"],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])},
    )  # fmt: skip
    assert holder.stdout.strip() == "True", holder.stderr
    first.release()
    second = b.claim("pixel_latent", k)
    assert second is not None
    second.release()
    assert [p.name for p in b.path("pixel_latent", k).parent.iterdir()] == []  # lock files go with the claim
    lock = b.path("pixel_latent", k).parent / f".{k}.lock"
    lock.write_bytes(b"")  # left by a holder that died
    assert b.sweep_temp() == 1 and not lock.exists()


def test_the_cache_package_imports_no_model_library_config_or_data_code() -> None:
    code = (
        "import sys, pkgutil, importlib, qie.cache\n"
        "for m in pkgutil.iter_modules(qie.cache.__path__):\n"
        "    if m.name != '__main__': importlib.import_module('qie.cache.' + m.name)\n"
        "bad = ('hydra', 'omegaconf', 'diffusers', 'transformers', 'peft', 'qie.data', 'qie.stages', 'qie.embedding',"
        " 'qie.config')\n"
        "print(sorted(m for m in sys.modules if m.startswith(bad)))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.stdout.strip() == "[]", out.stderr
    # the six of the embeddings, loss_mask, layer_latent, rejected_latent, caption and teacher_latent
    assert len(CACHE_TYPES) == 11


def test_a_checked_set_is_rechecked_only_when_a_file_changed(tmp_path: Path, monkeypatch) -> None:
    import qie.cache.ssd as ssd

    monkeypatch.setattr("qie.cache.folders.CHECK_MARGIN_NS", 0)
    b = SsdBackend(tmp_path)
    keys = [keys_of(c, c) for c in range(3)]
    for c, k in enumerate(keys):
        write_entries(b, k, sample(c, torch.randn(4, 8)))
    items = [(t, k[t]) for k in keys for t in ("pixel_latent", "control_latent", "empty_prompt_embed", "prompt_embed")]
    time.sleep(0.05)  # past the kernel's coarse timestamp tick
    assert b.intact_all(items, remember=True) == [True] * 12
    assert len(list((tmp_path / ".checked").iterdir())) == 1
    headers_read = []
    monkeypatch.setattr(b, "_quick", lambda *a: headers_read.append(a) or ssd.SsdBackend._quick(b, *a))
    b.path("pixel_latent", keys[2]["pixel_latent"]).unlink()
    assert b.intact_all(items) == [True] * 8 + [False] + [True] * 3 and headers_read == []  # one stat each
    path = b.path("empty_prompt_embed", keys[0]["empty_prompt_embed"])
    st, data = path.stat(), bytearray(path.read_bytes())
    data[-1] ^= 1  # a flipped bit: the header still holds, the checksum no longer
    path.write_bytes(bytes(data[:-2]))  # and truncated in place, its mtime put back
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    got = b.intact_all(items)
    assert headers_read  # the set changed: every header read again
    assert got[2:4] == [False, False] and got.count(False) == 3  # the base, the prompt on it, the missing one
