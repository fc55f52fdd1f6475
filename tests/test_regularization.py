"""Regularisation data (`data.regularization`): cached like the main set, mixed in by whole optimizer steps at a
ratio, weighted, logged on its own, resumed exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import small_config

from qie.data.buckets import BucketBatchSampler
from qie.data.mixing import MixedBatchSampler
from qie.demo.synthetic import make_dataset
from qie.errors import ConfigError
from qie.stages import precompute
from qie.stages import train as train_stage

RUN = ["train.max_steps=6", "train.learning_rate=1e-3", "data.batch_size=2", "train.seed=5",
       "data.regularization.ratio=0.5"]  # fmt: skip


def mixed(start: int = 0, accumulation: int = 1) -> MixedBatchSampler:
    main, extra = BucketBatchSampler([0] * 6, [1] * 6, 2, seed=1), BucketBatchSampler([0] * 4, [1] * 4, 2, seed=2)
    return MixedBatchSampler(main, extra, 6, 0.4, seed=3, accumulation=accumulation, start=start)


def take(sampler, n: int) -> list:
    it = iter(sampler)
    return [next(it) for _ in range(n)]


def test_mixing_is_by_step_seeded_and_resumes_where_each_set_was() -> None:
    whole = take(mixed(), 40)
    assert [n for n, _ in whole] == list(range(40))
    from_extra = [n for n, idx in whole if min(idx) >= 6]
    assert from_extra == [n for n in range(40) if mixed().is_extra(n)] and 8 < len(from_extra) < 24
    assert all(max(idx) < 6 or min(idx) >= 6 for _, idx in whole)  # a batch is from one set
    assert take(mixed(start=17), 23) == whole[17:]
    steps = take(mixed(accumulation=2), 20)
    assert all((min(a[1]) >= 6) == (min(b[1]) >= 6) for a, b in zip(steps[::2], steps[1::2]))  # whole steps


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory, tiny_path: Path) -> Path:
    """A main and a regularisation set of four samples each, precomputed together."""
    root = tmp_path_factory.mktemp("reg_data")
    make_dataset(root / "main", train=4, heldout=0, size=64, seed=0)
    make_dataset(root / "reg", train=4, heldout=0, size=64, seed=1)
    cfg = small_config("precompute", *overrides(root))
    precompute.run(cfg, root / "precompute_run")
    return root


def overrides(root: Path) -> list[str]:
    return [f"data.path={root / 'main' / 'train'}", f"cache.dir={root / 'cache'}",
            f"data.regularization.path={root / 'reg' / 'train'}"]  # fmt: skip


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_precompute_caches_both_sets(data: Path) -> None:
    assert len(list((data / "cache" / "pixel_latent").rglob("*.safetensors"))) == 8


def test_regularisation_steps_are_weighted_and_logged_apart(data: Path, tmp_path: Path) -> None:
    full = train_stage.run(small_config("train", *overrides(data), *RUN), tmp_path / "full")
    half = train_stage.run(small_config("train", *overrides(data), *RUN, "data.regularization.weight=0.5"),
                           tmp_path / "half")  # fmt: skip
    reg_steps = [r["step"] for r in metrics(tmp_path / "half") if "reg_loss" in r]
    assert reg_steps and len(reg_steps) < 6
    first = reg_steps[0] - 1  # index of the first regularisation step: the runs agree up to it
    assert half["losses"][:first] == full["losses"][:first]
    assert half["losses"][first] == 0.5 * full["losses"][first]
    logged = {r["step"]: r["reg_loss"] for r in metrics(tmp_path / "half") if "reg_loss" in r}
    assert logged[reg_steps[0]] == pytest.approx(full["losses"][first], rel=1e-6)


def test_a_mixed_run_resumes_exactly(data: Path, tmp_path: Path) -> None:
    run = [*overrides(data), *RUN, "train.checkpoint_every=3"]
    whole = train_stage.run(small_config("train", *run), tmp_path / "whole")
    step3 = tmp_path / "whole" / "checkpoints" / "step-000003"
    resumed = train_stage.run(small_config("train", *run, f"train.resume={step3}"), tmp_path / "resumed")
    assert resumed["losses"] == pytest.approx(whole["losses"][3:], abs=1e-6)


def test_bad_regularisation_settings_are_refused(data: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="ratio=1.0 is out of range"):
        train_stage.run(small_config("train", *overrides(data), "data.regularization.ratio=1"), tmp_path)
