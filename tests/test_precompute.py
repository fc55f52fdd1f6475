"""The precompute stage on the tiny models (CPU): what it writes, what it skips, how it fails and resumes."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import QwenImageEditPipeline, QwenImageEditPlusPipeline
from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions
from PIL import Image
from stage_edges import encoder_for, hasher_for, key_context_for, sizes_for

from qie.cache.admin import run_admin
from qie.cache.entries import STORED_TYPES, read_logical
from qie.cache.ssd import SsdBackend, temp_name
from qie.checks import compose
from qie.components.tiny import build_tiny_model
from qie.config import typed
from qie.config.backend import build_backend
from qie.data.keys import sample_keys
from qie.data.scan import scan_dataset
from qie.embedding.encode import prepare_sample
from qie.errors import DataError
from qie.models.processor import load_processor
from qie.stages import precompute
from qie.stages.precompute_work import OPTIONAL_TYPES

# What precompute stores of these samples: the mask types are derived from the embeddings, never written, and
# the samples have no layers nor rejected results (tests/test_qwen_image_layered.py stores layer_latent,
# tests/test_family_battery.py rejected_latent).
CACHE_TYPES = [t for t in STORED_TYPES if t not in OPTIONAL_TYPES]
TEXT = ["prompt_embed", "empty_prompt_embed"]
CONTROL_DEPENDENT = ["control_latent", *TEXT]


# ---------------------------------------------------------------- helpers


def _noise(path: Path, seed: int, size: tuple[int, int] = (64, 64)) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(path)
    return path


def _sample(root: Path, stem: str, seed: int, caption: str | None, controls: int = 1, size=(64, 64)) -> None:
    _noise(root / "training_images" / f"{stem}.png", seed, size)
    _noise(root / "control_images" / f"{stem}.png", seed + 50_000, size)
    for n in range(1, controls):
        _noise(root / "control_images" / f"{stem}_control_{n}.png", seed + 90_000 + n, size)
    if caption is not None:
        (root / "training_images" / f"{stem}.txt").write_text(caption, encoding="utf-8")


def _dataset(root: Path, n: int, seed: int = 0, size=(64, 64)) -> Path:
    for i in range(n):
        _sample(root, f"s{i:03d}", seed * 1000 + i, f"Make the sky blue, number {i}.", size=size)
    return root


def _overrides(ds: Path, cache: Path, *extra: str) -> list[str]:
    return [f"data.path={ds}", f"cache.dir={cache}", *extra]


def _run(ds: Path, cache: Path, run_dir: Path, *extra: str) -> precompute.PrecomputeSummary:
    return precompute.run(compose("precompute", _overrides(ds, cache, *extra)), run_dir)


def _new(summary) -> dict[str, int]:
    return {t: s.new for t, s in summary.types.items()}


def _skipped(summary) -> dict[str, int]:
    return {t: s.skipped for t, s in summary.types.items()}


def _counts(n_by_type: dict[str, int]) -> dict[str, int]:
    return {t: n_by_type.get(t, 0) for t in CACHE_TYPES}


def _keyed(ds: Path, cache: Path, *extra: str):
    """(samples, keys of each, backend, cfg) as precompute computes them."""
    cfg = compose("precompute", _overrides(ds, cache, *extra))
    samples = scan_dataset(ds).samples
    ctx = key_context_for(cfg)
    hasher = hasher_for(cfg)
    return samples, [sample_keys(s, ctx, hasher) for s in samples], build_backend(typed(cfg.cache)), cfg


def _pipeline(cls, path: Path):
    pipe = cls.from_pretrained(path, processor=load_processor(path))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _condition(pipe, path: Path, area: int = 64 * 64) -> tuple[Image.Image, torch.Tensor]:
    """The pipeline's own resizing of an image: the PIL image Qwen2.5-VL sees, and the VAE input."""
    img = Image.open(path).convert("RGB")
    w, h, _ = calculate_dimensions(area, img.width / img.height)
    resized = pipe.image_processor.resize(img, h, w)
    return resized, pipe.image_processor.preprocess(resized, h, w).unsqueeze(2)


def _chunks(items: list, n: int) -> list[list]:
    return [items[i : i + n] for i in range(0, len(items), n)]


