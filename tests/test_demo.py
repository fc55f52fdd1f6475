"""A shortened demo: data, precompute, cached training, infer on held-out samples, the picture and the report."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors import safe_open

from qie import report as report_cli
from qie.checks import compose
from qie.demo import synthetic
from qie.demo.measure import layer_error
from qie.demo.run import COLUMNS, GRID_TAG, TILE, run
from qie.evaluation import grid

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
    # The demo's page: its training run's report with the picture and the measures first.
    page = (tmp_path / "report.html").read_text(encoding="utf-8")
    assert f"page:        {tmp_path / 'report.html'}" in printed and (tmp_path / "train" / "report.html").is_file()
    assert '<section id="demo-the-base-model-and-the-lora-on-the-held-out-samples">' in page
    assert 'alt="demo picture"' in page and "<td>pixel error drop</td>" in page
    assert page.index("demo picture") < page.index('<section id="training">')
    (tmp_path / "report.html").unlink()
    report_cli.main([str(tmp_path)])  # rebuilt from the folder: the same sections
    sections = re.compile("<section id=[^>]*>")
    assert sections.findall((tmp_path / "report.html").read_text()) == sections.findall(page)


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


def test_rgba_tiles_show_a_checkerboard_where_transparent() -> None:
    clear = Image.new("RGBA", (64, 64), (255, 0, 0, 0))
    half = Image.new("RGBA", (64, 64), (0, 0, 255, 255))
    half.paste((0, 0, 0, 0), (0, 0, 32, 64))
    picture = grid.captioned_grid([[clear, half]], ["layers"], ["a", "b"], tile=32)
    top, square = grid.TITLE_HEIGHT, grid.CHECKER_SQUARE
    assert picture.getpixel((0, top)) == grid.CHECKER[0]  # the colour of a transparent pixel does not show
    assert picture.getpixel((square, top)) == grid.CHECKER[1]
    assert picture.getpixel((square, top + square)) == grid.CHECKER[0]
    assert picture.getpixel((32 + 2, top + 2)) == grid.CHECKER[0]
    assert picture.getpixel((32 + 20, top + 2)) == (0, 0, 255)  # opaque pixels as they are


def _rgba(path: Path) -> np.ndarray:
    with Image.open(path) as image:
        assert image.mode == "RGBA", path
        return np.asarray(image).astype(np.int64)


def test_layered_data_are_a_background_and_one_layer_per_shape(tmp_path: Path) -> None:
    """Each sample: an opaque background layer, then 1-3 shape layers, transparent (alpha 0, colour 0) outside
    the shape; the image is their alpha composite, exactly; the caption names the shapes back to front."""
    root = synthetic.make_dataset(tmp_path / "a", train=12, heldout=2, size=48, seed=2, layered=True)
    again = synthetic.make_dataset(tmp_path / "b", train=12, heldout=2, size=48, seed=2, layered=True)
    assert sorted(p.name for p in (root / "heldout" / "images").iterdir()) == ["00000.png", "00000.txt",
                                                                               "00001.png", "00001.txt"]  # fmt: skip
    counts = []
    for image_path in sorted((root / "train" / "images").glob("*.png")):
        stem = image_path.stem
        layer_paths = sorted((root / "train" / "layers").glob(f"{stem}_*.png"))
        assert [p.name for p in layer_paths] == [f"{stem}_{n}.png" for n in range(len(layer_paths))]
        layers = [_rgba(p) for p in layer_paths]
        counts.append(len(layers))
        assert all(layer.shape == (48, 48, 4) for layer in layers)
        background, shapes = layers[0], layers[1:]
        assert (background[..., 3] == 255).all() and len(np.unique(background[..., :3].reshape(-1, 3), axis=0)) == 1
        caption = (root / "train" / "images" / f"{stem}.txt").read_text()
        named = caption.strip().split(" on a ")[0].split(", then ")
        assert len(named) == len(shapes)
        for layer, name in zip(shapes, named):
            alpha = layer[..., 3]
            inside = alpha == 255
            assert set(np.unique(alpha)) == {0, 255} and 0.02 < inside.mean() < 0.5
            assert (layer[~inside] == 0).all()  # outside the shape: alpha 0 (and no colour)
            assert not alpha[[0, -1]].any() and not alpha[:, [0, -1]].any()  # shapes stay off the edges
            color = name.split()[1]
            assert (layer[inside][:, :3] == synthetic.COLORS[color]).all(), (stem, name)
        composite = background[..., :3].astype(np.float64)
        for layer in shapes:  # "over": a * layer + (1 - a) * below
            a = layer[..., 3:] / 255
            composite = a * layer[..., :3] + (1 - a) * composite
        image = _rgba(image_path)
        assert np.array_equal(image[..., :3], composite) and (image[..., 3] == 255).all()
        assert (again / "train" / "images" / image_path.name).read_bytes() == image_path.read_bytes()
    assert set(counts) == {2, 3, 4}  # 1-3 shapes


def test_the_layered_demo_splits_the_heldout_images(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A layered model gets the layered data, splits each held-out image into as many layers as its sample has,
    and reports each layer's errors; the picture has three rows per sample (data, base model, LoRA). The smallest
    run: one training sample, one held-out sample of two layers (seed 4), two steps."""
    cfg = compose("demo", ["model=tiny_qwen_image_layered", "demo.train_samples=1", "demo.heldout_samples=1",
                           "demo.seed=4", "train.max_steps=2", "train.checkpoint_every=0", "data.num_workers=0",
                           "predict.num_inference_steps=2", "logging.report_to=none"])  # fmt: skip
    report = run(cfg, tmp_path)
    assert report["train_steps"] == 2 and Path(report["lora"]).is_file()
    assert json.loads((tmp_path / "demo_report.json").read_text()) == report
    for tag in ("base", "lora"):
        per_layer = report[f"layer_latent_error_{tag}"]
        assert len(per_layer) == 2 and report[f"latent_error_{tag}"] == pytest.approx(float(np.mean(per_layer)))
    assert report["learned"] is (report["heldout_loss_drop"] >= 0.2 and report["latent_error_drop"] >= 0.3)
    printed = capsys.readouterr().out.split("qie demo:")[-1]
    assert "layer 0 (background)" in printed and "held-out latent error" in printed
    from qie.data.images import open_image, prepare_target

    data = tmp_path / "data" / "heldout"
    assert (data / "layers").is_dir() and not (tmp_path / "data" / "train" / "control_images").exists()
    (image,) = sorted((data / "images").glob("*.png"))
    layer_files = sorted((data / "layers").glob(f"{image.stem}_*.png"))
    # The layers as the model sees them (the 640² bucket): the report's errors are those of the files written.
    expected = [(prepare_target(open_image(p, True), 640 * 640).permute(1, 2, 0).numpy() + 1) / 2 for p in layer_files]
    for tag in ("base", "lora"):
        written = sorted((tmp_path / "predictions" / tag / image.stem).iterdir())
        assert [p.name for p in written] == [f"layer_{n}.png" for n in range(len(layer_files))]
        assert all(_rgba(p).shape == (640, 640, 4) for p in written)
        errors = [layer_error(Image.open(p), e) for p, e in zip(written, expected)]
        np.testing.assert_allclose(report[f"layer_pixel_error_{tag}"], errors, rtol=1e-6)
        assert report[f"pixel_error_{tag}"] == pytest.approx(float(np.mean(errors)))
    rows = 3  # the sample's image and layers, the base model's, the LoRA's
    assert Image.open(tmp_path / "demo.png").size == grid.grid_size(rows, 1 + len(layer_files), TILE)


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


@pytest.mark.parametrize("model", [pytest.param("tiny_t2i", marks=pytest.mark.slow), "tiny_qwen_image_21"])
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
