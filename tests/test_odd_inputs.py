"""Inputs and interruptions a careful user tries: an EXIF-rotated JPEG, a damaged parquet file, a 100,000-character
prompt, control characters in a caption, duplicate manifest rows, SIGINT, and kill -9 in the middle of a
checkpoint save. Each ends in correct behaviour or one clear line, with nothing already saved lost."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import safetensors.torch
import torch
from helpers import CachedData, small_config
from PIL import Image
from stage_edges import data_for, predictor_for, source_for

from qie.cache.ssd import SsdBackend
from qie.checks import compose
from qie.data.buckets import ImageSizeIndex
from qie.data.images import open_image
from qie.data.samples import MAX_PROMPT_CHARS
from qie.data.scan import scan_dataset
from qie.errors import ConfigError, DataError
from qie.stages import precompute
from qie.stages import train as train_stage
from qie.training import checkpoint as ckpt

QIE = Path(__file__).resolve().parents[1] / "qie"


def rotated_jpeg(path: Path) -> Path:
    """A 64x32 JPEG whose EXIF orientation (6) says: turn it a quarter, to 32 wide and 64 high."""
    img = Image.new("RGB", (64, 32), (200, 30, 30))
    img.paste((30, 30, 200), (0, 0, 16, 32))  # a blue band on the stored left: the upright top
    exif = Image.Exif()
    exif[0x0112] = 6
    img.save(path, "JPEG", exif=exif, quality=95)
    return path


def test_odd_samples_encode_as_expected(tiny_path: Path, tmp_path: Path) -> None:
    """One data set: an EXIF-rotated JPEG, a caption with control characters, a 100,000-character prompt."""
    root = tmp_path / "data"
    for sub in ("training_images", "control_images"):
        (root / sub).mkdir(parents=True)
    for stem in ("rotated", "control_chars", "long"):
        rotated_jpeg(root / "control_images" / f"{stem}.jpg")
        rotated_jpeg(root / "training_images" / f"{stem}.jpg")
    odd = "make it\tred\x00 \x1b[31mnow\x07\r\nplease\u200b\x7f"
    captions = {"rotated": "make it red", "control_chars": odd, "long": "red " * 24_999 + "red!"}
    for stem, text in captions.items():
        (root / "training_images" / f"{stem}.txt").write_text(text, encoding="utf-8")
    assert open_image(root / "training_images" / "rotated.jpg").size == (32, 64)
    rotated = root / "training_images" / "rotated.jpg"
    assert ImageSizeIndex().size(rotated) == (32, 64)  # buckets see it upright
    index, st = ImageSizeIndex(), rotated.stat()
    index.entries[str(rotated)] = [st.st_size, st.st_mtime_ns, 64, 32]  # remembered by an older qie, as stored
    assert index.size(rotated) == (32, 64)

    base = [f"model.pretrained_model_name_or_path={tiny_path}", f"data.path={root}", f"cache.dir={tmp_path / 'c'}",
            "data.target_pixels=2048", "model.vae_image_pixels=2048", "model.vl_image_pixels=2048"]  # fmt: skip
    summary = precompute.run(small_config("precompute", *base), tmp_path / "pre")
    assert summary.types["prompt_embed"].new == 2 and summary.types["prompt_embed"].failed == 1
    failures = [json.loads(line) for line in (tmp_path / "pre" / "failures.jsonl").read_text().splitlines()]
    assert [f["id"] for f in failures] == ["long"]
    assert f"the prompt is 100,000 characters, more than the {MAX_PROMPT_CHARS:,}" in failures[0]["reason"]
    cfg = small_config("train", *base)
    source = source_for(cfg)
    samples = {s.id: s for s in data_for(cfg).samples}
    # Kept as written (line ends read as text files are): the text encoder sees it.
    assert samples["control_chars"].prompt == odd.replace("\r\n", "\n").strip()
    entries = {i: source.get([samples[i]])[0] for i in ("rotated", "control_chars")}
    latent = entries["rotated"].pixel_latent
    assert latent.shape[-2:] == (16, 8)  # 64 high, 32 wide: upright (the tiny VAE is 4x down)
    assert entries["rotated"].control_latents[0].shape[-2:] == (16, 8)
    assert torch.isfinite(entries["control_chars"].prompt_embed).all()
    assert source.keys(samples["control_chars"])["prompt_embed"] != source.keys(samples["rotated"])["prompt_embed"]

    # Infer opens it the same way: the output is upright too; a 100,000-character prompt is refused in one line.
    predictor = predictor_for(small_config("infer", base[0], *base[4:], "predict.true_cfg_scale=1.0"))
    (out,) = predictor.predict(root / "control_images" / "rotated.jpg", "make it red", num_inference_steps=2)
    assert out.size[0] < out.size[1]
    with pytest.raises(ConfigError, match="predict.prompt: the prompt is 100,000 characters"):
        predictor.predict(root / "control_images" / "rotated.jpg", captions["long"])


def test_only_the_image_module_opens_image_files() -> None:
    """Precompute, validation, logged images and infer all read through `open_image` (EXIF applied once, alike)."""
    openers = [p.relative_to(QIE).as_posix() for p in QIE.rglob("*.py") if "Image.open(" in p.read_text()]
    assert openers == ["data/images.py"]


def test_a_damaged_parquet_file_is_named_in_one_line(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    folder = tmp_path / "pq"
    folder.mkdir()
    png = tmp_path / "x.png"
    Image.new("RGB", (32, 32), (1, 2, 3)).save(png)
    rows = {"target": [{"bytes": png.read_bytes(), "path": None}] * 2, "prompt": ["a", "b"]}
    features = datasets.Features({"target": datasets.Image(), "prompt": datasets.Value("string")})
    data = datasets.Dataset.from_dict(rows, features=features)
    data.to_parquet(str(folder / "part-0.parquet"))
    data.to_parquet(str(folder / "part-1.parquet"))
    raw = (folder / "part-1.parquet").read_bytes()
    (folder / "part-1.parquet").write_bytes(raw[: len(raw) // 2] + raw[-8:])  # a download cut short
    for path in (folder, f"{folder}/*.parquet"):
        cfg = compose("train", [f"data.path={path}", f"cache.dir={tmp_path / 'cache'}"])
        with pytest.raises(DataError) as info:
            data_for(cfg)
        message = str(info.value)
        assert message.startswith(f"parquet file '{folder / 'part-1.parquet'}' of data set ") and "\n" not in message
        assert "damaged (ArrowInvalid" in message and "download it again" in message


def test_duplicate_manifest_rows_are_used_once(cached_data: CachedData, tmp_path: Path) -> None:
    images = cached_data.data
    row = {"target": str(images / "training_images" / "00000.png"),
           "controls": [str(images / "control_images" / "00000.png")], "prompt": "make it red"}  # fmt: skip
    other = {**row, "prompt": "make it blue"}  # the same images with another instruction: a sample of its own
    manifest = tmp_path / "m.jsonl"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in (row, other, row, {**row, "prompt": " make it red "})))
    data = scan_dataset(manifest, allow_outside=True)
    assert [s.prompt for s in data.samples] == ["make it red", "make it blue"]
    assert [p.reason for p in data.problems] == [
        "manifest row 3 repeats row 1 (same images and prompt): used once",
        "manifest row 4 repeats row 1 (same images and prompt): used once",
    ]


def env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def cli_args(cached_data: CachedData, tiny_path: Path, run: Path, *extra: str) -> list[str]:
    return [f"model.pretrained_model_name_or_path={tiny_path}", *cached_data.overrides, "logging.report_to=none",
            "data.num_workers=0", f"hydra.run.dir={run}", *extra]  # fmt: skip


@pytest.mark.subprocess
def test_sigint_saves_the_last_step_and_resume_continues(cached_data: CachedData, tiny_path: Path, tmp_path) -> None:
    run = tmp_path / "run"
    args = cli_args(cached_data, tiny_path, run, "train.max_steps=100000", "train.checkpoint_every=100000")
    with open(tmp_path / "out", "w") as out, open(tmp_path / "err", "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "qie.train", *args], env=env(), stdout=out, stderr=err)
        try:
            metrics, deadline = run / "metrics.jsonl", time.monotonic() + 120
            while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
                assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "err").read_text()
                time.sleep(0.2)
            proc.send_signal(signal.SIGINT)  # Ctrl-C
            proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 130, (tmp_path / "err").read_text()  # 128 + SIGINT, with the state saved
    assert "stopped by signal 2 at step" in (tmp_path / "out").read_text()
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert [p.name for p in (run / "checkpoints").iterdir()] == [f"step-{steps[-1]:06d}"]
    resume = ["train.resume=latest", f"train.max_steps={steps[-1] + 1}"]
    cfg = compose("train", cli_args(cached_data, tiny_path, run)[:-1] + resume)
    assert train_stage.run(cfg, run)["step"] == steps[-1] + 1


@pytest.mark.subprocess
def test_kill_9_during_a_checkpoint_save_loses_nothing_saved(
    cached_data: CachedData, tiny_path: Path, tmp_path
) -> None:
    run = tmp_path / "run"
    # The process kills itself (SIGKILL: no handler, no cleanup) with step 3's checkpoint half written.
    code = textwrap.dedent("""
        import os, runpy, signal, sys
        import qie.training.checkpoint as checkpoint
        real = checkpoint.save_tree
        def save_then_die(tree, folder, name):
            real(tree, folder, name)
            if ".step-000003.tmp" in str(folder) and name == "optimizer":
                os.kill(os.getpid(), signal.SIGKILL)
        checkpoint.save_tree = save_then_die
        sys.argv = ["qie.train", *sys.argv[1:]]
        runpy.run_module("qie.train", run_name="__main__")
    """)
    args = cli_args(cached_data, tiny_path, run, "train.max_steps=4", "train.checkpoint_every=1")
    proc = subprocess.run([sys.executable, "-c", code, *args], env=env(), capture_output=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL
    folder = run / "checkpoints"
    assert sorted(p.name for p in folder.iterdir()) == [".step-000003.tmp", "step-000001", "step-000002"]
    assert ckpt.complete_checkpoints(run) == [folder / "step-000001", folder / "step-000002"]
    for tensors in (safetensors.torch.load_file(str(p)) for p in (folder / "step-000002").rglob("*.safetensors")):
        assert all(torch.isfinite(t).all() for t in tensors.values() if t.is_floating_point())
    # The next run is not refused by a stale lock, resumes from step 2 and replaces the half-written folder.
    cfg = compose("train", cli_args(cached_data, tiny_path, run)[:-1] + ["train.resume=latest", "train.max_steps=4",
                                                                        "train.checkpoint_every=1"])  # fmt: skip
    result = train_stage.run(cfg, run)
    assert result["step"] == 4 and len(result["losses"]) == 2
    assert sorted(p.name for p in folder.iterdir()) == [f"step-00000{i}" for i in (1, 2, 3, 4)]
    assert SsdBackend(cached_data.cache).verify().corrupt == []  # the cache is untouched
    assert re.fullmatch(r"\d+", str(ckpt.read_state(folder / "step-000003")["step"]))