def _entries_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def _logical(backend, type: str, key: str) -> dict:
    """What the public type holds, whole, as an entry dict (the prompt joined from its stored pieces)."""
    value = read_logical(backend, type, key)
    if value is None:
        return None
    if type == "control_latent":
        return {str(i): t for i, t in enumerate(value)}
    return {"latent" if type == "pixel_latent" else "embed": value}


@pytest.fixture(scope="module")
def encoder(tiny_path: Path):
    return encoder_for(compose("precompute", ["model=tiny"]))


@pytest.fixture(scope="module")
def built(tiny_path: Path, tmp_path_factory: pytest.TempPathFactory):
    """Five samples (one non-square) precomputed with batch_size=2 into a fresh cache."""
    root = tmp_path_factory.mktemp("built")
    ds = _dataset(root / "ds", 4)
    _sample(ds, "s004", 77, "Replace the background with a sandy beach at sunset.", size=(80, 48))
    cache, run_dir = root / "cache", root / "run"
    summary = _run(ds, cache, run_dir, "precompute.batch_size=2")
    return ds, cache, run_dir, summary


# ---------------------------------------------------------------- values


def test_cache_holds_exactly_what_the_encoder_computes(built, encoder, capsys) -> None:
    ds, cache, run_dir, summary = built
    assert _new(summary) == _counts(dict.fromkeys(CACHE_TYPES, 5))
    assert summary.failures == [] and summary.samples == 5
    written = json.loads((run_dir / "precompute_summary.json").read_text())
    assert written == summary.to_dict()
    assert (run_dir / "failures.jsonl").read_text() == ""
    backend = SsdBackend(cache)
    for t, s in backend.stats(CACHE_TYPES).items():  # bytes reported are the bytes on disk
        assert (s["count"], s["bytes"]) == (5, summary.types[t].bytes_written)
    # A prompt entry keeps only the rows after the prefix it shares with its empty-prompt entry: the tiny
    # model's template and image tokens before the instruction (the empty prompt's rows less the 5 of
    # "<|im_end|>\n<|im_start|>assistant\n"); equal there within float32 rounding, not bit for bit.
    samples, keys, backend, cfg = _keyed(ds, cache)
    for k in keys:
        stored = backend.get("prompt_embed", k["prompt_embed"])
        empty_rows = len(read_logical(backend, "empty_prompt_embed", k["empty_prompt_embed"]))
        assert list(stored) == ["suffix"] and int(stored.meta["prefix_rows"]) == empty_rows - 5
        assert stored.meta["base"] == f"empty_prompt_embed/{k['empty_prompt_embed']}"
        assert 0 <= float(stored.meta["prefix_max_diff"]) < 1e-6

    sizes = sizes_for(cfg)
    # Same batch composition as the run (one group, batches of 2): bit-for-bit the same tensors and dtypes,
    # but for a prompt's shared prefix rows, equal within the difference recorded when it was written.
    for batch in _chunks(list(zip(samples, keys)), 2):
        live = encoder.encode_entries([prepare_sample(s, sizes) for s, _ in batch], CACHE_TYPES)
        for (_, k), entry in zip(batch, live):
            for t in CACHE_TYPES:
                stored = _logical(backend, t, k[t])
                if t == "prompt_embed":
                    got, want = stored["embed"], entry[t]["embed"]
                    meta = backend.get(t, k[t]).meta
                    n = int(meta["prefix_rows"])
                    assert torch.equal(got[n:], want[n:]) and got.shape == want.shape
                    assert (got[:n] - want[:n]).abs().max() <= float(meta["prefix_max_diff"])
                    continue
                assert stored is not None and _entries_equal(stored, entry[t]), t
    embed = read_logical(backend, "prompt_embed", keys[0]["prompt_embed"])
    mask = read_logical(backend, "prompt_embeds_mask", keys[0]["prompt_embeds_mask"])
    assert torch.equal(mask, torch.ones(embed.shape[0], dtype=torch.long))  # stored unpadded
    assert backend.get("control_latent", keys[4]["control_latent"])["0"].shape == (4, 1, 16, 24)

    # A second run skips everything and never builds the encoders.
    capsys.readouterr()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(precompute, "build_encoder", lambda cfg: pytest.fail("encoder built with nothing to do"))
        again = _run(ds, cache, run_dir.with_name("run2"), "precompute.batch_size=2")
    assert _new(again) == _counts({}) and _skipped(again) == _counts(dict.fromkeys(CACHE_TYPES, 5))
    out = capsys.readouterr().out
    assert "precompute: 5 samples" in out and all(t in out for t in CACHE_TYPES)


