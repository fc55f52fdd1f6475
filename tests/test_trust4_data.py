"""Trust, fourth round (data): preference pairs whose rejected image is their target are left out; rejected images
are checked at start and never cost a sample that does not train on them; every image kind of every layout is
confined to its data set's folder, symbolic links followed; a LoRA key that does not fit is named as its file
writes it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from qie.errors import DataError, ModelLoadError

# --- a LoRA for another model: the file's own key --------------------------------------------------------


def test_a_lora_for_another_model_is_named_by_the_key_its_file_holds(tiny_path: Path, tmp_path: Path) -> None:
    """A kohya file of another model's modules: diffusers reads `double_blocks_0_img_attn_qkv` as
    `transformer_blocks..attn.qkv`; the message names the file's key."""
    from diffusers import QwenImageTransformer2DModel

    from qie.training.lora import load_lora

    transformer = QwenImageTransformer2DModel.from_pretrained(tiny_path / "transformer")
    file = tmp_path / "flux.safetensors"
    save_file({"lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight": torch.zeros(4, 16),
               "lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight": torch.zeros(48, 4),
               "lora_unet_double_blocks_0_img_attn_qkv.alpha": torch.tensor(4.0)}, str(file))  # fmt: skip
    with pytest.raises(ModelLoadError) as info:
        load_lora(transformer, file)
    assert str(info.value) == (
        f"LoRA {str(file)!r} does not fit this model: key 'lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight' "
        "names a module the transformer does not have (a LoRA for another model?)"
    )


# --- every image kind of every layout stays inside its folder ----------------------------------------------

OUTSIDE = "through a symbolic link, outside the data set folder"


def _edit_folder(root: Path, stems: list[str]) -> Path:
    from helpers import write_noise_image

    for i, stem in enumerate(stems):
        for sub, seed in (("training_images", 1), ("control_images", 2), ("masks", 3), ("rejected_images", 4)):
            write_noise_image(root / sub / f"{stem}.png", 10 * i + seed, (16, 16))
        (root / "training_images" / f"{stem}.txt").write_text(f"edit {stem}", encoding="utf-8")
    return root


def test_a_folder_data_set_refuses_links_leading_out_for_every_image_kind(tmp_path: Path) -> None:
    """A target, control, mask or rejected image that is a link to a file outside the data set folder, and every
    image of a linked folder leading outside, is a problem of its sample (naming where it leads), as a manifest's
    is; a link inside is fine; `data.allow_outside_paths=true` takes them all. A remembered scan says the same."""
    from qie.data.scan import scan_dataset

    secret = tmp_path / "secret.png"
    secret.write_bytes((_edit_folder(tmp_path / "x", ["x"]) / "training_images" / "x.png").read_bytes())
    root = _edit_folder(tmp_path / "ds", ["ok", "t", "c", "m", "r", "inner"])
    for sub, stem in (("training_images", "t"), ("control_images", "c"), ("masks", "m"), ("rejected_images", "r")):
        (root / sub / f"{stem}.png").unlink()
        (root / sub / f"{stem}.png").symlink_to(secret)
    (root / "training_images" / "inner.png").unlink()
    (root / "training_images" / "inner.png").symlink_to(root / "control_images" / "ok.png")  # a link inside
    cache = tmp_path / "cache"
    cache.mkdir()
    for index_dir in (None, cache / "manifests", cache / "manifests"):  # plain, remembered, read back
        data = scan_dataset(root, index_dir=index_dir)
        assert [s.id for s in data.samples] == ["inner", "ok"]
        assert {p.id: p.reason for p in data.problems} == {
            stem: f"image {str(root / sub / f'{stem}.png')!r} leads to {str(secret)!r} {OUTSIDE} {str(root)!r}: "
            "move it inside, or set data.allow_outside_paths=true"
            for sub, stem in (("training_images", "t"), ("control_images", "c"), ("masks", "m"),
                              ("rejected_images", "r"))
        }  # fmt: skip
    assert [s.id for s in scan_dataset(root, allow_outside=True).samples] == ["c", "inner", "m", "ok", "r", "t"]

    linked = tmp_path / "linked"  # a folder of the data set that is a link to one elsewhere
    _edit_folder(linked, ["a"])
    (linked / "elsewhere").mkdir()
    (linked / "control_images").rename(linked / "elsewhere" / "control_images")
    outside = tmp_path / "outside_controls"
    (linked / "elsewhere" / "control_images").rename(outside)
    (linked / "control_images").symlink_to(outside, target_is_directory=True)
    with pytest.raises(DataError, match=f"leads to {str(outside / 'a.png')!r} {OUTSIDE}"):
        scan_dataset(linked)
    assert [s.id for s in scan_dataset(linked, allow_outside=True).samples] == ["a"]


