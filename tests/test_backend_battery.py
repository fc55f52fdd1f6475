"""One contract over every cache backend: what stages, readiness and admin rely on, whatever stores the entries.

A backend joins by adding its name and its `cache` overrides to `BACKENDS`; each is built from the composed
config as the stages build it (`qie.config.backend.build_backend`). The cases ask the backend what it is
(`stores`, `persists`) where the contract differs: a backend that stores nothing misses everything, and only a
backend whose entries outlive the process is shared by other processes (claims that exclude, temp files that
a dead writer leaves behind). `flat` is defined outside qie (tests/flat_backend.py), with a constructor
parameter of its own, and also runs precompute and cached training here.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from helpers import CachedData, count_constructions, small_config

from qie.cache import CACHE_TYPES, CacheBackend
from qie.cache.admin import run_admin
from qie.cache.codec import checksum
from qie.cache.keys import entry_key
from qie.checks import compose
from qie.config import typed
from qie.config.backend import build_backend

BACKENDS = {
    "ssd": ["cache=ssd"],
    "memory": ["cache=memory"],
    "none": ["cache=none"],
    "flat": ["cache.backend._target_=flat_backend.FlatBackend", "+cache.backend.suffix=.entry"],
    # fsspec's local file system stands in for a bucket here (tests/test_cache_remote.py runs a real S3 server)
    "remote": ["cache=remote", "cache.backend.url=file://{root}/store", "cache.backend.local_dir={root}/local-copy"],
}
TESTS = Path(__file__).parent


def build(name: str, root: Path) -> CacheBackend:
    """The backend `name`, its storage (if any) in `root/store`, built from the config as a stage builds it."""
    overrides = [o.format(root=root) for o in BACKENDS[name]]
    if name == "remote":  # a bucket exists before the cache in it
        (root / "store").mkdir(parents=True, exist_ok=True)
    return build_backend(typed(compose("cache", [*overrides, f"cache.dir={root / 'store'}"]).cache))


def entry(seed: int, rows: int = 5) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"embed": torch.randn(rows, 8, generator=g).bfloat16(), "extra": torch.arange(seed, seed + 3)}


def key(name: str | int) -> str:
    return entry_key("pixel_latent", {"n": name})


def files(folder: Path) -> dict[str, bytes]:
    """Every regular file under `folder` (links not followed) and its bytes."""
    out = {}
    for dirpath, _, names in os.walk(folder):
        for n in names:
            p = Path(dirpath) / n
            if not p.is_symlink():
                out[str(p.relative_to(folder))] = p.read_bytes()
    return out


@pytest.fixture(params=list(BACKENDS))
def case(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, CacheBackend, Path]:
    backend = build(request.param, tmp_path)
    backend.check_access(write=True)
    return request.param, backend, tmp_path


def test_it_is_a_backend_that_says_what_it_is(case) -> None:
    _, b, _ = case
    assert isinstance(b, CacheBackend)
    assert isinstance(b.stores, bool) and isinstance(b.persists, bool) and (b.stores or not b.persists)
    assert isinstance(b.remote_reads, bool)


def test_put_get_round_trip_bitwise(case) -> None:
    _, b, _ = case
    want = entry(1)
    assert isinstance(b.put("prompt_embed", key(1), want, {"note": "x"}), int)
    got = b.get("prompt_embed", key(1))
    assert b.exists("prompt_embed", key(1)) == b.stores and (got is not None) == b.stores
    if b.stores:
        assert list(got) == list(want) and got.meta["note"] == "x"
        for name, t in want.items():
            assert got[name].dtype == t.dtype and torch.equal(got[name].view(-1).view(torch.uint8),
                                                              t.view(-1).view(torch.uint8))  # fmt: skip
    assert b.get("prompt_embed", key(2)) is None and b.get("pixel_latent", key(1)) is None  # other key, other type
    with pytest.raises(ValueError):
        b.put("latents", key(1), want)
    with pytest.raises(ValueError):
        b.get("prompt_embed", "../escape")


def test_intact_and_the_bulk_check_follow_each_entry_and_its_base(case) -> None:
    _, b, _ = case
    base = entry(2, rows=7)
    b.put("empty_prompt_embed", key("base"), base)
    meta = {"base": f"empty_prompt_embed/{key('base')}", "base_checksum": checksum(base)}
    b.put("prompt_embed", key("p"), entry(3), meta)
    p, e, missing = ("prompt_embed", key("p")), ("empty_prompt_embed", key("base")), ("prompt_embed", key("none"))
    assert b.intact(*p) == b.stores and not b.intact(*missing)
    assert b.intact_all([p, e, missing, p]) == [b.stores, b.stores, False, b.stores]
    assert b.intact_counted({p: 2, e: 1}, remember=True) == b.stores
    assert b.intact_counted({p: 2, e: 1}) == b.stores  # what was remembered still holds
    assert not b.intact_counted({p: 1, missing: 1})
    b.put("empty_prompt_embed", key("base"), entry(4, rows=7))  # the base changed: the extension is not whole
    assert not b.intact(*p) and b.intact(*e) == b.stores
    assert not b.intact_counted({p: 1})


def test_claims_exclude_other_writers_of_a_shared_cache(case) -> None:
    _, b, _ = case
    held = b.claim("pixel_latent", key(1))
    assert held is not None
    # A persistent cache is shared by other runs: a second claim is refused while the first is held.
    assert (b.claim("pixel_latent", key(1)) is None) == b.persists
    other = b.claim("pixel_latent", key(2))
    assert other is not None
    held.release()
    other.release()
    again = b.claim("pixel_latent", key(1))
    assert again is not None
    again.release()


def test_the_shared_documents_reach_every_user_of_a_cache_that_outlives_the_process(case) -> None:
    """The failure list goes through `shared`: another instance on the same storage (another process, another
    node) reads what one wrote, where the entries outlive the process; updates merge."""
    name, b, root = case
    assert b.shared.read("list.json") is None
    b.shared.update("list.json", lambda data: (data or b"") + b"a")
    b.shared.update("list.json", lambda data: None)  # None keeps the document as it is
    other = build(name, root).shared
    other.update("list.json", lambda data: (data or b"") + b"b")
    assert b.shared.read("list.json") == (b"ab" if b.persists else b"a")
    assert other.read("list.json") == (b"ab" if b.persists else b"b")


def test_stats_clear_and_verify_count_the_entries(case) -> None:
    _, b, _ = case
    for n in range(3):
        b.put("pixel_latent", key(n), entry(n))
    b.put("prompt_embed", key(0), entry(9))
    assert b.keys("pixel_latent") == (sorted(key(n) for n in range(3)) if b.stores else [])
    stats = b.stats()
    assert set(stats) == set(CACHE_TYPES)
    assert stats["pixel_latent"]["count"] == 3 * b.stores and stats["prompt_embed"]["count"] == b.stores
    assert (stats["pixel_latent"]["bytes"] > 0) == b.stores and stats["control_latent"] == {"count": 0, "bytes": 0}
    assert list(b.stats(["prompt_embed"])) == ["prompt_embed"]
    report = b.verify()
    assert report.checked == 4 * b.stores and report.corrupt == []
    assert b.verify(fix=True).removed == 0 and b.verify(["pixel_latent"]).checked == 3 * b.stores
    assert b.clear(["pixel_latent"]) == 3 * b.stores
    assert b.stats()["pixel_latent"]["count"] == 0 and b.exists("prompt_embed", key(0)) == b.stores
    assert b.clear() == b.stores and b.stats()["prompt_embed"]["count"] == 0


def test_gc_removes_what_nothing_keeps_and_keeps_the_bases(case) -> None:
    _, b, _ = case
    for n in range(3):
        b.put("pixel_latent", key(n), entry(n))
    base = entry(5, rows=7)
    b.put("empty_prompt_embed", key("base"), base)
    meta = {"base": f"empty_prompt_embed/{key('base')}", "base_checksum": checksum(base)}
    b.put("prompt_embed", key("p"), entry(6), meta)
    keep = {"pixel_latent": {key(0)}, "prompt_embed": {key("p")}}
    unused = b.unused(keep)
    assert unused["pixel_latent"]["count"] == 2 * b.stores and unused["empty_prompt_embed"]["count"] == 0
    assert b.stats()["pixel_latent"]["count"] == 3 * b.stores  # a dry run removes nothing
    assert b.unused(keep, remove=True)["pixel_latent"]["count"] == 2 * b.stores
    assert [b.exists("pixel_latent", key(n)) for n in range(3)] == [b.stores, False, False]
    assert b.intact("prompt_embed", key("p")) == b.stores and b.unused(keep)["pixel_latent"]["count"] == 0


CHILD = """
import os, sys
from pathlib import Path
sys.path.insert(0, {tests!r})
from test_backend_battery import build, entry, key
b = build({name!r}, Path({root!r}))
claim = b.claim("pixel_latent", key("dead"))
os.replace = lambda *a: os._exit(3)  # the writer dies as it publishes the entry
b.put("pixel_latent", key("dead"), entry(0))
"""


def test_what_a_dead_writer_leaves_is_swept_and_nothing_else(case) -> None:
    name, b, root = case
    if name == "remote":
        pytest.skip("one PUT per entry leaves no temp file to die in; test_cache_remote.py expires a dead claim")
    b.put("pixel_latent", key(1), entry(1))
    live = b.claim("pixel_latent", key(2))  # a writer still at work: its claim is not swept
    before = files(root / "store")
    if b.persists:  # only a cache that outlives a process can be left anything by a dead one
        child = CHILD.format(tests=str(TESTS), name=name, root=str(root))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        run = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True)
        assert run.returncode == 3, run.stderr.decode()[-2000:]
    left = set(files(root / "store")) - set(before)
    assert bool(left) == b.persists
    assert b.sweep_temp() == len(left)
    assert files(root / "store") == before and b.sweep_temp() == 0
    assert not b.exists("pixel_latent", key("dead")) and b.intact("pixel_latent", key(1)) == b.stores
    assert (b.claim("pixel_latent", key(2)) is None) == b.persists  # the live claim still holds
    live.release()


def test_admin_never_touches_anything_outside_its_own_storage(case) -> None:
    _, b, root = case
    for n in range(2):
        b.put("pixel_latent", key(n), entry(n))
    store, outside = root / "store", root / "outside"
    (outside / "ab").mkdir(parents=True)
    store.mkdir(exist_ok=True)
    (outside / "ab" / f"{key(7)}.safetensors").write_bytes(b"an entry-like file outside the cache")
    (outside / f"control_latent.{key(7)}.entry").write_bytes(b"another")
    (root / "beside.txt").write_text("a file beside the cache folder")
    (store / "notes.txt").write_text("a user's file inside it")
    # Links inside the storage that point out of it, named as a type folder and as an entry file.
    (store / "control_latent").symlink_to(outside, target_is_directory=True)
    (store / f"control_latent.{key(7)}.entry").symlink_to(outside / f"control_latent.{key(7)}.entry")
    (store / "layer_latent").symlink_to(root / "beside.txt")

    def foreign() -> dict[str, bytes]:
        return {**{f"outside/{k}": v for k, v in files(outside).items()}, "beside": (root / "beside.txt").read_bytes()}

    before = foreign()
    assert b.stats()["control_latent"]["count"] == 0  # links are never counted as entries
    for action in ("stats", "verify"):
        run_admin(b, action, fix=True)
    b.unused({}, remove=True)
    b.sweep_temp()
    run_admin(b, "clear")
    assert all(s["count"] == 0 for s in b.stats().values())
    assert foreign() == before and (store / "notes.txt").read_text() == "a user's file inside it"
    assert (store / "control_latent").is_symlink() and (store / f"control_latent.{key(7)}.entry").is_symlink()


def test_a_backend_from_outside_qie_runs_precompute_and_cached_training(
    cached_data: CachedData, tmp_path: Path
) -> None:
    """`cache.backend._target_` with a parameter of its own: precompute fills it and cached training reads it, with the
    losses the ssd cache gives (tests/test_train.py) and no encoder built."""
    from test_train import LOSSES, TRAINING

    from qie.stages import precompute
    from qie.stages import train as train_stage

    flat = [*BACKENDS["flat"], f"data.path={cached_data.data}", f"cache.dir={tmp_path / 'flat'}"]
    summary = precompute.run(small_config("precompute", *flat), tmp_path / "precompute")
    stored = {p.name.split(".")[0] for p in (tmp_path / "flat").iterdir() if p.name.endswith(".entry")}
    assert summary.failures == [] and {"pixel_latent", "control_latent", "prompt_embed"} <= stored
    assert not (tmp_path / "flat" / "pixel_latent").exists()  # its own layout, not the ssd backend's
    with pytest.MonkeyPatch.context() as mp:
        from test_train import ENCODERS

        counts = count_constructions(mp, ENCODERS)
        result = train_stage.run(small_config("train", *flat, *TRAINING), tmp_path / "train")
    assert counts == Counter()
    assert result["losses"] == pytest.approx(LOSSES, rel=1e-6), f"losses: {result['losses']}"


def test_a_backends_own_keys_pass_validation_and_others_are_named() -> None:
    """`cache.backend` holds the class and its own settings; a key its constructor does not take, a stages' key
    written there, or a backend's key written at the stages' level is refused in one line saying where it goes."""
    from qie.errors import ConfigError

    assert compose("cache", BACKENDS["flat"]).cache.backend.suffix == ".entry"

    def refused(overrides: list[str]) -> str:
        with pytest.raises(ConfigError) as info:
            compose("cache", overrides)
        return str(info.value)

    ssd = "unknown key cache.backend.bucket: qie.cache.ssd.SsdBackend takes startup_check"
    assert refused(["+cache.backend.bucket=x"]) == ssd
    flat = "unknown key cache.backend.bucket: flat_backend.FlatBackend takes suffix"
    assert refused([*BACKENDS["flat"], "+cache.backend.bucket=x"]) == flat
    assert refused(["+cache.backend.dir=/x"]) == (
        "cache.backend.dir is the stages' setting: set cache.dir (a backend that takes it is given it)"
    )
    assert refused(["cache=remote", "+cache.url=s3://b/p"]) == (
        "cache.url is an old spelling: write cache=remote cache.backend.url=s3://b/p"
    )