def test_cache_matches_the_diffusers_pipeline(built, tiny_path: Path) -> None:
    ds, cache, _, _ = built
    pipe = _pipeline(QwenImageEditPipeline, tiny_path)
    samples, keys, backend, _ = _keyed(ds, cache)
    cpu = torch.device("cpu")
    for sample, k in zip(samples, keys):
        vl_image, vae_input = _condition(pipe, sample.controls[0])
        _, target_input = _condition(pipe, sample.target)
        with torch.no_grad():
            latents = {
                "control_latent": pipe._encode_vae_image(vae_input, generator=None)[0],
                "pixel_latent": pipe._encode_vae_image(target_input, generator=None)[0],
            }
            prompts = {
                "prompt_embed": pipe.encode_prompt(sample.prompt, image=vl_image, device=cpu)[0][0],
                "empty_prompt_embed": pipe.encode_prompt("", image=vl_image, device=cpu)[0][0],
            }
        got = backend.get("control_latent", k["control_latent"])["0"]
        torch.testing.assert_close(got, latents["control_latent"], atol=1e-5, rtol=0)
        got = backend.get("pixel_latent", k["pixel_latent"])["latent"]
        torch.testing.assert_close(got, latents["pixel_latent"], atol=1e-5, rtol=0)
        for kind, want in prompts.items():
            got = read_logical(backend, kind, k[kind])
            assert got.shape == want.shape
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_one_prompt_two_control_images_two_entries(tiny_path: Path, tmp_path: Path, encoder) -> None:
    ds = tmp_path / "ds"
    for i in range(2):
        _sample(ds, f"s{i}", 300 + i, "Make the sky blue.")
    summary = _run(ds, tmp_path / "cache", tmp_path / "run", "precompute.batch_size=1")
    assert _new(summary)["prompt_embed"] == 2
    samples, keys, backend, cfg = _keyed(ds, tmp_path / "cache")
    assert keys[0]["prompt_embed"] != keys[1]["prompt_embed"]
    embeds = []
    for sample, k in zip(samples, keys):
        prepared = prepare_sample(sample, sizes_for(cfg))
        (live,) = encoder.encode_prompts([sample.prompt], [prepared.vl_images])
        stored = read_logical(backend, "prompt_embed", k["prompt_embed"])
        assert torch.equal(stored[6:], live[6:]) and torch.allclose(stored, live, rtol=0, atol=1e-6)
        embeds.append(stored)
    assert not torch.allclose(embeds[0], embeds[1])


# ---------------------------------------------------------------- keys: what misses when something changes


def test_changes_miss_exactly_the_dependent_types(tiny_path: Path, tmp_path: Path) -> None:
    ds, cache = _dataset(tmp_path / "ds", 3, seed=5), tmp_path / "cache"
    runs = iter(range(100))

    def run(*extra: str) -> dict[str, int]:
        summary = _run(ds, cache, tmp_path / f"run{next(runs)}", *extra)
        assert summary.failures == []
        assert {t: s.new + s.skipped for t, s in summary.types.items()} == dict.fromkeys(CACHE_TYPES, 3)
        return _new(summary)

    assert run() == dict.fromkeys(CACHE_TYPES, 3)
    assert run() == _counts({})
    _noise(ds / "training_images" / "s000.png", 999)  # new target bytes
    assert run() == _counts({"pixel_latent": 1})
    _noise(ds / "control_images" / "s001.png", 998)  # new control bytes
    assert run() == _counts(dict.fromkeys(CONTROL_DEPENDENT, 1))
    (ds / "training_images" / "s002.txt").write_text("Turn the photo into a pencil sketch.", encoding="utf-8")
    assert run() == _counts({"prompt_embed": 1})
    assert run("data.target_pixels=2048") == _counts({"pixel_latent": 3})

    other = build_tiny_model(tmp_path / "seed1", seed=1)  # same architecture, other weights
    for part, expected in (("vae", ["pixel_latent", "control_latent"]), ("text_encoder", TEXT)):
        mixed = tmp_path / f"mixed_{part}"
        shutil.copytree(tiny_path, mixed)
        shutil.rmtree(mixed / part)
        shutil.copytree(other / part, mixed / part)
        assert run(f"model.pretrained_model_name_or_path={mixed}") == _counts(dict.fromkeys(expected, 3))
    assert run(f"model.pretrained_model_name_or_path={other}") == _counts({})  # both parts seen before


