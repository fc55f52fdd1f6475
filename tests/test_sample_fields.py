"""Sample fields (`qie.data.fields`): an image field declared once is read from every layout, keyed, encoded,
cached and batched as the target is; the built-in rejected result keeps its cache keys."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from helpers import fields_forgotten, small_config, write_noise_image
from stage_edges import encoder_for, sizes_for, source_for, spec_of

from qie.cache.keys import FileHasher
from qie.data.collate import collate
from qie.data.fields import REJECTED, SampleField, run_fields, with_defaults
from qie.data.keys import KeyContext, sample_keys
from qie.data.samples import Sample
from qie.data.scan import scan_dataset
from qie.embedding.encode import prepare_sample

DEPTH: SampleField  # declared for this module's tests only (`_depth_declared`)


@pytest.fixture(autouse=True, scope="module")
def _depth_declared():
    """Declare the field `depth` for these tests, and forget it after them (`fields_forgotten`)."""
    global DEPTH
    with fields_forgotten():
        DEPTH = SampleField("depth")
        yield


def _manifest(root: Path, count: int = 2, depth: bool = True) -> Path:
    """A manifest of `count` edit samples, each with a depth image (64 px noise) unless not `depth`."""
    rows = []
    for i in range(count):
        for name, seed in ((f"t{i}.png", 1), (f"c{i}.png", 2), (f"d{i}.png", 3)):
            write_noise_image(root / name, 10 * i + seed)
        row = {"target": f"t{i}.png", "controls": [f"c{i}.png"], "prompt": f"edit {i}"}
        rows.append({**row, "depth": f"d{i}.png"} if depth or i else row)
    path = root / "m.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _config(manifest: Path, cache: Path):
    """Precompute for the objective outside qie that requires the depth field (tests/plugins/depth.py)."""
    objective = "train.objective._target_=plugins.depth.DepthAware"
    return small_config("precompute", f"data.path={manifest}", f"cache.dir={cache}", objective)


def _samples(manifest: Path) -> list[Sample]:
    return scan_dataset(manifest, fields=(DEPTH,)).samples


def _precompute(cfg, run: Path, monkeypatch: pytest.MonkeyPatch):
    """The precompute stage run for an objective that requires the depth field."""
    from qie.stages import precompute

    return precompute.run(cfg, run)


def test_run_fields_maps_names_and_passes_fields_through() -> None:
    assert run_fields(("rejected",)) == (REJECTED,) and run_fields((DEPTH, "empty_prompt")) == (DEPTH,)
    assert with_defaults(run_fields(("depth",))) == (REJECTED, DEPTH)
    assert DEPTH.entry_type == "depth_latent" and SampleField("depth") == DEPTH
    with pytest.raises(ValueError, match="no sample field 'normals'"):
        run_fields(("normals",))


def test_a_depth_field_is_precomputed_read_back_as_the_vae_encodes_it_and_collated(
    tiny_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    manifest, cache = _manifest(tmp_path / "ds"), tmp_path / "cache"
    cfg = _config(manifest, cache)
    summary = _precompute(cfg, tmp_path / "pre", monkeypatch)
    assert (summary.types["depth_latent"].new, summary.types["depth_latent"].failed) == (2, 0)
    assert len([p for p in (cache / "depth_latent").rglob("*") if p.is_file()]) == 2  # files on disk

    samples = _samples(manifest)
    assert [s.fields["depth"].name for s in samples] == ["d0.png", "d1.png"]
    got = source_for(cfg, "cached").get(samples)
    encoder, sizes = encoder_for(cfg), sizes_for(cfg)
    for sample, embeds in zip(samples, got):
        alone = encoder.encode_entries([prepare_sample(sample, sizes)], ["depth_latent"])[0]["depth_latent"]
        torch.testing.assert_close(embeds.fields["depth"], alone["latent"], rtol=1e-4, atol=1e-4)
        assert embeds.fields["depth"].shape == embeds.pixel_latent.shape
    batch = collate(got)
    assert batch.fields["depth"].shape == batch.latents.shape
    torch.testing.assert_close(batch.fields["depth"], torch.stack([e.fields["depth"] for e in got]))
    assert batch.to(torch.device("cpu"), torch.float64).fields["depth"].dtype == torch.float64


def test_a_depth_image_whose_bytes_change_is_stale_and_encoded_again(
    tiny_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from qie.errors import CacheMissError

    manifest, cache = _manifest(tmp_path / "ds"), tmp_path / "cache"
    cfg = _config(manifest, cache)
    _precompute(cfg, tmp_path / "pre", monkeypatch)
    source = source_for(cfg, "cached")
    before = [source.cache.keys(s) for s in _samples(manifest)]
    again = _precompute(cfg, tmp_path / "pre2", monkeypatch)  # unchanged: nothing encoded
    assert {t: s.new for t, s in again.types.items() if s.new} == {}

    write_noise_image(tmp_path / "ds" / "d0.png", 99)  # other bytes
    samples = _samples(manifest)
    source = source_for(cfg, "cached")
    after = [source.cache.keys(s) for s in samples]
    assert after[0]["depth_latent"] != before[0]["depth_latent"] and after[1] == before[1]
    assert {t for t in after[0] if after[0][t] != before[0][t]} == {"depth_latent"}
    with pytest.raises(CacheMissError):
        source.get(samples[:1])
    source.get(samples[1:])  # unchanged: read
    summary = _precompute(cfg, tmp_path / "pre3", monkeypatch)
    assert {t: s.new for t, s in summary.types.items() if s.new} == {"depth_latent": 1}
    assert source.get(samples[:1])[0].fields["depth"].shape[0] > 0


def test_a_folder_reads_stem_depth_files_beside_the_target_and_a_remembered_scan_agrees(tmp_path: Path) -> None:
    root = tmp_path / "ds"
    for stem, seed in (("a", 1), ("a_depth", 2), ("b", 3), ("orphan_depth", 4)):
        write_noise_image(root / "training_images" / f"{stem}.png", seed)
    for stem in ("a", "b"):
        write_noise_image(root / "control_images" / f"{stem}.png", 9)
        (root / "training_images" / f"{stem}.txt").write_text(f"edit {stem}")
    (tmp_path / "cache").mkdir()
    for index_dir in (None, tmp_path / "cache" / "manifests", tmp_path / "cache" / "manifests"):
        data = scan_dataset(root, index_dir=index_dir, fields=(REJECTED, DEPTH))
        assert [(s.id, dict(s.fields)) for s in data.samples] == [
            ("a", {"depth": root / "training_images" / "a_depth.png"}),
            ("b", {}),
        ]
        assert [(p.id, p.reason) for p in data.problems] == [("orphan", "target image is missing (depth image found)")]
    # Read without the field, a depth file is no field's image (the fields a run reads are explicit).
    plain = scan_dataset(root, index_dir=tmp_path / "cache" / "manifests")
    assert [p.id for p in plain.problems] == ["a_depth", "orphan_depth"]  # targets without a control image


def test_a_hugging_face_data_set_gives_depth_images_from_its_column(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    datasets = pytest.importorskip("datasets")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    from PIL import Image

    from qie.data.formats import DataSource, read_dataset

    images = {}
    for name, colour in (("t", (255, 0, 0)), ("c", (0, 255, 0)), ("d", (9, 9, 9))):
        Image.new("RGB", (32, 32), colour).save(tmp_path / f"{name}.png")
        images[name] = (tmp_path / f"{name}.png").read_bytes()
    features = datasets.Features(
        {
            "target": datasets.Image(),
            "controls": datasets.List(datasets.Image()),
            "prompt": datasets.Value("string"),
            "depth": datasets.Image(),
        }
    )
    rows = {
        "target": [images["t"]] * 2,
        "controls": [[images["c"]]] * 2,
        "prompt": ["a", "b"],
        "depth": [images["d"], None],
    }
    datasets.Dataset.from_dict(rows, features=features).save_to_disk(str(tmp_path / "ds"))
    source = DataSource(path=str(tmp_path / "ds"), format="hf", images_dir=tmp_path / "img", fields=(REJECTED, DEPTH))
    first, second = read_dataset(source).samples
    assert first.fields["depth"].read_bytes() == images["d"] and second.fields == {}


def test_a_sample_without_a_required_field_is_left_out_naming_it(tiny_path: Path, tmp_path: Path, capsys) -> None:
    from qie.data.formats import DataSource
    from qie.stages.train_data import load_samples

    manifest = _manifest(tmp_path / "ds", count=3, depth=False)  # the first row has no depth image
    spec = spec_of(_config(manifest, tmp_path / "cache"))
    source = DataSource(path=str(manifest), fields=(REJECTED, DEPTH))
    samples = load_samples(source, spec, True, None, (DEPTH,))
    assert [s.id for s in samples] == ["t1", "t2"]
    assert (
        "it has no depth image, which the objective trains on: give one (manifest key `depth`, folder file "
        "`<stem>_depth.png`, HF column `depth`)"
    ) in capsys.readouterr().out
    plain = load_samples(source, spec, False)  # an objective without the field: its images are not kept
    assert len(plain) == 3 and all(s.fields == {} for s in plain)


def test_rejected_entries_keep_their_cache_key(tmp_path: Path) -> None:
    """The key of a rejected_latent entry, as it was before sample fields (captured from the code then): a cache
    filled before still reads."""
    (tmp_path / "t.png").write_bytes(b"target-bytes")
    (tmp_path / "r.png").write_bytes(b"rejected-bytes")
    ctx = KeyContext("vae-fp", "te-fp", "tmpl", 65536, "fit", 16, 1024 * 1024, 384 * 384, "bfloat16")
    sample = Sample(
        id="a", target=tmp_path / "t.png", controls=(), prompt="p", field_images=(("rejected", tmp_path / "r.png"),)
    )
    keys = sample_keys(sample, ctx, FileHasher())
    assert keys["rejected_latent"] == "86f9bac88559749a52ea54f6f6bd9878002a175ece8d26debfc923b9e0a66446"
    assert keys["pixel_latent"] == "348b96688efe33300718af052d39c2ab0c821ee4a676a0629606fa55b81f6547"
    assert dataclasses.replace(sample, field_images=()).fields == {}


def test_a_field_image_leading_out_of_the_data_set_folder_is_a_problem(tmp_path: Path) -> None:
    """A depth image that is a link to a file outside the data set folder makes its sample a problem, in a folder
    (plain and remembered) and in a manifest, as any other image kind does."""
    secret = write_noise_image(tmp_path / "secret.png", 5)
    root = tmp_path / "ds"
    for stem in ("a", "b"):
        write_noise_image(root / "training_images" / f"{stem}.png", 1)
        (root / "training_images" / f"{stem}.txt").write_text(f"edit {stem}")
    (root / "training_images" / "a_depth.png").symlink_to(secret)
    (tmp_path / "cache").mkdir()
    for index_dir in (None, tmp_path / "cache" / "manifests", tmp_path / "cache" / "manifests"):
        data = scan_dataset(root, index_dir=index_dir, fields=(DEPTH,))
        assert [s.id for s in data.samples] == ["b"]
        assert [p.id for p in data.problems] == ["a"] and "outside the data set folder" in data.problems[0].reason

    manifest = _manifest(tmp_path / "m")
    (tmp_path / "m" / "d0.png").unlink()
    (tmp_path / "m" / "d0.png").symlink_to(secret)
    data = scan_dataset(manifest, fields=(DEPTH,))
    assert [s.id for s in data.samples] == ["t1"]
    assert "'d0.png' (a link to" in data.problems[0].reason and "lies outside" in data.problems[0].reason
