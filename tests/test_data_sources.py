"""Data from anywhere: the kind of `data.path` is detected; Hugging Face data sets train as folders do."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from stage_edges import data_for

from qie.checks import compose
from qie.data.formats import Columns, DataSource, detect_format, read_dataset
from qie.data.scan import scan_dataset
from qie.demo.synthetic import make_dataset
from qie.errors import DataError
from qie.stages import precompute
from qie.stages import train as train_stage

datasets = pytest.importorskip("datasets")

TRAINING = ["train.max_steps=4", "train.learning_rate=1e-3", "data.batch_size=2", "train.seed=7",
            "data.num_workers=0", "logging.report_to=none"]  # fmt: skip


@pytest.fixture(autouse=True)
def hf_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Keep the datasets library's own cache (what load_dataset converts parquet into) inside the test."""
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path_factory.getbasetemp() / "hf_datasets_cache"))


def _hf_copy(folder: Path) -> datasets.Dataset:
    """The folder data set as a Hugging Face data set: image bytes in the rows, controls a list column."""
    rows = {"target": [], "controls": [], "prompt": []}
    for s in scan_dataset(folder).samples:
        rows["target"].append({"bytes": s.target.read_bytes(), "path": s.target.name})
        rows["controls"].append([{"bytes": c.read_bytes(), "path": None} for c in s.controls])
        rows["prompt"].append(s.prompt)
    features = datasets.Features(
        {"target": datasets.Image(), "controls": datasets.List(datasets.Image()), "prompt": datasets.Value("string")}
    )
    return datasets.Dataset.from_dict(rows, features=features)