# ---------------------------------------------------------------- damaged entries, interruption


def test_damaged_entries_are_misses_and_get_rewritten(tiny_path: Path, tmp_path: Path) -> None:
    ds, cache = _dataset(tmp_path / "ds", 3, seed=7), tmp_path / "cache"
    _run(ds, cache, tmp_path / "run0", "precompute.batch_size=1")
    samples, keys, backend, _ = _keyed(ds, cache)
    before = {(t, k[t]): _logical(backend, t, k[t]) for k in keys for t in CACHE_TYPES}

    damaged = {
        ("prompt_embed", 0): lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2]),  # truncated
        ("control_latent", 1): lambda p: p.write_bytes(os.urandom(p.stat().st_size)),  # garbage
        ("pixel_latent", 2): lambda p: p.write_bytes(b""),  # empty
        # a whole, valid file of another type under this name
        ("empty_prompt_embed", 0): lambda p: shutil.copyfile(backend.path("pixel_latent", keys[0]["pixel_latent"]), p),
        ("pixel_latent", 1): lambda p: p.write_bytes(p.read_bytes()[:-1]),  # one byte short
    }
    for (t, i), damage in damaged.items():
        damage(backend.path(t, keys[i][t]))
        assert backend.get(t, keys[i][t]) is None  # never loaded as data
    summary = _run(ds, cache, tmp_path / "run1", "precompute.batch_size=1")
    expected = {}
    for t, _ in damaged:
        expected[t] = expected.get(t, 0) + 1
    # sample 0's prompt entry was damaged itself; a prompt entry whose base was rewritten is redone too
    assert _new(summary) == _counts(expected)
    for t in CACHE_TYPES:
        assert summary.types[t].skipped == 3 - expected.get(t, 0)
    for (t, key), entry in before.items():  # rewritten with the same values
        assert _entries_equal(_logical(backend, t, key), entry), t
    report = backend.verify()
    assert report.checked == 12 and report.corrupt == []


def _subprocess_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


@pytest.mark.subprocess
def test_killed_run_resumes_to_a_complete_verified_cache(tiny_path: Path, tmp_path: Path) -> None:
    n = 40
    ds, cache = _dataset(tmp_path / "ds", n, seed=11, size=(32, 32)), tmp_path / "cache"
    small = ["model.vae_image_pixels=1024", "model.vl_image_pixels=1024", "precompute.batch_size=1"]
    cmd = [sys.executable, "-m", "qie.precompute", *_overrides(ds, cache, *small), f"hydra.run.dir={tmp_path / 'r0'}"]
    with open(tmp_path / "log.txt", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=_subprocess_env())
        deadline = time.monotonic() + 300
        while proc.poll() is None and time.monotonic() < deadline:
            done = len(list((cache / "prompt_embed").rglob("*.safetensors")))
            if done >= 4:
                break
            time.sleep(0.02)
        assert proc.poll() is None, (
            "precompute finished (or died) before it could be killed:\n" + ((tmp_path / "log.txt").read_text()[-3000:])
        )
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    # What a writer killed mid-write leaves behind, placed deterministically.
    stray = cache / "pixel_latent" / "ab" / temp_name("ab" * 32, pid=proc.pid)
    stray.parent.mkdir(parents=True, exist_ok=True)
    stray.write_bytes(b"partial")

    summary = _run(ds, cache, tmp_path / "r1", *small)
    assert summary.temp_files_removed >= 1 and not stray.exists()
    assert all(s.new + s.skipped == n for s in summary.types.values())
    assert 0 < summary.types["prompt_embed"].skipped < n  # some survived the kill, some were redone
    assert sum(s.new for s in summary.types.values()) > 0 and summary.failures == []
    report = run_admin(SsdBackend(cache), "verify")  # what `python -m qie.cache action=verify` runs
    assert report.exit_code == 0
    assert report.verify.checked == 4 * n and report.verify.corrupt == [] and report.verify.stale_temp == []
    assert list(cache.rglob("*.tmp")) == []
    again = _run(ds, cache, tmp_path / "r2", *small)
    assert _new(again) == _counts({}) and _skipped(again) == _counts(dict.fromkeys(CACHE_TYPES, n))


