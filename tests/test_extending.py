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


# --- objectives that ask their context for more (tests/plugins/weighting.py, ahead.py, best_of_n.py) ------------


@pytest.fixture(scope="module")
def edits(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three of the demo's edits (each a control, a target and an instruction)."""
    root = tmp_path_factory.mktemp("edits")
    make_dataset(root, train=3, heldout=0, size=64)
    return root / "train"


def _stage(stage: str, data: Path, cache: Path, run: Path, *overrides: str):
    import importlib

    cfg = small_config(stage, f"data.path={data}", f"cache.dir={cache}", *overrides)
    return importlib.import_module(f"qie.stages.{stage}").run(cfg, run)


def _steps(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_a_per_sample_weighting_is_three_lines_of_the_context_and_trains_by_configuration(
    edits: Path, tmp_path: Path
) -> None:
    import torch
    from plugins.weighting import MinSnr
    from test_step import Recorder, fixed_batch

    from qie.models.qwen_image import FAMILY
    from qie.training.objectives.run_context import RunContext
    from qie.training.timesteps import SigmaSampling

    sigmas = SigmaSampling(method="uniform")
    objective = MinSnr(RunContext(family=FAMILY, sigmas=sigmas), gamma=2.0)
    batch = fixed_batch(2)
    got = objective.loss(Recorder(0.5), batch, torch.Generator().manual_seed(4))
    g = torch.Generator().manual_seed(4)  # the draws by hand: noise, then the sigmas
    noise = torch.randn(batch.latents.shape, generator=g)
    s = sigmas.sample(2, g, (batch.latents.shape[-2] // 2) * (batch.latents.shape[-1] // 2))
    snr = ((1 - s.double()) / s.double()) ** 2
    weights = (snr.clamp(max=2.0) / (snr + 1)).float()
    per_sample = FAMILY.loss(Recorder(0.5), batch, noise, s, "none", per_sample=True)
    assert torch.equal(got, (weights * per_sample).mean())
    assert not torch.equal(got, per_sample.mean())  # the weights took part

    cache = tmp_path / "cache"
    _stage("precompute", edits, cache, tmp_path / "pre")
    plain, weighted = tmp_path / "plain", tmp_path / "weighted"
    _stage("train", edits, cache, plain, "cache.mode=cached", *FAST)
    snr_run = ["train.objective._target_=plugins.weighting.MinSnr", "+train.objective.gamma=1.0"]
    _stage("train", edits, cache, weighted, "cache.mode=cached", *snr_run, *FAST)
    assert _steps(weighted)[0]["loss"] < _steps(plain)[0]["loss"]  # every weight is below 1 at gamma 1
    assert (weighted / "lora").is_dir()


def test_targets_computed_ahead_into_a_store_of_its_own_type_are_filled_by_precompute_and_read_by_training(
    edits: Path, tmp_path: Path
) -> None:
    ahead = ["train.objective._target_=plugins.ahead.PriorTarget", "+train.objective.prior_weight=0.5"]
    cache = tmp_path / "cache"
    summary = _stage("precompute", edits, cache, tmp_path / "pre", *ahead, "precompute.teachers=true")
    assert (summary.types["prior_velocity"].new, summary.types["prior_velocity"].failed) == (3, 0)
    assert len(list((cache / "prior_velocity").rglob("*.safetensors"))) == 3
    run = tmp_path / "run"
    _stage("train", edits, cache, run, "cache.mode=cached", *ahead, *FAST)
    assert [step["prior_computed"] for step in _steps(run)] == [0.0, 0.0]  # every entry read, none computed
    fresh = tmp_path / "fresh"  # a cache without them: lazy training computes and stores them on first use
    _stage("precompute", edits, tmp_path / "cache2", tmp_path / "pre2", *ahead)
    _stage("train", edits, tmp_path / "cache2", fresh, "cache.mode=lazy", *ahead, *FAST)
    assert [step["prior_computed"] for step in _steps(fresh)] == [1.0, 1.0]
    assert len(list((tmp_path / "cache2" / "prior_velocity").rglob("*.safetensors"))) == 2


def test_rollouts_sampled_decoded_and_scored_by_a_reward_train_by_configuration(edits: Path, tmp_path: Path) -> None:
    best = [
        "train.objective._target_=plugins.best_of_n.BestOfN",
        "+train.objective.reward._target_=plugins.colour.Colour",
        "+train.objective.copies=3",
        "+train.objective.steps=2",
    ]
    cache = tmp_path / "cache"
    _stage("precompute", edits, cache, tmp_path / "pre", *best)
    run = tmp_path / "run"
    result = _stage("train", edits, cache, run, "cache.mode=cached", *best, *FAST)
    steps = _steps(run)
    assert len(result["losses"]) == 2 and all(s["reward_best"] > s["reward_mean"] > 0 for s in steps)
    assert (run / "lora").is_dir()


def test_the_objective_seams_old_names_are_answered_with_their_replacements() -> None:
    import qie.extend

    for module in ("qie.extend", "qie.training.objectives"):
        with pytest.raises(ImportError, match=rf"^{module}.ObjectiveInputs was replaced: use ObjectiveContext "):
            exec(f"from {module} import ObjectiveInputs")
    with pytest.raises(ImportError, match=r"ScoresOwnResults was replaced: use ObjectiveContext.score "):
        exec("from qie.extend import ScoresOwnResults")
    assert not hasattr(qie.extend, "NoSuchName")  # any other name is the plain missing attribute
