"""Training you can trust: checkpoints that never unpickle, exact resume or a loud stop, each step logged
once, the whole cache checked before the model is built, non-finite losses stopped with the samples named."""

from __future__ import annotations

import contextlib
import json
import pickle
import re
import shutil
import threading
from pathlib import Path

import pytest
import torch
from helpers import cached_set
from stage_edges import source_for

from qie.cache.entries import write_entries
from qie.cache.failures import update_failures
from qie.cache.ssd import SsdBackend
from qie.checks import compose
from qie.data.scan import scan_dataset
from qie.errors import CacheMissError, ModelLoadError, StorageError
from qie.runtime.guards import NonFiniteLoss
from qie.stages import train as train_stage
from qie.stages import train_model
from qie.training.state_io import load_tree

FAST = ["train.learning_rate=1e-3", "logging.report_to=none", "train.seed=3"]


@pytest.fixture(scope="module")
def data(tiny_path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    return cached_set(tiny_path, tmp_path_factory.mktemp("trust_data"), train=6)


def train(data: dict, overrides: list[str], run_dir: Path, base: list[str] | None = None) -> dict:
    return train_stage.run(compose("train", (base or data["base"]) + FAST + overrides), run_dir)


def metrics_steps(run_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


class Payload:
    """Unpickling this runs code: it writes the marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (self.marker, "code ran"))


def test_planted_pickles_in_a_checkpoint_run_no_code(data: dict, tmp_path: Path) -> None:
    run = tmp_path / "run"
    train(data, ["train.max_steps=2", "train.checkpoint_every=2"], run)
    good = run / "checkpoints" / "step-000002"
    files = sorted(p.relative_to(good) for p in good.rglob("*") if p.is_file())
    assert files and all(p.suffix in (".json", ".safetensors") for p in files)
    marker = tmp_path / "marker"
    payload = pickle.dumps(Payload(marker))
    torch_zip = tmp_path / "zip.pt"
    torch.save({"x": Payload(marker)}, torch_zip)
    # Every file of the checkpoint replaced by a payload, and accelerate's pickle files planted beside.
    planted = [(f, payload) for f in files] + [(f, torch_zip.read_bytes()) for f in files[:3]]
    planted += [(Path(n), payload) for n in ("state/custom_checkpoint_0.pkl", "state/random_states_0.pkl")]
    planted += [(Path("accelerate/optimizer.bin"), torch_zip.read_bytes())]
    for i, (name, content) in enumerate(planted):
        bad = tmp_path / f"ckpt{i}"
        shutil.copytree(good, bad)
        (bad / name).parent.mkdir(parents=True, exist_ok=True)
        (bad / name).write_bytes(content)
        with pytest.raises(ModelLoadError, match="a file only a pickle loader reads") as info:
            train(data, ["train.max_steps=3", f"train.resume={bad}"], tmp_path / f"resumed{i}")
        assert str(name) in str(info.value)
        assert not marker.exists(), name
    # Even handed a payload directly, the loaders read JSON and safetensors only: an error, no code.
    (tmp_path / "direct").mkdir()
    for suffix in (".json", ".safetensors"):
        (tmp_path / "direct" / f"optimizer{suffix}").write_bytes(payload)
    with pytest.raises((ValueError, OSError, Exception)):
        load_tree(tmp_path / "direct", "optimizer")
    assert not marker.exists()


def test_missing_rng_state_stops_the_resume_unless_inexact(data: dict, tmp_path: Path) -> None:
    run = tmp_path / "run"
    train(data, ["train.max_steps=2", "train.checkpoint_every=2"], run)
    ckpt = run / "checkpoints" / "step-000002"
    (ckpt / "state" / "rng_state_0.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="cannot resume exactly: .*rng_state_0.*train.resume_inexact=true"):
        train(data, ["train.max_steps=3", f"train.resume={ckpt}"], tmp_path / "strict")
    result = train(data, ["train.max_steps=3", f"train.resume={ckpt}", "train.resume_inexact=true"], tmp_path / "ok")
    assert result["step"] == 3 and len(result["losses"]) == 1
    (ckpt / "state" / "rng_state_0.json").write_text("{broken")  # unreadable, not only missing
    with pytest.raises(ModelLoadError, match="rng_state_0.*missing or unreadable"):
        train(data, ["train.max_steps=3", f"train.resume={ckpt}"], tmp_path / "strict2")


def test_each_step_is_logged_once_after_a_resume(data: dict, tmp_path: Path) -> None:
    run = tmp_path / "run"
    train(data, ["train.max_steps=5", "train.checkpoint_every=2"], run)
    assert metrics_steps(run) == [1, 2, 3, 4, 5]
    # Killed after step 5 was logged but before its checkpoint: the newest checkpoint is step 4.
    shutil.rmtree(run / "checkpoints" / "step-000005")
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "lo')  # and a torn line
    result = train(data, ["train.max_steps=6", "train.checkpoint_every=2", "train.resume=latest"], run)
    assert result["step"] == 6 and len(result["losses"]) == 2
    assert metrics_steps(run) == [1, 2, 3, 4, 5, 6]


def _poison(data: dict, sample_id: str) -> None:
    """Store NaN in the sample's target latent (a valid entry, checksum and all, holding NaN)."""
    cfg = compose("train", data["base"])
    source = source_for(cfg)
    sample = next(s for s in scan_dataset(data["root"] / "train").samples if s.id == sample_id)
    keys = source.keys(sample)
    latent = source.backend.get("pixel_latent", keys["pixel_latent"])["latent"].clone()
    latent[0, 0, 0, 0] = float("nan")
    write_entries(source.backend, keys, {"pixel_latent": {"latent": latent}})


def test_a_nan_entry_stops_training_naming_the_sample_after_saving(data: dict, tmp_path: Path) -> None:
    root = tmp_path / "data"
    shutil.copytree(data["root"], root)
    local = {**data, "root": root, "base": [b.replace(str(data["root"]), str(root)) for b in data["base"]]}
    victim = scan_dataset(root / "train").samples[0].id
    _poison(local, victim)
    args = ["train.max_steps=6", "train.checkpoint_every=100", "data.shuffle=false"]
    with pytest.raises(NonFiniteLoss, match=rf"step 1 gave a NaN or infinite loss .* on samples '{victim}'"):
        train(local, args, tmp_path / "stop")
    assert not (tmp_path / "stop" / "checkpoints").exists()  # no good step yet: nothing to save
    # Shuffled, the sample comes later: the good steps before it are saved, the bad one is never applied.
    with pytest.raises(NonFiniteLoss) as info:
        train(local, args + ["data.shuffle=true", "train.seed=1"], tmp_path / "stop2")
    bad_step = int(re.search(r"step (\d+) gave", str(info.value))[1])
    assert bad_step > 1 and f"on samples {victim!r}" in str(info.value)
    saved = tmp_path / "stop2" / "checkpoints" / f"step-{bad_step - 1:06d}"
    assert f"the last good state is saved in {saved}" in str(info.value)
    assert sorted((tmp_path / "stop2" / "checkpoints").iterdir()) == [saved]
    state = json.loads((saved / "trainer_state.json").read_text())
    assert state["step"] == state["batches_consumed"] == bad_step - 1
    result = train(local, args + ["train.on_nonfinite=skip"], tmp_path / "skip")
    assert result["step"] == 6 and [victim] in result["skipped_nonfinite"]
    assert all(torch.isfinite(torch.tensor(result["losses"])))


def test_the_whole_cache_is_checked_while_the_model_loads_before_training(data: dict, tmp_path: Path, capsys) -> None:
    root = tmp_path / "data"
    shutil.copytree(data["root"], root)
    base = [b.replace(str(data["root"]), str(root)) for b in data["base"]]
    cfg = compose("train", base)
    source = source_for(cfg)
    samples = scan_dataset(root / "train").samples
    keys = [source.keys(s) for s in samples]
    backend = SsdBackend(root / "cache")
    backend.path("control_latent", keys[1]["control_latent"]).unlink()  # missing
    path = backend.path("empty_prompt_embed", keys[4]["empty_prompt_embed"])
    path.write_bytes(path.read_bytes()[:-3])  # damaged (and its prompt entry with it)
    update_failures(backend, [("pixel_latent", keys[2]["pixel_latent"], samples[2].id, "bad image")], [])
    backend.path("pixel_latent", keys[2]["pixel_latent"]).unlink()  # one precompute could not encode

    with pytest.MonkeyPatch.context() as mp, _model_loads_beside_the_check(mp):
        with pytest.raises(CacheMissError, match=r"2 of 6 samples have missing or damaged .*cache_report.json"):
            train(data, ["train.max_steps=2"], tmp_path / "stop", base=base)
    report = json.loads((tmp_path / "stop" / "cache_report.json").read_text())
    assert [r["id"] for r in report["missing"]] == [samples[1].id]
    assert report["missing"][0]["types"] == ["control_latent"]
    assert [(r["id"], r["types"]) for r in report["damaged"]] == [
        (samples[4].id, ["prompt_embed", "empty_prompt_embed"])
    ]
    assert [(r["id"], r["reason"]) for r in report["precompute_failed"]] == [(samples[2].id, "bad image")]
    assert report["samples"] == 6 and "python -m qie.precompute" in report["precompute_command"]

    result = train(data, ["train.max_steps=3", "cache.on_missing=skip"], tmp_path / "skip", base=base)
    out = capsys.readouterr().out
    assert result["step"] == 3
    assert f"skipping sample {samples[2].id!r}: precompute could not encode it: bad image" in out
    assert "training without 2 samples whose cache entries are missing or damaged" in out


def test_a_miss_found_mid_run_saves_a_checkpoint_before_stopping(data: dict, tmp_path: Path) -> None:
    root = tmp_path / "data"
    shutil.copytree(data["root"], root)
    base = [b.replace(str(data["root"]), str(root)) for b in data["base"]]

    def pull_the_cache(info) -> None:
        if info.step == 1:  # the cache changes underneath the run
            for p in (root / "cache" / "pixel_latent").rglob("*.safetensors"):
                p.unlink()

    cfg = compose("train", base + FAST + ["train.max_steps=18", "train.checkpoint_every=100"])  # past the read-ahead
    with pytest.raises(CacheMissError, match="has no cached pixel_latent"):
        train_stage.run(cfg, tmp_path / "run", on_step_end=pull_the_cache)
    saved = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert len(saved) == 1 and saved[0] >= "step-000001"
    state = json.loads((tmp_path / "run" / "checkpoints" / saved[0] / "trainer_state.json").read_text())
    assert state["batches_consumed"] == state["step"]


@contextlib.contextmanager
def _model_loads_beside_the_check(mp: pytest.MonkeyPatch):
    """The model's weights load in another thread while the data is checked; what stops the run inside the
    block stops it before any model is built on top of them."""
    threads = []
    mp.setattr(train_model, "load_parts", lambda *a, **k: threads.append(threading.current_thread().name))
    mp.setattr(train_stage, "build_train_state", lambda *a, **k: pytest.fail("model built after a failed check"))
    yield
    assert threads and all(t != threading.main_thread().name for t in threads)


def test_storage_problems_are_found_before_the_model_is_built(data: dict, tmp_path: Path) -> None:
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.MonkeyPatch.context() as mp, _model_loads_beside_the_check(mp):
        with pytest.raises(StorageError, match=f"cache.dir '{a_file}' is a file"):
            train(data, [f"cache.dir={a_file}"], tmp_path / "r1")
        with pytest.raises(CacheMissError, match="(?s)6 of 6 samples have missing .*python -m qie.precompute"):
            train(data, [f"cache.dir={tmp_path / 'nope'}"], tmp_path / "r2")
        assert not (tmp_path / "nope").exists()
        with pytest.raises(StorageError, match=f"the run directory .* '{a_file / 'run'}' is a file"):
            train(data, [], a_file / "run")
