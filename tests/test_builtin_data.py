"""Without `data.path`, a tiny model reads the built-in demo data set (generated once into `$QIE_HOME`); a real
model is left to the stage's error."""

from __future__ import annotations

from pathlib import Path

import pytest

from qie.checks import check, compose
from qie.config import typed
from qie.demo import builtin
from qie.models import model_spec


def test_a_tiny_model_without_data_path_reads_the_demo_data_written_once(
    qie_home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    checked = check(compose("precompute", ["cache=ssd"]))
    assert checked.groups.data.path is None
    first = builtin.with_builtin_data(checked)
    folder = Path(first.groups.data.path)
    assert first.root.data.path == first.values["data"]["path"] == str(folder)  # every view of the config
    assert checked.groups.data.path is None and folder.parent == qie_home / "demo_data"
    assert len(list((folder / "training_images").glob("*.png"))) == builtin.SAMPLES
    assert len(list((folder / "control_images").glob("*.png"))) == builtin.SAMPLES
    said = capsys.readouterr().out.strip().splitlines()
    assert len(said) == 1 and said[0].startswith("qie: data.path is not set: using the built-in demo data set")
    assert f"generated in {folder}" in said[0]
    stamp = (folder / "training_images" / "00000.png").stat().st_mtime_ns
    again = builtin.with_builtin_data(check(compose("train", ["model.quantize=fp8"])))
    assert again.groups.data.path == str(folder) and f"in {folder}" in capsys.readouterr().out
    assert (folder / "training_images" / "00000.png").stat().st_mtime_ns == stamp  # not written again
    assert [p.name for p in folder.parent.iterdir() if p.name.startswith(".")] == []  # no scratch left


def test_the_demo_data_follows_the_model_and_a_real_model_keeps_its_error() -> None:
    assert builtin.data_kind(model_spec(typed(compose("train", ["model=tiny_t2i"]).model))) == "t2i"
    assert builtin.data_kind(model_spec(typed(compose("train", ["model=tiny_qwen_image_layered"]).model))) == "layered"
    real = check(compose("precompute", ["model=qwen_image_edit"]))
    assert builtin.with_builtin_data(real) is real
    own = check(compose("train", ["data.path=/data/mine"]))
    assert builtin.with_builtin_data(own).groups.data.path == "/data/mine"