@pytest.fixture(scope="module")
def data(tiny_path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Eight samples as a folder, as a save_to_disk folder and as parquet; a cache filled from the folder."""
    root = tmp_path_factory.mktemp("sources")
    make_dataset(root, train=8, heldout=0, size=64)
    hf = _hf_copy(root / "train")
    hf.save_to_disk(str(root / "saved"))
    (root / "parquet").mkdir()
    hf.select(range(5)).to_parquet(str(root / "parquet" / "part-0.parquet"))
    hf.select(range(5, 8)).to_parquet(str(root / "parquet" / "part-1.parquet"))
    base = [f"model.pretrained_model_name_or_path={tiny_path}", f"cache.dir={root / 'cache'}"]
    precompute.run(compose("precompute", base + [f"data.path={root / 'train'}"]), root / "pre")
    return {"root": root, "base": base}


def test_the_default_config_detects_each_kind(data: dict, tmp_path: Path) -> None:
    root = data["root"]
    manifest = tmp_path / "edits.jsonl"
    sample = scan_dataset(root / "train").samples[0]
    manifest.write_text(json.dumps({"target": str(sample.target), "controls": [str(sample.controls[0])],
                                    "prompt": sample.prompt}) + "\n")  # fmt: skip
    assert compose("train", [])["data"]["format"].value == "auto"
    kinds = {root / "train": "folder", manifest: "manifest", root / "saved": "hf",
             root / "parquet" / "part-0.parquet": "hf", f"{root}/parquet/*.parquet": "hf"}  # fmt: skip
    for path, kind in kinds.items():
        assert detect_format(path) == kind, path
    # data.path=edits.jsonl with the default data group: a manifest, no data=manifest needed. Its rows name
    # absolute paths, outside its folder: refused unless allowed.
    outside = compose("train", data["base"] + [f"data.path={manifest}"])
    with pytest.raises(DataError, match="lies outside the manifest's folder"):
        data_for(outside)
    (only,) = data_for(
        compose("train", data["base"] + [f"data.path={manifest}", "data.allow_outside_paths=true"])
    ).samples
    assert only.target == sample.target and only.prompt == sample.prompt
    with pytest.raises(DataError, match="does not exist"):
        detect_format(tmp_path / "nope")
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(DataError, match=r"\.txt file"):
        detect_format(tmp_path / "notes.txt")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="training_images/"):  # a folder of nothing: named as what it is not
        data_for(compose("train", [f"data.path={tmp_path / 'empty'}"]))


def test_images_in_the_data_set_get_the_keys_of_the_same_files(data: dict, tmp_path: Path) -> None:
    root = data["root"]
    folder = scan_dataset(root / "train").samples
    for path in (root / "saved", f"{root}/parquet/*.parquet"):
        hf = data_for(compose("train", data["base"] + [f"data.path={path}"])).samples
        assert [s.prompt for s in hf] == [s.prompt for s in folder]
        # Written once under the state folder (cache.dir/state/images), named by their content: the same bytes.
        for a, b in zip(hf, folder):
            assert a.target.parent.parent == root / "cache" / "state" / "images"
            assert a.target.read_bytes() == b.target.read_bytes()
            assert [c.read_bytes() for c in a.controls] == [c.read_bytes() for c in b.controls]
        # So precompute finds every entry already there: the keys equal the folder's.
        summary = precompute.run(compose("precompute", data["base"] + [f"data.path={path}"]), tmp_path / "pre")
        assert summary.samples == 8 and not summary.failures
        assert {t: s.new for t, s in summary.types.items()} == dict.fromkeys(summary.types, 0)


def test_a_hf_data_set_trains_to_the_losses_of_the_same_folder(data: dict, tmp_path: Path) -> None:
    root = data["root"]
    results = {}
    for name, path in (("folder", root / "train"), ("hf", root / "saved")):
        cfg = compose("train", data["base"] + TRAINING + [f"data.path={path}"])
        results[name] = train_stage.run(cfg, tmp_path / name)["losses"]
    assert len(results["hf"]) == 4
    assert results["hf"] == results["folder"]  # the same cached tensors in the same order: bit for bit


def test_columns_lists_of_columns_and_problem_rows(tmp_path: Path) -> None:
    images = {}
    for name, colour in (("t0", (255, 0, 0)), ("c0", (0, 255, 0)), ("c1", (0, 0, 255))):
        Image.new("RGB", (32, 32), colour).save(tmp_path / f"{name}.png")
        images[name] = (tmp_path / f"{name}.png").read_bytes()
    features = datasets.Features({"out": datasets.Image(), "a": datasets.Image(), "b": datasets.Image(),
                                  "text": datasets.Value("string"), "key": datasets.Value("string")})  # fmt: skip
    rows = {"out": [images["t0"], images["t0"]], "a": [images["c0"], images["c0"]], "b": [images["c1"], None],
            "text": ["recolour", None], "key": ["x", "y"]}  # fmt: skip
    datasets.Dataset.from_dict(rows, features=features).save_to_disk(str(tmp_path / "ds"))
    columns = Columns(target="out", controls=("a", "b"), prompt="text", id="key")
    data = read_dataset(
        DataSource(path=str(tmp_path / "ds"), format="hf", columns=columns, images_dir=tmp_path / "img")
    )
    (sample,) = data.samples
    assert sample.id == "x" and sample.prompt == "recolour"
    assert [c.read_bytes() for c in sample.controls] == [images["c0"], images["c1"]]
    (problem,) = data.problems
    assert problem.id == "y" and "no prompt" in problem.reason
    with pytest.raises(DataError, match=r"no column 'prompt' \(columns: out, a, b, text, key\)"):
        read_dataset(DataSource(path=str(tmp_path / "ds"), format="hf", images_dir=tmp_path / "img",
                                columns=Columns(target="out", controls=("a",))))  # fmt: skip


def test_an_imagefolder_uses_its_files_where_they_are(tmp_path: Path) -> None:
    folder = tmp_path / "imgs"
    folder.mkdir()
    rows = []
    for i in range(3):
        pixels = np.random.default_rng(i).integers(0, 256, (32, 32, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(folder / f"{i}_out.png")
        Image.fromarray(255 - pixels).save(folder / f"{i}_in.png")
        rows.append({"file_name": f"{i}_out.png", "control_file_name": f"{i}_in.png", "prompt": f"invert {i}"})
    (folder / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = compose("train", [f"data.path={folder}", "data.columns.target=image", "data.columns.controls=[control]",
                            f"cache.dir={tmp_path / 'cache'}"])  # fmt: skip
    samples = data_for(cfg).samples
    assert [(s.target, s.controls, s.prompt) for s in samples] == [
        (folder / f"{i}_out.png", (folder / f"{i}_in.png",), f"invert {i}") for i in range(3)
    ]
    assert not (tmp_path / "cache" / "state" / "images").exists()  # nothing copied