@pytest.mark.subprocess
def test_two_processes_share_the_work(tiny_path: Path, tmp_path: Path) -> None:
    ds, cache = _dataset(tmp_path / "ds", 9, seed=13, size=(32, 32)), tmp_path / "cache"
    # s009 shares s000's control image: its control-only entries exist once, on one process.
    _sample(ds, "s009", 13_500, "Add a small hat to the dog.", size=(32, 32))
    shutil.copyfile(ds / "control_images" / "s000.png", ds / "control_images" / "s009.png")
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        "-m", "qie.precompute", *_overrides(ds, cache, "model.vae_image_pixels=1024", "precompute.batch_size=2"),
        f"hydra.run.dir={run_dir}",
    ]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, env=_subprocess_env(), timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((run_dir / "precompute_summary.json").read_text())
    new = {t: s["new"] for t, s in summary["types"].items()}
    assert new == {"pixel_latent": 10, "control_latent": 9, "empty_prompt_embed": 9, "prompt_embed": 10}
    stats = SsdBackend(cache).stats(CACHE_TYPES)
    assert {t: s["count"] for t, s in stats.items()} == new  # each entry written by exactly one process
    procs = sorted(summary["processes"], key=lambda p: p["process"])
    assert [p["process"] for p in procs] == [0, 1]
    assert all(p["new"] > 0 for p in procs) and sum(p["samples"] for p in procs) == 10
    assert sum(p["new"] for p in procs) == sum(new.values())
    assert "process 1:" in result.stdout and SsdBackend(cache).verify().corrupt == []


# ---------------------------------------------------------------- ranges, variants


def test_range_encodes_exactly_that_slice(tiny_path: Path, tmp_path: Path) -> None:
    ds, cache = _dataset(tmp_path / "ds", 5, seed=17), tmp_path / "cache"
    summary = _run(ds, cache, tmp_path / "run0", "precompute.start=1", "precompute.end=4")
    assert summary.samples == 3 and _new(summary) == dict.fromkeys(CACHE_TYPES, 3)
    samples, keys, backend, _ = _keyed(ds, cache)
    for i, k in enumerate(keys):
        assert all(backend.exists(t, k[t]) == (1 <= i < 4) for t in CACHE_TYPES), samples[i].id
    rest = _run(ds, cache, tmp_path / "run1")
    assert _new(rest) == dict.fromkeys(CACHE_TYPES, 2) and _skipped(rest) == dict.fromkeys(CACHE_TYPES, 3)


def test_edit_plus_with_two_control_images(tiny_plus_path: Path, tmp_path: Path) -> None:
    ds, cache = tmp_path / "ds", tmp_path / "cache"
    _sample(ds, "a", 21, "Put the object from picture 2 on the table in picture 1.", controls=2)
    _sample(ds, "b", 22, "Keep the face, change the clothes.", controls=2, size=(80, 48))
    summary = _run(ds, cache, tmp_path / "run", "model=tiny_plus", "precompute.batch_size=2")
    assert _new(summary) == dict.fromkeys(CACHE_TYPES, 2) and summary.failures == []
    pipe = _pipeline(QwenImageEditPlusPipeline, tiny_plus_path)
    samples, keys, backend, _ = _keyed(ds, cache, "model=tiny_plus")
    for sample, k in zip(samples, keys):
        assert len(sample.controls) == 2
        conditions = [_condition(pipe, p) for p in sample.controls]
        with torch.no_grad():
            want, _ = pipe.encode_prompt(sample.prompt, image=[c[0] for c in conditions], device=torch.device("cpu"))
            latents = [pipe._encode_vae_image(c[1], generator=None)[0] for c in conditions]
        got = read_logical(backend, "prompt_embed", k["prompt_embed"])
        assert got.shape == want[0].shape
        torch.testing.assert_close(got, want[0], atol=1e-5, rtol=0)
        stored = backend.get("control_latent", k["control_latent"])
        assert list(stored) == ["0", "1"]
        for i, latent in enumerate(latents):
            torch.testing.assert_close(stored[str(i)], latent, atol=1e-5, rtol=0)


