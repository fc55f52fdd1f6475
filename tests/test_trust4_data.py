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

FAST = ["train.learning_rate=1e-3", "train.seed=3", "data.batch_size=1"]


def _pairs(root: Path, count: int = 3) -> tuple[Path, list[str]]:
    """The demo's folder layout with `count` samples, each a preference pair (a noise image rejected):
    (the data set folder, its sample ids)."""
    from helpers import write_noise_image

    from qie.demo.synthetic import make_dataset

    make_dataset(root, train=count, heldout=0, size=64)
    data = root / "train"
    stems = sorted(p.stem for p in (data / "training_images").glob("*.png"))
    for i, stem in enumerate(stems):
        write_noise_image(data / "rejected_images" / f"{stem}.png", 100 + i, (64, 64))
    return data, stems


def _train(data: Path, run: Path, *overrides: str) -> dict:
    from helpers import small_config

    from qie.stages import train

    return train.run(small_config("train", f"data.path={data}", f"cache.dir={run.parent / 'cache'}", *FAST,
                                  *overrides), run)  # fmt: skip


# --- a LoRA for another model: the file's own key --------------------------------------------------------


def test_a_lora_for_another_model_is_named_by_the_key_its_file_holds(tiny_path: Path, tmp_path: Path) -> None:
    """A kohya file of another model's modules: diffusers reads `double_blocks_0_img_attn_qkv` as
    `transformer_blocks..attn.qkv`; the message names the file's key."""
    from diffusers import QwenImageTransformer2DModel

    from qie.adapters.lora import load_lora

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

    source = DataSource(path=str(ds), format="hf", columns=Columns(rejected="rejected"), images_dir=tmp_path / "img")
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


# --- preference pairs whose rejected image is their target ------------------------------------------------


def test_a_pair_whose_rejected_image_is_its_target_is_left_out_and_none_left_is_refused(
    tiny_path: Path, tmp_path: Path, capsys
) -> None:
    """Such a pair's loss is ln 2 whatever the weights: it is skipped with a warning naming it (as a mask that
    trains nothing is), the others train; with none left the run is refused in one line."""
    import shutil

    data, stems = _pairs(tmp_path / "ds")
    same = data / "rejected_images" / f"{stems[0]}.png"
    shutil.copy(data / "training_images" / f"{stems[0]}.png", same)
    _train(data, tmp_path / "run", "train/objective=dpo", "cache.mode=lazy")
    out = capsys.readouterr().out
    why = (f"its rejected image {str(same)!r} is its target {str(data / 'training_images' / f'{stems[0]}.png')!r} "
           "(the same bytes): a pair of equal results has the loss ln 2 whatever the weights and trains nothing; "
           "give a worse result")  # fmt: skip
    assert f"qie: warning: skipping sample {stems[0]!r}: {same}: {why}\n" in out
    assert "qie: data: 2 samples" in out
    for stem in stems[1:]:
        shutil.copy(data / "training_images" / f"{stem}.png", data / "rejected_images" / f"{stem}.png")
    with pytest.raises(DataError) as info:
        _train(data, tmp_path / "run_none", "train/objective=dpo", "cache.mode=lazy")
    assert str(info.value) == f"no preference pair can train; the first, {stems[0]!r}: {why}"


# --- rejected images: found at start, and never the cause of a sample that does not train on them -----------


def test_lazy_pairs_read_each_rejected_image_at_start(tiny_path: Path, tmp_path: Path, capsys) -> None:
    """With cache.mode=lazy an unreadable rejected image, and one of another size than its target, are found
    before the first step (their samples skipped with a warning), not when their batch comes."""
    from helpers import write_noise_image

    data, stems = _pairs(tmp_path / "ds")
    broken = data / "rejected_images" / f"{stems[1]}.png"
    broken.write_bytes(b"not an image")
    other = write_noise_image(data / "rejected_images" / f"{stems[2]}.png", 7, (32, 64))
    result = _train(data, tmp_path / "run", "train/objective=dpo", "cache.mode=lazy", "train.max_steps=4")
    out = capsys.readouterr().out
    assert (f"qie: warning: skipping sample {stems[1]!r}: {broken}: image {str(broken)!r} cannot be read "
            f"(cannot identify image file {str(broken)!r}): replace or remove it\n") in out  # fmt: skip
    assert (f"qie: warning: skipping sample {stems[2]!r}: {other}: rejected image {str(other)!r} is 32x96 once "
            "resized, its target 64x64: make them one shape\n") in out  # fmt: skip
    assert "qie: data: 1 samples" in out and result["step"] == 4


def test_a_broken_rejected_image_costs_only_its_own_entry(tiny_path: Path, tmp_path: Path) -> None:
    """Precompute fails only the rejected latent of a broken rejected image (the target's entries are written),
    so the default objective, which reads no rejected result, trains on every sample."""
    from helpers import small_config

    from qie.stages import precompute

    data, stems = _pairs(tmp_path / "ds")
    (data / "rejected_images" / f"{stems[0]}.png").write_bytes(b"not an image")
    overrides = [f"data.path={data}", f"cache.dir={tmp_path / 'cache'}"]
    summary = precompute.run(small_config("precompute", *overrides), tmp_path / "pre")
    assert {t: (s.new, s.failed) for t, s in summary.types.items() if s.new or s.failed} == {
        "pixel_latent": (3, 0), "control_latent": (3, 0), "rejected_latent": (2, 1), "prompt_embed": (3, 0),
        "empty_prompt_embed": (3, 0)}  # fmt: skip
    import io
    from contextlib import redirect_stdout

    with redirect_stdout(io.StringIO()) as out:
        _train(data, tmp_path / "run")
    assert "qie: data: 3 samples" in out.getvalue() and "skipping" not in out.getvalue()
