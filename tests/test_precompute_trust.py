"""Precompute you can trust: exact staleness of model weights, non-finite values refused, independent runs
that never encode an entry twice, storage errors before any model is built."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch

from qie.cache.failures import read_failures
from qie.cache.ssd import SsdBackend
from qie.checks import compose
from qie.components import fingerprint
from qie.config import typed
from qie.demo.synthetic import make_dataset
from qie.errors import StorageError
from qie.stages import precompute, precompute_work
from qie.types import CACHE_TYPES


def run(ds: Path, cache: Path, run_dir: Path, *extra: str):
    return precompute.run(compose("precompute", [f"data.path={ds}", f"cache.dir={cache}", *extra]), run_dir)


def new(summary) -> dict[str, int]:
    return {t: s.new for t, s in summary.types.items()}


def test_an_early_weight_change_recomputes_every_dependent_entry(tiny_path: Path, tmp_path: Path) -> None:
    ds = make_dataset(tmp_path / "data", train=3, heldout=0, size=32) / "train"
    model = tmp_path / "model"
    shutil.copytree(tiny_path, model)
    use = f"model.pretrained_model_name_or_path={model}"
    assert set(new(run(ds, tmp_path / "cache", tmp_path / "r0", use)).values()) == {3}
    weights = next((model / "vae").glob("*.safetensors"))
    tensors = safetensors.torch.load_file(str(weights))
    name = "encoder.conv_in.bias"
    tensors[name] = tensors[name] + 1e-3  # the file's first weights: same size, same header
    st = weights.stat()
    safetensors.torch.save_file(tensors, str(weights), metadata=safetensors.safe_open(str(weights), "pt").metadata())
    assert weights.stat().st_size == st.st_size
    # The same process sees the change: fingerprints are remembered by file signature, not for its life.
    summary = run(ds, tmp_path / "cache", tmp_path / "r1", use)
    assert new(summary) == {"pixel_latent": 3, "control_latent": 3, "empty_prompt_embed": 0, "prompt_embed": 0}


def test_fingerprints_hash_each_weight_file_once_per_change(tiny_path: Path, tmp_path: Path) -> None:
    hasher = fingerprint.weight_hasher(tmp_path / "index.json")
    weights = sorted((tiny_path / "text_encoder").glob("*.safetensors"))
    first = [hasher.hash(w) for w in weights]
    hasher.save()
    warm = fingerprint.weight_hasher(tmp_path / "index.json")
    assert [warm.hash(w) for w in weights] == first and warm.files_read == 0


def test_non_finite_values_are_refused_and_named(tiny_path: Path, tmp_path: Path, monkeypatch) -> None:
    ds = make_dataset(tmp_path / "data", train=3, heldout=0, size=32) / "train"
    real = precompute_work.Encoder.encode_entries

    def poisoned(self, prepared, types):
        out = real(self, prepared, types)
        for p, entry in zip(prepared, out):
            if p.sample.id == "00001" and "prompt_embed" in entry:
                entry["prompt_embed"]["embed"][0, 0] = float("inf")
        return out

    monkeypatch.setattr(precompute_work.Encoder, "encode_entries", poisoned)
    summary = run(ds, tmp_path / "cache", tmp_path / "run")
    (failure,) = summary.failures
    assert failure.id == "00001" and "prompt_embed/embed hold NaN or infinite values: not written" in failure.reason
    assert new(summary) == {"pixel_latent": 3, "control_latent": 3, "empty_prompt_embed": 3, "prompt_embed": 2}
    recorded = read_failures(SsdBackend(tmp_path / "cache"))
    assert [v["sample"] for v in recorded.values()] == ["00001"] and list(recorded)[0].startswith("prompt_embed/")
    monkeypatch.setattr(precompute_work.Encoder, "encode_entries", real)
    again = run(ds, tmp_path / "cache", tmp_path / "run2")
    assert new(again)["prompt_embed"] == 1 and read_failures(SsdBackend(tmp_path / "cache")) == {}  # written: unlisted


@pytest.mark.subprocess
def test_independent_runs_on_one_cache_encode_nothing_twice(tiny_path: Path, tmp_path: Path) -> None:
    ds = make_dataset(tmp_path / "data", train=16, heldout=0, size=32) / "train"
    cache = tmp_path / "cache"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[1])}
    procs = []
    for i in range(2):
        cmd = [sys.executable, "-m", "qie.precompute", f"data.path={ds}", f"cache.dir={cache}",
               "precompute.batch_size=1", f"hydra.run.dir={tmp_path / f'run{i}'}"]  # fmt: skip
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = [p.communicate(timeout=600)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), logs[0][-2000:] + logs[1][-2000:]
    summaries = [json.loads((tmp_path / f"run{i}" / "precompute_summary.json").read_text()) for i in range(2)]
    for t in ("pixel_latent", "control_latent", "empty_prompt_embed", "prompt_embed"):
        made = [s["types"][t]["new"] for s in summaries]
        assert sum(made) == 16, (t, made)  # each entry encoded by exactly one of the runs
        assert all(s["types"][t]["new"] + s["types"][t]["skipped"] == 16 for s in summaries)


def test_claims_held_by_another_run_are_waited_for_not_encoded(tiny_path: Path, tmp_path: Path) -> None:
    ds = make_dataset(tmp_path / "data", train=2, heldout=0, size=32) / "train"
    cfg = compose("precompute", [f"data.path={ds}", f"cache.dir={tmp_path / 'cache'}"])
    backend = precompute.build_backend(typed(cfg.cache))
    calls = []
    real_claim = backend.claim

    def claim(type, key, wait=False):  # the first try of every entry finds it held by another run
        calls.append(wait)
        return real_claim(type, key, wait) if wait or calls.count(False) > 8 else None

    backend.claim = claim
    summary = precompute_work.PrecomputeSummary()
    from stage_edges import data_for, encoder_for, hasher_for, key_context_for, sizes_for

    from qie.components import prepare_model

    spec = prepare_model(typed(cfg.model))
    keyed = [(s, precompute_work.keys_of(s, key_context_for(cfg, spec), hasher_for(cfg), spec))
             for s in data_for(cfg).samples]  # fmt: skip
    groups = precompute_work.plan(keyed, backend, summary)
    precompute_work.encode_groups(lambda: encoder_for(cfg, spec), groups, backend,
                                  sizes_for(cfg, spec), summary, 1, False, lambda n: None)  # fmt: skip
    assert True in calls and all(s.new == 2 for s in summary.types.values())


def test_storage_problems_stop_precompute_before_any_model_is_built(tmp_path: Path, monkeypatch) -> None:
    ds = make_dataset(tmp_path / "data", train=1, heldout=0, size=32) / "train"
    monkeypatch.setattr(precompute, "build_encoder", lambda cfg: pytest.fail("encoder built"))
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(StorageError, match=f"cache.dir '{a_file}' is a file, not a folder"):
        run(ds, a_file, tmp_path / "run")
    with pytest.raises(StorageError, match=f"the run directory .* '{a_file / 'run'}' is a file"):
        run(ds, tmp_path / "cache", a_file / "run")
    real_open = os.open

    def read_only(path, flags, *a):
        if str(path).startswith(str(tmp_path / "ro")) and flags & os.O_CREAT:
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real_open(path, flags, *a)

    monkeypatch.setattr(os, "open", read_only)
    with pytest.raises(StorageError, match=f"cache.dir '{tmp_path / 'ro'}' is not writable .Read-only file system"):
        run(ds, tmp_path / "ro", tmp_path / "run")


def test_a_full_disk_mid_run_ends_in_one_line_and_keeps_what_was_written(tiny_path: Path, tmp_path: Path) -> None:
    ds = make_dataset(tmp_path / "data", train=4, heldout=0, size=32) / "train"
    cache = tmp_path / "cache"
    code = (
        "import os, errno, qie.cache.files as f\n"
        "from qie.types import CACHE_TYPES\n"
        "real = os.replace\n"
        "n = [0]\n"
        "def full(a, b):\n"
        "    if os.path.basename(os.path.dirname(os.path.dirname(b))) not in CACHE_TYPES:\n"
        "        return real(a, b)  # not an entry: the remembered scan, the weight hashes\n"
        "    n[0] += 1\n"
        "    if n[0] > 5: raise OSError(errno.ENOSPC, 'No space left on device')\n"
        "    real(a, b)\n"
        "f.os.replace = full\n"
        "import sys; sys.argv = ['qie.precompute'] + sys.argv[1:]\n"
        "from qie.precompute import main; main()\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[1])}
    args = [f"data.path={ds}", f"cache.dir={cache}", "precompute.batch_size=1", f"hydra.run.dir={tmp_path / 'r'}"]
    out = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 2, out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("qie: error:")]
    assert len(errors) == 1 and "No space left on device while writing a cache entry in" in errors[0]
    assert "Traceback" not in out.stderr
    from qie.cache.ssd import SsdBackend

    report = SsdBackend(cache).verify()
    assert report.checked == 5 and report.corrupt == []  # what was written before is whole
    assert not list(cache.rglob("*.tmp"))


@pytest.mark.subprocess
def test_an_unwritable_run_directory_is_one_error_line(tmp_path: Path) -> None:
    a_file = tmp_path / "file"
    a_file.write_text("x")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    for stage in ("qie.precompute", "qie.train"):
        cmd = [sys.executable, "-m", stage, f"data.path={tmp_path}", f"cache.dir={tmp_path / 'c'}",
               f"hydra.run.dir={a_file / 'run'}"]  # fmt: skip
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
        assert out.stderr.strip().splitlines() == [
            f"qie: error: hydra.run.dir '{a_file / 'run'}' is a file (or lies under one): choose a folder"
        ]


def test_the_stages_rebuildable_state_has_its_own_folder(tiny_path: Path, tmp_path: Path) -> None:
    """cache.dir holds the entries (and the failure list the backend shares); the file hashes, remembered keys and
    folder index go to cache.state_dir (default cache.dir/state), which can be deleted and is rebuilt unchanged."""
    ds = make_dataset(tmp_path / "data", train=3, heldout=0, size=32) / "train"
    cache, state = tmp_path / "cache", tmp_path / "state"
    first = run(ds, cache, tmp_path / "r0", f"cache.state_dir={state}")
    assert set(new(first).values()) == {3}
    assert {p.name for p in cache.iterdir()} <= {*CACHE_TYPES, ".checked"}
    assert "file_hashes.json" in {p.name for p in state.iterdir()}
    shutil.rmtree(state)  # rebuilt by the next run: every entry is found again, none written
    again = run(ds, cache, tmp_path / "r1", f"cache.state_dir={state}")
    assert set(new(again).values()) == {0} and (state / "file_hashes.json").is_file()
    default = run(ds, cache, tmp_path / "r2")  # without cache.state_dir: cache.dir/state
    assert set(new(default).values()) == {0} and (cache / "state" / "file_hashes.json").is_file()
