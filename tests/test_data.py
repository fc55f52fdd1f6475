"""Data sets (folder layout, manifests), image reading and conversion, and cache keys. No model needed."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions
from helpers import write_solid_image
from PIL import Image

from qie.cache.keys import FileHasher
from qie.data.images import ImageError, fit_area, open_image, to_rgb
from qie.data.keys import KeyContext, sample_keys
from qie.data.samples import Sample
from qie.data.scan import scan_dataset
from qie.errors import DataError


def _folder(root: Path, stems: list[str]) -> Path:
    for i, stem in enumerate(stems):
        write_solid_image(root / "training_images" / f"{stem}.png", (i, 0, 0))
        write_solid_image(root / "control_images" / f"{stem}.png", (0, i, 0))
        (root / "training_images" / f"{stem}.txt").write_text(f"  edit {stem}\n", encoding="utf-8")
    return root


# ---------------------------------------------------------------- folder layout


def test_folder_layout_finds_samples_controls_and_captions(tmp_path: Path) -> None:
    root = _folder(tmp_path / "ds", ["b", "a"])
    write_solid_image(root / "control_images" / "a_control_2.png")
    write_solid_image(root / "control_images" / "a_control_1.png")
    write_solid_image(root / "control_images" / "._a.png")  # macOS metadata file: ignored
    data = scan_dataset(root)
    assert [s.id for s in data.samples] == ["a", "b"]
    a = data.samples[0]
    assert a.target == root / "training_images" / "a.png"
    assert [p.name for p in a.controls] == ["a.png", "a_control_1.png", "a_control_2.png"]
    assert a.prompt == "edit a"
    assert data.problems == []


def test_caption_may_sit_beside_the_control_image(tmp_path: Path) -> None:
    root = _folder(tmp_path / "ds", ["a"])
    (root / "training_images" / "a.txt").unlink()
    (root / "control_images" / "a.txt").write_text("from control dir", encoding="utf-8")
    assert scan_dataset(root).samples[0].prompt == "from control dir"


def test_folder_problems_name_the_file(tmp_path: Path) -> None:
    root = _folder(tmp_path / "ds", ["good", "nocap", "noctl", "latin1"])
    (root / "training_images" / "nocap.txt").unlink()
    (root / "control_images" / "noctl.png").unlink()
    (root / "training_images" / "latin1.txt").write_bytes("caf\xe9 au lait".encode("latin-1"))
    write_solid_image(root / "control_images" / "orphan.png")  # a control image without a target
    data = scan_dataset(root)
    assert [s.id for s in data.samples] == ["good"]
    problems = {p.id: p for p in data.problems}
    assert set(problems) == {"nocap", "noctl", "latin1", "orphan"}
    assert problems["nocap"].path == str(root / "training_images" / "nocap.txt")
    assert "missing" in problems["nocap"].reason
    assert problems["noctl"].path.startswith(str(root / "control_images" / "noctl"))
    assert "control image is missing" in problems["noctl"].reason
    assert problems["latin1"].path == str(root / "training_images" / "latin1.txt")
    assert "not UTF-8" in problems["latin1"].reason
    assert "target image is missing" in problems["orphan"].reason


def test_empty_or_wrong_folders_are_clear_errors(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    (empty / "training_images").mkdir(parents=True)
    (empty / "control_images").mkdir()
    with pytest.raises(DataError, match=r"no usable sample(.|\n)*holds no samples"):
        scan_dataset(empty)
    (tmp_path / "plain").mkdir()
    with pytest.raises(DataError, match="not a data set folder"):
        scan_dataset(tmp_path / "plain")
    with pytest.raises(DataError, match="does not exist"):
        scan_dataset(tmp_path / "nowhere")
    only_bad = _folder(tmp_path / "bad", ["x"])
    (only_bad / "training_images" / "x.txt").unlink()
    with pytest.raises(DataError, match=r"no usable sample(.|\n)*x\.txt"):
        scan_dataset(only_bad)


def test_infer_layout_needs_no_target(tmp_path: Path) -> None:
    root = tmp_path / "ds"
    write_solid_image(root / "control_images" / "q.png")
    (root / "control_images" / "q.txt").write_text("do it", encoding="utf-8")
    (root / "training_images").mkdir()
    data = scan_dataset(root, require_target=False)
    assert [(s.id, s.target, s.prompt) for s in data.samples] == [("q", None, "do it")]


def test_folder_without_control_images_is_text_to_image(tmp_path: Path) -> None:
    root = _folder(tmp_path / "ds", ["b", "a"])
    for path in (root / "control_images").iterdir():
        path.unlink()
    (root / "control_images").rmdir()
    data = scan_dataset(root)
    assert [(s.id, s.controls, s.prompt) for s in data.samples] == [("a", (), "edit a"), ("b", (), "edit b")]
    assert data.problems == []


# ---------------------------------------------------------------- manifests


def test_jsonl_manifest_paths_relative_to_the_manifest(tmp_path: Path) -> None:
    for name in ("t1.png", "c1.png", "c2.png"):
        write_solid_image(tmp_path / "img" / name)
    rows = [
        {"target": "../img/t1.png", "controls": ["../img/c1.png", "../img/c2.png"], "prompt": "two controls"},
        {"target": "../img/t1.png", "controls": "../img/c1.png", "prompt": "same target, string control"},
        {"target": "../img/t1.png", "controls": ["../img/missing.png"], "prompt": "bad path"},
        {"target": "../img/t1.png", "controls": ["../img/c1.png"]},
        ["not", "an", "object"],
    ]
    manifest = tmp_path / "meta" / "m.jsonl"
    manifest.parent.mkdir()
    manifest.write_text("\n".join([json.dumps(r) for r in rows] + ["{not json", ""]), encoding="utf-8")

    data = scan_dataset(manifest, allow_outside=True)
    img = manifest.parent / "../img"
    by_prompt = {s.prompt: s for s in data.samples}
    assert set(by_prompt) == {"two controls", "same target, string control"}
    assert by_prompt["two controls"].controls == (img / "c1.png", img / "c2.png")
    assert by_prompt["same target, string control"].controls == (img / "c1.png",)
    assert by_prompt["two controls"].target == img / "t1.png"
    assert len({s.id for s in data.samples}) == 2  # one target, two rows: ids stay unique
    assert len(data.problems) == 4
    bad = next(p for p in data.problems if "does not exist" in p.reason)
    assert bad.path == str(img / "missing.png")
    reasons = " | ".join(p.reason for p in data.problems)
    assert "has no 'prompt'" in reasons and "is a JSON list" in reasons and "not JSON" in reasons


def test_manifest_paths_outside_its_folder_are_refused_unless_allowed(tmp_path: Path) -> None:
    for name in ("t.png", "c.png"):
        write_solid_image(tmp_path / "img" / name)
        write_solid_image(tmp_path / "meta" / "in" / name)
    rows = [
        {"id": "inside", "target": "in/t.png", "controls": ["./in/c.png"], "prompt": "ok"},
        {"id": "dotdot", "target": "in/t.png", "controls": ["../img/c.png"], "prompt": "climbs out"},
        {"id": "sneaky", "target": "in/../../img/t.png", "controls": ["in/c.png"], "prompt": "climbs out"},
        {"id": "absolute", "target": str(tmp_path / "img" / "t.png"), "controls": ["in/c.png"], "prompt": "abs"},
    ]
    manifest = tmp_path / "meta" / "m.jsonl"
    manifest.write_text("\n".join(json.dumps(r) for r in rows), encoding="utf-8")
    data = scan_dataset(manifest)
    assert [s.id for s in data.samples] == ["inside"]
    assert {p.id: p.reason.split(": ", 1)[1] for p in data.problems} == {
        "dotdot": f"'../img/c.png' lies outside the manifest's folder {str(manifest.parent)!r}: move it inside, "
        "or set data.allow_outside_paths=true",
        "sneaky": f"'in/../../img/t.png' lies outside the manifest's folder {str(manifest.parent)!r}: move it "
        "inside, or set data.allow_outside_paths=true",
        "absolute": f"{str(tmp_path / 'img' / 't.png')!r} lies outside the manifest's folder "
        f"{str(manifest.parent)!r}: move it inside, or set data.allow_outside_paths=true",
    }
    allowed = scan_dataset(manifest, allow_outside=True)
    assert sorted(s.id for s in allowed.samples) == ["absolute", "dotdot", "inside", "sneaky"]


def test_csv_manifest_with_list_or_pipe_controls(tmp_path: Path) -> None:
    for name in ("t.png", "c1.png", "c2.png"):
        write_solid_image(tmp_path / name)
    (tmp_path / "m.csv").write_text(
        "target,controls,prompt\n"
        't.png,"[""c1.png"", ""c2.png""]",json list\n'
        "t.png,c1.png|c2.png,pipes\n"
        't.png,"[broken",bad json\n',
        encoding="utf-8",
    )
    data = scan_dataset(tmp_path / "m.csv")
    assert sorted(s.prompt for s in data.samples) == ["json list", "pipes"]
    for s in data.samples:
        assert s.controls == (tmp_path / "c1.png", tmp_path / "c2.png")
    (problem,) = data.problems
    assert problem.path == f"{tmp_path / 'm.csv'}:4" and "controls" in problem.reason


def test_manifest_errors(tmp_path: Path) -> None:
    (tmp_path / "m.txt").write_text("x")
    with pytest.raises(DataError, match=r"\.jsonl or \.csv"):
        scan_dataset(tmp_path / "m.txt")
    (tmp_path / "m.jsonl").write_bytes(b'{"prompt": "caf\xe9"}\n')
    with pytest.raises(DataError, match="not UTF-8"):
        scan_dataset(tmp_path / "m.jsonl")


# ---------------------------------------------------------------- images


def test_rgba_is_composited_on_white(tmp_path: Path) -> None:
    img = Image.new("RGBA", (2, 1))
    img.putpixel((0, 0), (0, 0, 255, 255))  # opaque blue stays blue
    img.putpixel((1, 0), (255, 0, 0, 0))  # transparent red becomes white
    img.save(tmp_path / "a.png")
    out = open_image(tmp_path / "a.png")
    assert out.mode == "RGB"
    assert np.asarray(out).tolist() == [[[0, 0, 255], [255, 255, 255]]]
    la = Image.new("LA", (1, 1), (7, 0))
    assert np.asarray(to_rgb(la)).tolist() == [[[255, 255, 255]]]


def test_grey_and_palette_images_are_converted(tmp_path: Path) -> None:
    Image.fromarray(np.array([[0, 128, 255]], dtype=np.uint8), "L").save(tmp_path / "l.png")
    assert np.asarray(open_image(tmp_path / "l.png")).tolist() == [[[0] * 3, [128] * 3, [255] * 3]]
    pal = Image.new("P", (2, 1))
    pal.putpalette([0, 0, 0, 200, 100, 50, 10, 20, 30] + [0] * (256 * 3 - 9))
    pal.putpixel((0, 0), 1)
    pal.putpixel((1, 0), 2)
    pal.save(tmp_path / "p.png")
    assert np.asarray(open_image(tmp_path / "p.png")).tolist() == [[[200, 100, 50], [10, 20, 30]]]
    pal.info["transparency"] = 2  # palette index 2 is transparent: white
    pal.save(tmp_path / "pt.png", transparency=2)
    assert np.asarray(open_image(tmp_path / "pt.png")).tolist() == [[[200, 100, 50], [255, 255, 255]]]


def test_16_bit_and_32_bit_images_are_scaled(tmp_path: Path) -> None:
    values = np.array([[0, 257 * 100, 65535]], dtype=np.uint16)
    Image.fromarray(values).save(tmp_path / "i16.png")
    with Image.open(tmp_path / "i16.png") as raw:
        assert raw.mode == "I;16"
    assert np.asarray(open_image(tmp_path / "i16.png")).tolist() == [[[0] * 3, [100] * 3, [255] * 3]]
    wide = Image.fromarray(np.array([[0, 1000, 65535]], dtype=np.int32), "I")
    assert np.asarray(to_rgb(wide))[0, :, 0].tolist() == [0, 4, 255]  # round(1000 / 65535 * 255)
    small = Image.fromarray(np.array([[3, 200]], dtype=np.int32), "I")
    assert np.asarray(to_rgb(small))[0, :, 0].tolist() == [3, 200]
    flt = Image.fromarray(np.array([[0.0, 0.5, 1.0]], dtype=np.float32), "F")
    assert np.asarray(to_rgb(flt))[0, :, 0].tolist() == [0, 128, 255]


def test_exif_orientation_is_applied(tmp_path: Path) -> None:
    img = Image.new("RGB", (4, 2), (255, 0, 0))
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90° clockwise to display
    img.save(tmp_path / "r.jpg", exif=exif)
    assert open_image(tmp_path / "r.jpg").size == (2, 4)


def test_unreadable_images_name_the_file(tmp_path: Path) -> None:
    (tmp_path / "bad.png").write_bytes(b"\x89PNG\r\n\x1a\n garbage")
    write_solid_image(tmp_path / "ok.png")
    (tmp_path / "cut.png").write_bytes((tmp_path / "ok.png").read_bytes()[:40])
    (tmp_path / "dir.png").mkdir()
    for name in ("bad.png", "cut.png", "missing.png", "dir.png"):
        with pytest.raises(ImageError) as info:
            open_image(tmp_path / name)
        assert info.value.path == str(tmp_path / name)
        assert str(tmp_path / name) in str(info.value)
        assert isinstance(info.value, DataError)


@pytest.mark.parametrize("w,h", [(64, 64), (80, 48), (48, 80), (1000, 333), (33, 1000)])
def test_fit_area_matches_diffusers(w: int, h: int) -> None:
    for area in (4096, 384 * 384, 1024 * 1024):
        dw, dh, _ = calculate_dimensions(area, w / h)
        assert fit_area(w, h, area) == (max(32, dw), max(32, dh))


# ---------------------------------------------------------------- keys


def _ctx(**changes) -> KeyContext:
    base = dict(
        vae_fingerprint="vae0",
        text_encoder_fingerprint="te0",
        prompt_template="tpl",
        target_pixels=4096,
        resize_mode="resize",
        multiple_of=32,
        vae_image_pixels=4096,
        vl_image_pixels=4096,
    )
    return KeyContext(**{**base, **changes})


PROMPT_TYPES = {"prompt_embed", "prompt_embeds_mask"}
EMPTY_TYPES = {"empty_prompt_embed", "empty_prompt_embeds_mask"}
TEXT_TYPES = PROMPT_TYPES | EMPTY_TYPES
ALL = {"pixel_latent", "control_latent"} | TEXT_TYPES


@pytest.mark.parametrize(
    "change,expected",
    [
        ({"vae_fingerprint": "vae1"}, {"pixel_latent", "control_latent"}),
        ({"text_encoder_fingerprint": "te1"}, TEXT_TYPES),
        ({"prompt_template": "other"}, TEXT_TYPES),
        ({"target_pixels": 8192}, {"pixel_latent"}),
        ({"resize_mode": "crop"}, {"pixel_latent"}),
        ({"multiple_of": 16}, {"pixel_latent"}),
        ({"vae_image_pixels": 8192}, {"control_latent"}),
        ({"vl_image_pixels": 8192}, TEXT_TYPES),
        ({"processor_fingerprint": "proc1"}, TEXT_TYPES),
        ({"dtype": "bfloat16"}, ALL),
        ({"text_encoder_quantize": "int8"}, TEXT_TYPES),
        ({"text_encoder_quantize": "fp8"}, TEXT_TYPES),
    ],
)
def test_keys_change_exactly_with_what_they_depend_on(tmp_path: Path, change: dict, expected: set) -> None:
    sample = Sample(
        id="a",
        target=write_solid_image(tmp_path / "t.png"),
        controls=(write_solid_image(tmp_path / "c.png", (1, 2, 3)),),
        prompt="p",
    )
    hasher = FileHasher()
    before, after = sample_keys(sample, _ctx(), hasher), sample_keys(sample, _ctx(**change), hasher)
    assert {t for t in before if before[t] != after[t]} == expected


def test_keys_follow_file_bytes_and_prompt(tmp_path: Path) -> None:
    t, c = write_solid_image(tmp_path / "t.png"), write_solid_image(tmp_path / "c.png", (1, 2, 3))
    c2 = write_solid_image(tmp_path / "c2.png", (9, 9, 9))
    hasher, ctx = FileHasher(), _ctx()
    base = sample_keys(Sample(id="a", target=t, controls=(c,), prompt="p"), ctx, hasher)
    assert set(base) == ALL and len(set(base.values())) == 4  # a mask shares its embedding's key
    assert base["prompt_embeds_mask"] == base["prompt_embed"] != base["empty_prompt_embed"]
    assert base["empty_prompt_embeds_mask"] == base["empty_prompt_embed"]

    def changed(sample: Sample) -> set:
        keys = sample_keys(sample, ctx, hasher)
        return {k for k in base if base[k] != keys[k]}

    assert changed(Sample(id="other-id", target=t, controls=(c,), prompt="p")) == set()  # the id is not content
    assert changed(Sample(id="a", target=t, controls=(c,), prompt="q")) == PROMPT_TYPES
    assert changed(Sample(id="a", target=c2, controls=(c,), prompt="p")) == {"pixel_latent"}
    assert changed(Sample(id="a", target=t, controls=(c2,), prompt="p")) == ALL - {"pixel_latent"}
    assert changed(Sample(id="a", target=t, controls=(c, c2), prompt="p")) == ALL - {"pixel_latent"}
    # Same bytes under another name: same keys. New bytes under the same name: new keys.
    (tmp_path / "copy.png").write_bytes(c.read_bytes())
    assert changed(Sample(id="a", target=t, controls=(tmp_path / "copy.png",), prompt="p")) == set()
    write_solid_image(tmp_path / "c.png", (4, 5, 6))
    assert changed(Sample(id="a", target=t, controls=(c,), prompt="p")) == ALL - {"pixel_latent"}
    assert "pixel_latent" not in sample_keys(Sample(id="a", target=None, controls=(c,), prompt="p"), ctx, hasher)


def test_manifest_rows_without_control_images(tmp_path: Path) -> None:
    write_solid_image(tmp_path / "t.png")
    write_solid_image(tmp_path / "c.png")
    rows = [
        {"target": "t.png", "prompt": "no controls key"},
        {"target": "t.png", "controls": [], "prompt": "empty list"},
        {"target": "t.png", "controls": "", "prompt": "empty string"},
        {"target": "t.png", "controls": ["c.png"], "prompt": "one control"},
        {"prompt": "prompt only"},
    ]
    (tmp_path / "m.jsonl").write_text("\n".join(json.dumps(r) for r in rows), encoding="utf-8")
    data = scan_dataset(tmp_path / "m.jsonl")
    assert {s.prompt: len(s.controls) for s in data.samples} == {
        "no controls key": 0, "empty list": 0, "empty string": 0, "one control": 1
    }  # fmt: skip
    (problem,) = data.problems
    assert "has no 'target'" in problem.reason
    (csv_sample,) = scan_dataset(_csv(tmp_path / "m.csv", "target,prompt\nt.png,a csv row\n")).samples
    assert (csv_sample.target, csv_sample.controls) == (tmp_path / "t.png", ())
    # For inference, a prompt alone is a sample (text to image).
    prompt_only = [s for s in scan_dataset(tmp_path / "m.jsonl", require_target=False).samples if s.target is None]
    assert [(s.id, s.controls, s.prompt) for s in prompt_only] == [("row000005", (), "prompt only")]


def _csv(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path