def test_edit_model_rejects_extra_control_images(tiny_path: Path, tmp_path: Path) -> None:
    ds = _dataset(tmp_path / "ds", 1, seed=23)
    _sample(ds, "two", 24, "Two images for a one-image model.", controls=2)
    summary = _run(ds, tmp_path / "cache", tmp_path / "run")
    (failure,) = summary.failures
    assert failure.id == "two" and "2 control images" in failure.reason and "at most 1" in failure.reason
    assert failure.path == str(ds / "control_images" / "two_control_1.png")
    assert _new(summary) == dict.fromkeys(CACHE_TYPES, 1)
    assert all(s.failed == 1 for s in summary.types.values())


# ---------------------------------------------------------------- bad inputs


def _bad_dataset(root: Path) -> dict[str, Path]:
    """Two good samples and one of each kind of bad input; returns the file at fault per sample."""
    _dataset(root, 2, seed=31)
    for i, stem in enumerate(["badtarget", "badcontrol", "nocaption", "nocontrol", "latin1"]):
        _sample(root, stem, 400 + i, f"Edit {stem}.")
    faults = {
        "badtarget": root / "training_images" / "badtarget.png",
        "badcontrol": root / "control_images" / "badcontrol.png",
        "nocaption": root / "training_images" / "nocaption.txt",
        "nocontrol": root / "control_images" / "nocontrol.png",
        "latin1": root / "training_images" / "latin1.txt",
    }
    faults["badtarget"].write_bytes(b"\x89PNG\r\n\x1a\nnot really a png")
    faults["badcontrol"].write_bytes(faults["badcontrol"].read_bytes()[:60])  # truncated PNG
    faults["nocaption"].unlink()
    faults["nocontrol"].unlink()
    faults["latin1"].write_bytes("Mach den Himmel gr\xfcn.".encode("latin-1"))
    return faults


def test_bad_inputs_are_named_and_the_run_goes_on(tiny_path: Path, tmp_path: Path, capsys) -> None:
    faults = _bad_dataset(tmp_path / "ds")
    summary = _run(tmp_path / "ds", tmp_path / "cache", tmp_path / "run")
    lines = (tmp_path / "run" / "failures.jsonl").read_text().splitlines()
    rows = {r["id"]: r for r in map(json.loads, lines)}
    assert set(rows) == set(faults)
    for stem, path in faults.items():
        assert rows[stem]["path"].startswith(str(path.with_suffix(""))), stem
        assert rows[stem]["reason"]
    assert "not UTF-8" in rows["latin1"]["reason"] and "cannot be read" in rows["badtarget"]["reason"]
    written = json.loads((tmp_path / "run" / "precompute_summary.json").read_text())
    assert {f["id"] for f in written["failures"]} == set(faults)
    # The good samples are complete; a bad target costs only pixel_latent, a bad control all the rest;
    # a sample the scan rejects (caption, missing control) fails every type.
    assert _new(summary) == {t: 3 for t in CACHE_TYPES}
    assert {t: s.failed for t, s in summary.types.items()} == dict.fromkeys(CACHE_TYPES, 4)
    assert summary.samples == 7 and all(s.new + s.skipped + s.failed == 7 for s in summary.types.values())
    out = capsys.readouterr().out
    assert str(faults["badtarget"]) in out and "failures.jsonl" in out
    # A range is a slice of the data set in id order, broken samples included: [5:] is s000, s001 only.
    tail = _run(tmp_path / "ds", tmp_path / "cache", tmp_path / "run2", "precompute.start=5")
    assert tail.failures == [] and tail.samples == 2 and _skipped(tail) == dict.fromkeys(CACHE_TYPES, 2)


