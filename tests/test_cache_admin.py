"""Cache keys (file hashes, entry keys) and the admin commands: stats, clear, verify, in-process and CLI."""

from __future__ import annotations

import builtins
import hashlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import qie
from qie.cache import CACHE_TYPES, keys
from qie.cache.admin import cache_stats, clear_cache, format_bytes, run_admin, verify_cache
from qie.cache.keys import FileHasher, entry_key
from qie.cache.memory import MemoryBackend
from qie.cache.ssd import SsdBackend
from qie.checks import compose
from qie.errors import ConfigError
from qie.stages.cache_admin import run

PROMPT_FIELDS = {"prompt": "make it blue", "controls": ["ab" * 32], "size": [64, 64], "text_encoder": "fp1"}


@pytest.fixture
def open_counter(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts `open` calls per absolute path."""
    counts: dict[str, int] = {}
    real_open = builtins.open

    def counting_open(file, *args, **kwargs):
        if isinstance(file, str | os.PathLike):
            p = os.path.abspath(file)
            counts[p] = counts.get(p, 0) + 1
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", counting_open)
    return counts


def test_file_hash_matches_hashlib_and_is_remembered_by_stat(tmp_path: Path, open_counter) -> None:
    f = tmp_path / "img.png"
    f.write_bytes(b"pixels" * 1000)
    h = FileHasher(None)
    assert h.hash(f) == hashlib.sha256(b"pixels" * 1000).hexdigest()
    assert h.hash(str(f)) == h.hash(os.path.relpath(f)) == hashlib.sha256(b"pixels" * 1000).hexdigest()
    assert open_counter == {str(f): 1} and h.files_read == 1

    st = f.stat()
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 1000))  # touched, same bytes: read again
    assert h.hash(f) == hashlib.sha256(b"pixels" * 1000).hexdigest()
    assert open_counter[str(f)] == 2

    f.write_bytes(b"other")
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 1000))  # same mtime, new size
    assert h.hash(f) == hashlib.sha256(b"other").hexdigest()
    assert open_counter[str(f)] == 3 and h.files_read == 3


def test_same_size_replacement_with_its_mtime_kept_is_hashed_again(tmp_path: Path) -> None:
    f, new = tmp_path / "img.png", tmp_path / "new.png"
    f.write_bytes(b"AAAA")
    index = tmp_path / "file_hashes.json"
    h = FileHasher(index)
    assert h.hash(f) == hashlib.sha256(b"AAAA").hexdigest()
    h.save()
    st = f.stat()
    new.write_bytes(b"BBBB")
    os.utime(new, ns=(st.st_atime_ns, st.st_mtime_ns))  # `cp -p` / `rsync -t` / tar keep the mtime
    os.replace(new, f)  # same path, same size, same mtime
    assert (f.stat().st_size, f.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    warm = FileHasher(index)
    assert warm.hash(f) == hashlib.sha256(b"BBBB").hexdigest() and warm.files_read == 1
    time.sleep(0.05)  # past the kernel's coarse timestamp tick
    f.write_bytes(b"CCCC")  # rewritten in place (same inode), mtime put back: the ctime still moves
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert warm.hash(f) == hashlib.sha256(b"CCCC").hexdigest() and warm.files_read == 2


def test_file_hash_index_persists_and_merges_across_hashers(tmp_path: Path, open_counter) -> None:
    index = tmp_path / "idx" / "file_hashes.json"
    a, b = tmp_path / "a.png", tmp_path / "b.png"
    a.write_bytes(b"a")
    b.write_bytes(b"b")
    first, second = FileHasher(index), FileHasher(index)  # two processes starting together
    first.hash(a)
    first.save()
    second.hash(b)
    second.save()  # merges: does not drop what `first` saved
    assert set(json.loads(index.read_text())["paths"]) == {str(a), str(b)}
    assert not list(index.parent.glob("*.tmp"))

    before = dict(open_counter)
    warm = FileHasher(index)
    assert len(warm) == 2
    assert warm.hash(a) == hashlib.sha256(b"a").hexdigest() and warm.hash(b) == hashlib.sha256(b"b").hexdigest()
    assert warm.files_read == 0 and open_counter[str(a)] == before[str(a)] and open_counter[str(b)] == before[str(b)]
    assert len(second) == 2  # saving picked up the other process's entries too


def test_file_hash_index_unreadable_is_ignored(tmp_path: Path, caplog) -> None:
    index = tmp_path / "idx.json"
    index.write_text("{not json")
    h = FileHasher(index)
    assert len(h) == 0 and "unreadable" in caplog.text
    (tmp_path / "x").write_bytes(b"x")
    h.hash(tmp_path / "x")
    h.save()
    assert len(FileHasher(index)) == 1


def test_file_hash_index_of_100k_files_loads_whole(tmp_path: Path) -> None:
    # How fast it loads is measured by scripts/bench_startup.py, not asserted here.
    index = tmp_path / "idx.json"
    t = 1_700_000_000_000_000_000
    entries = {
        f"/data/set/{i:06d}.png": ((123456 + i, t + i, t + 2 * i, 1000 + i), f"{i:064x}") for i in range(100_000)
    }
    keys._write_index(index, entries)
    h = FileHasher(index)
    assert len(h) == 100_000
    p = "/data/set/000042.png"
    assert h._entries[p] == entries[p]


def test_entry_key_is_stable_and_depends_on_every_field() -> None:
    want = "2be5f181c4c3a148595439cac9fbfeff63bf1aa3741a958288b7927f39d094b2"
    assert entry_key("prompt_embed", PROMPT_FIELDS) == want
    assert entry_key("prompt_embed", dict(reversed(PROMPT_FIELDS.items()))) == want
    canonical = json.dumps(
        {"schema": 2, "type": "prompt_embed", **PROMPT_FIELDS}, sort_keys=True, separators=(",", ":")
    )
    assert hashlib.sha256(canonical.encode()).hexdigest() == want
    changed = [
        {**PROMPT_FIELDS, "prompt": "make it red"},
        {**PROMPT_FIELDS, "controls": ["cd" * 32]},
        {**PROMPT_FIELDS, "controls": ["ab" * 32, "ab" * 32]},
        {**PROMPT_FIELDS, "size": [64, 32]},
        {**PROMPT_FIELDS, "text_encoder": "fp2"},
        {**PROMPT_FIELDS, "template": "x"},
    ]
    keys = {entry_key("prompt_embed", f) for f in changed} | {entry_key("empty_prompt_embed", PROMPT_FIELDS), want}
    assert len(keys) == len(changed) + 2
    with pytest.raises(ValueError, match="unknown cache type"):
        entry_key("prompt", PROMPT_FIELDS)
    with pytest.raises(ValueError, match="may not be named"):
        entry_key("prompt_embed", {"type": "x"})
    with pytest.raises(TypeError, match="not a JSON value"):
        entry_key("prompt_embed", {"path": Path("a.png")})


def filled_ssd(root: Path) -> SsdBackend:
    b = SsdBackend(root)
    for i in range(3):
        b.put("prompt_embed", entry_key("prompt_embed", {"i": i}), {"embed": torch.zeros(256, 2, dtype=torch.bfloat16)})
    b.put("pixel_latent", entry_key("pixel_latent", {"i": 0}), {"latent": torch.zeros(8)})
    return b


def test_format_bytes() -> None:
    assert [format_bytes(n) for n in (0, 1023, 1024, 1536, 5 * 2**20, int(2.3 * 2**30), 3 * 2**50)] == [
        "0 B",
        "1023 B",
        "1.0 KiB",
        "1.5 KiB",
        "5.0 MiB",
        "2.3 GiB",
        "3.0 PiB",
    ]


def test_stats_report(tmp_path: Path) -> None:
    b = filled_ssd(tmp_path)
    sizes = b.stats()
    text = str(cache_stats(b))
    lines = text.splitlines()
    assert lines[0] == f"cache: SsdBackend(dir={str(tmp_path)!r})"
    assert [line.split()[0] for line in lines[1:]] == CACHE_TYPES + ["total"]
    pe = sizes["prompt_embed"]["bytes"]
    assert re.fullmatch(rf"prompt_embed +3 entries +{re.escape(format_bytes(pe))}", lines[3])
    assert re.fullmatch(r"pixel_latent +1 entry +\d+ B", lines[1])
    assert re.fullmatch(r"control_latent +0 entries +0 B", lines[2])
    assert lines[-1].split()[:3] == ["total", "4", "entries"]
    assert str(cache_stats(b, ["pixel_latent"])).count("\n") == 2


def test_clear_and_verify_reports(tmp_path: Path) -> None:
    b = filled_ssd(tmp_path)
    bad = b.path("prompt_embed", entry_key("prompt_embed", {"i": 0}))
    bad.write_bytes(b"garbage")
    report = verify_cache(b)
    assert report.exit_code == 1 and report.verify.unfixed == 1
    assert "checked 4 entries: 1 corrupt" in report.text and str(bad) in report.text
    assert "1 entry left: run again with verify.fix=true" in report.text
    fixed = verify_cache(b, ["prompt_embed"], fix=True)
    assert fixed.exit_code == 0 and "removed 1 entry" in fixed.text and not bad.exists()
    assert verify_cache(b).text.splitlines()[1] == "checked 3 entries: 0 corrupt"

    cleared = clear_cache(b, ["prompt_embed"])
    assert "prompt_embed  removed 2 entries" in cleared.text and cleared.text.endswith("removed 2 entries in all")
    assert b.stats()["pixel_latent"]["count"] == 1
    with pytest.raises(ValueError, match="unknown cache action"):
        run_admin(b, "purge")


def test_cli_run_in_process(tmp_path: Path, capsys) -> None:
    b = filled_ssd(tmp_path)
    (tmp_path / "prompt_embed" / "zz").mkdir()
    (tmp_path / "prompt_embed" / "zz" / ("zz" + "0" * 62 + ".safetensors")).write_bytes(b"\0" * 9)
    assert run(compose("cache", [f"cache.dir={tmp_path}", "action=verify"])) == 1
    assert "1 corrupt" in capsys.readouterr().out
    assert run(compose("cache", [f"cache.dir={tmp_path}", "action=verify", "verify.fix=true"])) == 0
    assert run(compose("cache", [f"cache.dir={tmp_path}", "action=clear", "cache.types=[prompt_embed]"])) == 0
    assert "removed 3 entries in all" in capsys.readouterr().out
    assert b.stats()["prompt_embed"]["count"] == 0 and b.stats()["pixel_latent"]["count"] == 1
    assert run(compose("cache", ["cache=memory", "action=stats"])) == 0
    assert "total" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="cache.types: unknown cache type 'latents'"):
        run(compose("cache", [f"cache.dir={tmp_path}", "cache.types=[latents]"]))
    with pytest.raises(ConfigError, match=r"cache\.backend\._target_='qie\.cache\.nope\.Backend'"):
        run(compose("cache", [f"cache.dir={tmp_path}", "cache.backend._target_=qie.cache.nope.Backend"]))
    with pytest.raises(ConfigError, match="cache.dir is not set"):
        run(compose("cache", ["cache.dir=null"]))
    assert run_admin(MemoryBackend(), "verify").exit_code == 0


@pytest.mark.subprocess
def test_cli_stats_subprocess(tmp_path: Path) -> None:
    filled_ssd(tmp_path / "cache")
    env = {**os.environ, "PYTHONPATH": str(Path(qie.__file__).parents[1])}
    cmd = [sys.executable, "-m", "qie.cache", "action=stats", f"cache.dir={tmp_path / 'cache'}"]
    out = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert re.search(r"^prompt_embed +3 entries +\d+(\.\d)? (B|KiB)$", out.stdout, re.M), out.stdout
    assert re.search(r"^total +4 entries ", out.stdout, re.M), out.stdout
