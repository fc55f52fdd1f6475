"""A shortened demo: data, precompute, cached training, infer on held-out samples, the picture and the report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors import safe_open

from qie.config import compose
from qie.demo import grid
from qie.demo.run import COLUMNS, GRID_TAG, TILE, run

HELDOUT = 3
STEPS = 300


def test_short_demo_learns_a_visible_edit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = compose(
        "demo",
        [
            "demo.train_samples=32",
            f"demo.heldout_samples={HELDOUT}",
            f"train.max_steps={STEPS}",
            "train.lr_scheduler.num_warmup_steps=10",
            "train.checkpoint_every=0",
            "predict.num_inference_steps=8",
            "data.num_workers=0",
        ],
    )
    report = run(cfg, tmp_path)
    printed = capsys.readouterr().out.split("qie demo:")[-1]
    paths = [line for line in printed.splitlines() if str(tmp_path) in line]
    assert "demo.png" in paths[0] and len(paths) >= 5  # the picture first, then the other outputs
    on_disk = json.loads((tmp_path / "demo_report.json").read_text())
    assert on_disk == report
    assert report["train_steps"] == STEPS
    assert report["heldout_loss_after"] <= 0.8 * report["heldout_loss_before"]
    # The LoRA's edits are closer to the targets than the base model's, by at least 30%.
    assert report["pixel_error_lora"] <= 0.7 * report["pixel_error_base"]
    assert report["pixel_error_drop"] >= 0.3
    assert report["learned"] is True
    # The trained VAE reconstructs the shapes (at its random initialisation, under 10 dB).
    assert report["vae_psnr_db"] >= 25
    picture = Image.open(tmp_path / "demo.png")
    assert Path(report["demo_image"]) == tmp_path / "demo.png"
    assert (
        picture.size
        == grid.grid_size(HELDOUT, len(COLUMNS), TILE)
        == (4 * TILE, grid.TITLE_HEIGHT + HELDOUT * (TILE + grid.CAPTION_HEIGHT))
    )
    assert len(list((tmp_path / "predictions" / "lora").glob("*.png"))) == HELDOUT
    assert len((tmp_path / "train" / "metrics.jsonl").read_text().splitlines()) == STEPS
    assert Path(report["lora"]).is_file()
    assert GRID_TAG in _tensorboard_image_tags(tmp_path / "train" / "tensorboard")


def _tensorboard_image_tags(logdir: Path) -> set[str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags = set()
    for events in logdir.glob("events.out.tfevents.*"):
        accumulator = EventAccumulator(str(events), size_guidance={"images": 0})
        accumulator.Reload()
        tags |= set(accumulator.Tags()["images"])
    return tags


def test_grid_rows_and_captions(tmp_path: Path) -> None:
    tiles = [[Image.new("RGB", (64, 64), c) for c in ("red", "green", "blue", "white")]] * 2
    picture = grid.captioned_grid(tiles, ["make the circle red", "make the square blue"], COLUMNS, tile=32)
    assert picture.size == grid.grid_size(2, 4, 32) == (128, grid.TITLE_HEIGHT + 2 * (32 + grid.CAPTION_HEIGHT))
    # Tiles are where the layout says, scaled whole; the caption strip under a row has dark text on white.
    assert picture.getpixel((16, grid.TITLE_HEIGHT + 16)) == (255, 0, 0)
    assert picture.getpixel((3 * 32 + 16, grid.TITLE_HEIGHT + 32 + grid.CAPTION_HEIGHT + 16)) == (255, 255, 255)
    strip = picture.crop((0, grid.TITLE_HEIGHT + 32, 128, grid.TITLE_HEIGHT + 32 + grid.CAPTION_HEIGHT))
    assert min(strip.convert("L").getdata()) < 100


@pytest.mark.slow
def test_vae_script_writes_the_same_file_twice(tmp_path: Path) -> None:
    script = Path(__file__).resolve().parent.parent / "scripts" / "train_demo_vae.py"
    env = {**os.environ, "PYTHONPATH": str(script.parent.parent)}
    for name in ("a", "b"):
        out = tmp_path / f"{name}.safetensors"
        subprocess.run([sys.executable, str(script), "--steps", "3", "--out", str(out)], check=True, env=env)
    (first, meta), (second, meta_again) = (_weights(tmp_path / f"{name}.safetensors") for name in ("a", "b"))
    assert meta == meta_again and first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)


def _weights(path: Path) -> tuple[dict, dict]:
    with safe_open(str(path), framework="pt") as f:  # the header's key order is not fixed; its content is
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


@pytest.mark.parametrize("model", ["tiny_t2i", "tiny_qwen_image_21"])
def test_the_demo_runs_for_the_other_families(model: str, tmp_path: Path) -> None:
    """Text to image draws the shapes from their descriptions (no control image); 2.1 edits RGBA images. Tiny random
    VAEs: no learning is asserted, only that every part of the demo runs and writes what it says."""
    cfg = compose("demo", [f"model={model}", "demo.train_samples=4", "demo.heldout_samples=2", "train.max_steps=2",
                           "train.checkpoint_every=0", "predict.num_inference_steps=2", "data.num_workers=0",
                           "logging.report_to=none"])  # fmt: skip
    report = run(cfg, tmp_path)
    assert report["train_steps"] == 2 and Path(report["lora"]).is_file()
    assert (tmp_path / "data" / "train" / "control_images").is_dir() == (model != "tiny_t2i")
    if model == "tiny_t2i":
        assert (tmp_path / "data" / "train" / "training_images" / "00000.txt").read_text().startswith("a ")
    assert len(list((tmp_path / "predictions" / "lora").glob("*.png"))) == 2
    assert Image.open(tmp_path / "demo.png").size == grid.grid_size(2, len(COLUMNS), TILE)