def test_a_layered_folder_refuses_a_layer_leading_out(tmp_path: Path) -> None:
    from helpers import write_noise_image

    from qie.data.scan import scan_dataset

    root = tmp_path / "layered"
    for stem in ("in", "out"):
        write_noise_image(root / "images" / f"{stem}.png", 1, (16, 16))
        (root / "images" / f"{stem}.txt").write_text("a poster", encoding="utf-8")
        for n in range(2):
            write_noise_image(root / "layers" / f"{stem}_{n}.png", 2 + n, (16, 16))
    elsewhere = write_noise_image(tmp_path / "elsewhere.png", 5, (16, 16))
    (root / "layers" / "out_1.png").unlink()
    (root / "layers" / "out_1.png").symlink_to(elsewhere)
    data = scan_dataset(root)
    assert [s.id for s in data.samples] == ["in"]
    assert [(p.id, p.reason.split(" leads to ")[1]) for p in data.problems] == [
        ("out", f"{str(elsewhere)!r} {OUTSIDE} {str(root)!r}: move it inside, or set data.allow_outside_paths=true")
    ]


def test_a_hugging_face_data_set_refuses_image_paths_leading_out(tmp_path: Path, monkeypatch) -> None:
    """Image columns holding file paths: one outside the data set's folder (absolute, or a link inside leading
    out) is a problem of its row; a path inside (relative or absolute) is read; allow_outside takes them all."""
    datasets = pytest.importorskip("datasets")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    from helpers import write_noise_image

    from qie.data.formats import DataSource, read_dataset

    ds = tmp_path / "ds"
    elsewhere = write_noise_image(tmp_path / "elsewhere.png", 1, (16, 16))
    for name in ("t", "c", "r"):
        write_noise_image(tmp_path / "files" / f"{name}.png", 2, (16, 16))
    rows = {"target": ["t.png", str(ds / "t.png"), "t.png", str(elsewhere)],
            "controls": [["c.png"], ["c.png"], ["c.png"], ["c.png"]],
            "rejected": ["r.png", "r.png", "linked.png", "r.png"], "prompt": ["a", "b", "c", "d"]}  # fmt: skip
    datasets.Dataset.from_dict(rows).save_to_disk(str(ds))
    for name in ("t", "c", "r"):
        (tmp_path / "files" / f"{name}.png").rename(ds / f"{name}.png")
    (ds / "linked.png").symlink_to(elsewhere)
    from qie.data.hf import Columns

    source = DataSource(str(ds), "hf", columns=Columns(rejected="rejected"), images_dir=tmp_path / "img")
    data = read_dataset(source)
    assert [s.id for s in data.samples] == ["row000000", "row000001"]
    assert {p.id: p.reason for p in data.problems} == {
        "row000002": f"image {str(ds / 'linked.png')!r} (a link to {str(elsewhere)!r}) lies outside the data set's "
        f"folder {str(ds)!r}: move it inside, or set data.allow_outside_paths=true",
        "row000003": f"image {str(elsewhere)!r} lies outside the data set's folder {str(ds)!r}: move it inside, or "
        "set data.allow_outside_paths=true",
    }
    from dataclasses import replace

    assert len(read_dataset(replace(source, allow_outside=True)).samples) == 4
