"""An objective and an image field written outside qie (tests/plugins/depth.py, as docs/extending.md shows them) run
through precompute and cached training by configuration alone: the field is read from the folder layout, encoded
into its own cache entries, batched, and the objective's setting and measure reach the run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import fields_forgotten, small_config, write_noise_image

from qie.demo.synthetic import make_dataset
from qie.errors import ConfigError

OBJECTIVE = "train.objective._target_=plugins.depth.DepthAware"
FAST = ["train.learning_rate=1e-3", "train.seed=3", "data.batch_size=1", "train.max_steps=2"]


@pytest.fixture(autouse=True, scope="module")
def _forget_depth():
    with fields_forgotten():
        yield


@pytest.fixture(scope="module")
def depth_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The synthetic edit set with a depth map (noise) beside each target: training_images/<stem>_depth.png."""
    root = tmp_path_factory.mktemp("depth")
    make_dataset(root, train=3, heldout=0, size=64)
    data = root / "train"
    for i, target in enumerate(sorted((data / "training_images").glob("*.png"))):
        write_noise_image(target.with_name(f"{target.stem}_depth.png"), 50 + i, (64, 64))
    return data


def _run(stage: str, data: Path, run: Path, *overrides: str) -> dict:
    import importlib

    module = importlib.import_module(f"qie.stages.{stage}")
    cfg = small_config(stage, f"data.path={data}", f"cache.dir={data.parent / 'cache'}", OBJECTIVE, *overrides)
    return module.run(cfg, run)


def _first_step(run: Path) -> dict:
    return json.loads((run / "metrics.jsonl").read_text().splitlines()[0])


def test_an_outside_objective_and_field_run_through_precompute_and_cached_training(depth_data, tmp_path) -> None:
    summary = _run("precompute", depth_data, tmp_path / "pre")
    assert (summary.types["depth_latent"].new, summary.types["depth_latent"].failed) == (3, 0)
    assert len([p for p in (depth_data.parent / "cache" / "depth_latent").rglob("*.safetensors")]) == 3

    half = tmp_path / "half"
    _run("train", depth_data, half, "cache.mode=cached", "+train.objective.depth_weight=0.5", *FAST)
    whole = tmp_path / "whole"
    _run("train", depth_data, whole, "cache.mode=cached", "+train.objective.depth_weight=1.0", *FAST)
    first_half, first_whole = _first_step(half), _first_step(whole)
    # The same draws at the same start: the weights differ by 0.5, so the losses by half the depth loss logged.
    assert first_half["depth_loss"] == pytest.approx(first_whole["depth_loss"], rel=1e-6)
    assert first_whole["loss"] - first_half["loss"] == pytest.approx(0.5 * first_half["depth_loss"], rel=1e-4)
    assert first_half["depth_loss"] > 0
    assert (half / "lora").is_dir()


def test_a_misspelt_setting_of_an_outside_objective_is_refused_naming_its_parameters(depth_data) -> None:
    with pytest.raises(ConfigError) as info:
        small_config("train", f"data.path={depth_data}", OBJECTIVE, "+train.objective.depth_wieght=0.5")
    assert str(info.value) == ("unknown key train.objective.depth_wieght: plugins.depth.DepthAware takes depth_weight")


def test_a_plugins_own_preset_is_chosen_by_name_once_its_tree_is_on_hydras_search_path(depth_data) -> None:
    """tests/plugins/conf/ ships `train/objective/depth.yaml`; `hydra.searchpath` adds it beside qie's tree."""
    search = "hydra.searchpath=[pkg://plugins.conf]"
    cfg = small_config("train", f"data.path={depth_data}", search, "train/objective=depth")
    assert dict(cfg.train.objective) == {"_target_": "plugins.depth.DepthAware", "depth_weight": 0.5}
    tuned = small_config(
        "train", f"data.path={depth_data}", search, "train/objective=depth", "train.objective.depth_weight=2"
    )
    assert tuned.train.objective.depth_weight == 2
    with pytest.raises(ConfigError, match="train/objective"):
        small_config("train", f"data.path={depth_data}", "train/objective=depth")  # without the plug-in's tree
