"""Masked and edit-region loss: masks on the latent grid, keyed by bytes, through every source; an all-white mask
trains exactly as no mask does."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from helpers import CachedData, hf_extra_image_column, small_config
from PIL import Image
from test_train import LOSSES, TRAINING

from qie.cache.keys import FileHasher
from qie.data.masks import MaskSettings, make_mask, mask_key, to_grid, to_latent, weights
from qie.data.samples import Sample
from qie.errors import ConfigError
from qie.models.flow import velocity_loss
from qie.stages import train as train_stage

SETTINGS = dict(target_pixels=64 * 64, multiple_of=32)


def test_an_all_ones_mask_gives_exactly_the_plain_loss_and_a_mask_weights_it() -> None:
    g = torch.Generator().manual_seed(0)
    pred, target, sigmas = torch.randn(2, 6, 4, generator=g), torch.randn(2, 6, 4, generator=g), torch.rand(2)
    plain = velocity_loss(pred, target, sigmas)
    assert torch.equal(velocity_loss(pred, target, sigmas, element_weights=torch.ones(2, 6, 1)), plain)
    w = torch.tensor([[1.0, 1, 0.25, 0.25, 0, 1], [1, 1, 1, 1, 1, 0.5]])[..., None]
    err = (pred - target) ** 2
    by_hand = [(err[i] * w[i]).sum() / (w[i].expand(6, 4).sum()) for i in range(2)]
    torch.testing.assert_close(velocity_loss(pred, target, sigmas, element_weights=w), sum(by_hand) / 2)


def _images(tmp_path: Path) -> tuple[Path, Path]:
    control = Image.new("RGB", (64, 64), (200, 200, 200))
    target = control.copy()
    target.paste((10, 20, 200), (24, 24, 32, 32))  # an 8x8 square changed
    control.save(tmp_path / "control.png")
    target.save(tmp_path / "target.png")
    return tmp_path / "target.png", tmp_path / "control.png"


def test_a_mask_file_reaches_the_latent_grid_by_area(tmp_path: Path) -> None:
    target, _ = _images(tmp_path)
    mask = Image.new("L", (64, 64), 0)
    mask.paste(255, (0, 0, 20, 64))  # the left 20 columns white
    mask.save(tmp_path / "mask.png")
    sample = Sample(id="a", target=target, controls=(), prompt="p", mask=tmp_path / "mask.png")
    pixels = make_mask(sample, MaskSettings("file", **SETTINGS))
    assert pixels.shape == (64, 64) and pixels[:, :20].eq(1).all() and pixels[:, 20:].eq(0).all()
    latent = to_latent(to_grid(pixels), 4, 4)  # a 16x latent grid (Qwen-Image-2.1's)
    assert latent.shape == (1, 1, 4, 4)
    assert latent[0, 0, 0].tolist() == [1.0, 0.25, 0.0, 0.0]  # column 1 covers pixels 16..31: 4 of 16 white
    assert weights(latent, 0.2)[0, 0, 0].tolist() == pytest.approx([1.0, 0.4, 0.2, 0.2])


def test_the_edit_region_is_where_target_and_control_differ_grown_by_the_dilation(tmp_path: Path) -> None:
    target, control = _images(tmp_path)
    sample = Sample(id="a", target=target, controls=(control,), prompt="p")
    changed = make_mask(sample, MaskSettings("edit", threshold=0.05, dilation=0, **SETTINGS))
    assert changed.sum() == 64 and changed[24:32, 24:32].eq(1).all()
    grown = make_mask(sample, MaskSettings("edit", threshold=0.05, dilation=4, **SETTINGS))
    assert grown.sum() == 16 * 16 and grown[20:36, 20:36].eq(1).all()
    assert to_grid(grown).shape == (1, 1, 8, 8)


def test_mask_entries_are_keyed_by_bytes(tmp_path: Path) -> None:
    target, control = _images(tmp_path)
    hasher = FileHasher()
    shutil.copy(target, tmp_path / "elsewhere.png")
    edit = MaskSettings("edit", **SETTINGS)
    key = mask_key(Sample(id="a", target=target, controls=(control,), prompt="p"), edit, hasher)
    assert key == mask_key(
        Sample(id="b", target=tmp_path / "elsewhere.png", controls=(control,), prompt="q"), edit, hasher
    )
    assert key != mask_key(
        Sample(id="a", target=target, controls=(control,), prompt="p"),
        MaskSettings("edit", dilation=3, **SETTINGS),
        hasher,
    )
    assert (
        mask_key(Sample(id="a", target=target, controls=(), prompt="p"), edit, hasher) is None
    )  # nothing to compare with: no mask
    assert (
        mask_key(Sample(id="a", target=target, controls=(), prompt="p"), MaskSettings("file", **SETTINGS), hasher)
        is None
    )  # no file


@pytest.fixture
def data_copy(cached_data: CachedData, tmp_path: Path) -> CachedData:
    """A copy of the cached data set and its cache (the entries are keyed by bytes: they still hit)."""
    root = tmp_path / "copy"
    shutil.copytree(cached_data.root, root)
    return CachedData(root, root / "train", root / "cache")


def test_white_masks_train_exactly_as_no_mask(data_copy: CachedData, tmp_path: Path) -> None:
    (data_copy.data / "masks").mkdir()
    for target in (data_copy.data / "training_images").glob("*.png"):
        Image.new("L", Image.open(target).size, 255).save(data_copy.data / "masks" / target.name)
    cfg = small_config("train", *data_copy.overrides, *TRAINING, "train.mask.source=file")
    result = train_stage.run(cfg, tmp_path / "run")
    assert result["losses"] == pytest.approx(LOSSES, rel=1e-6), f"losses: {result['losses']}"
    assert len(list((data_copy.cache / "loss_mask").rglob("*.safetensors"))) == 8  # one entry per sample


def test_edit_region_loss_trains_and_caches_its_masks(data_copy: CachedData, tmp_path: Path) -> None:
    cfg = small_config("train", *data_copy.overrides, *TRAINING, "train.mask.source=edit",
                       "train.mask.outside_weight=0.1", "train.mask.dilation=2")  # fmt: skip
    result = train_stage.run(cfg, tmp_path / "run")
    assert len(result["losses"]) == 4 and result["losses"] != pytest.approx(LOSSES, rel=1e-3)
    entries = sorted((data_copy.cache / "loss_mask").rglob("*.safetensors"))
    assert len(entries) == 8
    again = train_stage.run(cfg, tmp_path / "again")  # masks now read from the cache: the same run
    assert again["losses"] == result["losses"]
    assert sorted((data_copy.cache / "loss_mask").rglob("*.safetensors")) == entries


def test_edit_masks_need_control_images(cached_data: CachedData) -> None:
    """Refused when the config is composed (`qie.checks.validate`), before the stage reads anything."""
    with pytest.raises(ConfigError, match="train.mask.source=edit compares each target with its control"):
        small_config("train", *cached_data.overrides, "model=tiny_t2i", "train.mask.source=edit")
    with pytest.raises(ConfigError, match="outside_weight=2.0 is out of range"):
        small_config("train", *cached_data.overrides, "train.mask.source=file", "train.mask.outside_weight=2")


def test_masks_are_found_in_folders_and_manifests(tmp_path: Path) -> None:
    from qie.data.scan import scan_dataset

    (tmp_path / "training_images").mkdir()
    (tmp_path / "masks").mkdir()
    for stem in ("a", "b"):
        Image.new("RGB", (8, 8)).save(tmp_path / "training_images" / f"{stem}.png")
        (tmp_path / "training_images" / f"{stem}.txt").write_text("p")
    Image.new("L", (8, 8)).save(tmp_path / "masks" / "a.png")
    found = {s.id: s.mask for s in scan_dataset(tmp_path).samples}
    assert found == {"a": tmp_path / "masks" / "a.png", "b": None}
    manifest = tmp_path / "m.jsonl"
    manifest.write_text('{"target": "training_images/a.png", "prompt": "p", "mask": "masks/a.png"}\n'
                        '{"target": "training_images/b.png", "prompt": "p", "mask": "masks/none.png"}\n')  # fmt: skip
    data = scan_dataset(manifest)
    assert [s.mask for s in data.samples] == [tmp_path / "masks" / "a.png"]
    assert "masks/none.png" in data.problems[0].reason


def test_a_hf_column_of_masks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mask, (first, second) = hf_extra_image_column(tmp_path, monkeypatch, "mask")
    assert first.mask.read_bytes() == mask and second.mask is None