def test_on_error_raise_stops_with_the_message(tiny_path: Path, tmp_path: Path) -> None:
    _bad_dataset(tmp_path / "ds")
    with pytest.raises(DataError, match="latin1.txt|nocaption.txt|nocontrol"):
        _run(tmp_path / "ds", tmp_path / "cache", tmp_path / "run", "precompute.on_error=raise")
    for stem in ("nocaption", "nocontrol", "latin1"):  # left: problems found only when images are read
        for p in (tmp_path / "ds").rglob(f"{stem}*"):
            p.unlink()
    with pytest.raises(DataError, match="badcontrol.png|badtarget.png") as info:
        _run(tmp_path / "ds", tmp_path / "cache", tmp_path / "run", "precompute.on_error=raise")
    assert "cannot be read" in str(info.value)


def test_manifest_and_converted_images(tiny_path: Path, tmp_path: Path) -> None:
    img = tmp_path / "img"
    img.mkdir()
    rgba = np.zeros((64, 64, 4), dtype=np.uint8)
    rgba[:, 32:] = (200, 30, 60, 255)  # left half transparent, right half opaque colour
    Image.fromarray(rgba, "RGBA").save(img / "rgba.png")
    rgb = np.full((64, 64, 3), 255, dtype=np.uint8)
    rgb[:, 32:] = (200, 30, 60)  # what the RGBA image should become
    Image.fromarray(rgb).save(img / "rgb.png")
    grey = np.tile(np.arange(64, dtype=np.uint8) * 4, (64, 1))
    Image.fromarray(grey, "L").save(img / "l.png")
    Image.fromarray(grey.astype(np.uint16) * 257).save(img / "i16.png")  # 16-bit, same picture
    Image.fromarray(rgb).convert("P", palette=Image.Palette.ADAPTIVE, colors=4).save(img / "p.png")
    rows = [
        {"id": "rgba", "target": "img/rgba.png", "controls": ["img/l.png"], "prompt": "a"},
        {"id": "rgb", "target": "img/rgb.png", "controls": ["img/i16.png"], "prompt": "a"},
        {"id": "pal", "target": "img/p.png", "controls": ["img/p.png"], "prompt": "b"},
        {"id": "gone", "target": "img/rgb.png", "controls": ["img/missing.png"], "prompt": "c"},
    ]
    manifest = tmp_path / "m.jsonl"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    cache = tmp_path / "cache"
    summary = _run(manifest, cache, tmp_path / "run", "precompute.batch_size=1", "data.format=manifest")
    (failure,) = summary.failures
    assert failure.path == str(img / "missing.png")
    assert _new(summary)["pixel_latent"] == 3 and _new(summary)["control_latent"] == 3
    samples, keys, backend, _ = _keyed(manifest, cache)
    k = {s.id: key for s, key in zip(samples, keys)}
    # RGBA over white == the RGB picture; 16-bit grey == 8-bit grey: equal values under different keys.
    assert k["rgba"]["pixel_latent"] != k["rgb"]["pixel_latent"]
    assert torch.equal(
        backend.get("pixel_latent", k["rgba"]["pixel_latent"])["latent"],
        backend.get("pixel_latent", k["rgb"]["pixel_latent"])["latent"],
    )
    assert torch.equal(
        backend.get("control_latent", k["rgba"]["control_latent"])["0"],
        backend.get("control_latent", k["rgb"]["control_latent"])["0"],
    )


def test_config_errors(tmp_path: Path) -> None:
    from qie.errors import ConfigError

    ds = _dataset(tmp_path / "ds", 1)
    with pytest.raises(ConfigError, match="data.path"):
        precompute.run(compose("precompute", [f"cache.dir={tmp_path}"]), tmp_path / "run")
    with pytest.raises(ConfigError, match="persistent cache"):
        precompute.run(compose("precompute", [f"data.path={ds}", "cache=memory"]), tmp_path / "run")
    with pytest.raises(ConfigError, match="batch_size"):
        _run(ds, tmp_path / "cache", tmp_path / "run", "precompute.batch_size=0")
    (tmp_path / "empty" / "training_images").mkdir(parents=True)
    with pytest.raises(DataError, match="no usable sample"):
        _run(tmp_path / "empty", tmp_path / "cache", tmp_path / "run")
