"""Reference dropout (`data.control_dropout_rate`): a dropped batch trains on the text-only prompt path, whose
entries precompute caches as their own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import small_config

from qie.demo.synthetic import make_dataset
from qie.errors import CacheMissError, ConfigError
from qie.stages import precompute
from qie.stages import train as train_stage

PLUS = ["model=tiny_plus"]
RUN = ["train.max_steps=2", "train.learning_rate=1e-3", "data.batch_size=2", "train.seed=3"]


@pytest.fixture(scope="module")
def plus_data(tmp_path_factory: pytest.TempPathFactory, tiny_plus_path: Path) -> Path:
    """Four edit samples cached for the tiny Edit-Plus model, text-only prompts included."""
    root = tmp_path_factory.mktemp("plus_data")
    make_dataset(root, train=4, heldout=0, size=64)
    cfg = small_config("precompute", *PLUS, f"data.path={root / 'train'}", f"cache.dir={root / 'cache'}",
                       "data.control_dropout_rate=0.5")  # fmt: skip
    precompute.run(cfg, root / "precompute_run")
    return root


def test_precompute_caches_the_text_only_prompts_as_entries_of_their_own(plus_data: Path) -> None:
    count = {t: len(list((plus_data / "cache" / t).rglob("*.safetensors"))) for t in ("pixel_latent", "prompt_embed")}
    assert count == {"pixel_latent": 4, "prompt_embed": 8}  # each target once; each prompt with and without images


def test_a_dropped_batch_trains_as_the_same_samples_without_controls(plus_data: Path, tmp_path: Path) -> None:
    data = ["cache.mode=cached", f"cache.dir={plus_data / 'cache'}"]
    dropped = train_stage.run(
        small_config("train", *PLUS, *RUN, *data, f"data.path={plus_data / 'train'}", "data.control_dropout_rate=1"),
        tmp_path / "dropped",
    )
    # The same targets and prompts as a manifest without control images: the entries are shared (same bytes).
    rows = []
    for target in sorted((plus_data / "train" / "training_images").glob("*.png")):
        prompt = target.with_suffix(".txt").read_text()
        rows.append(json.dumps({"id": target.stem, "target": f"training_images/{target.name}", "prompt": prompt}))
    (plus_data / "train" / "text_only.jsonl").write_text("\n".join(rows) + "\n")
    text_only = train_stage.run(
        small_config("train", *PLUS, *RUN, *data, f"data.path={plus_data / 'train' / 'text_only.jsonl'}"),
        tmp_path / "text_only",
    )
    kept = train_stage.run(small_config("train", *PLUS, *RUN, *data, f"data.path={plus_data / 'train'}"),
                           tmp_path / "kept")  # fmt: skip
    assert dropped["losses"] == text_only["losses"]
    assert dropped["losses"] != kept["losses"]


class Built(Exception):
    """Raised where the model would be built: everything before it passed."""


def test_missing_text_only_entries_and_models_that_cannot_drop_are_refused(
    cached_data, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(train_stage, "build_train_state", lambda *a: (_ for _ in ()).throw(Built()))
    make_dataset(tmp_path, train=2, heldout=0, size=64)
    data = [f"data.path={tmp_path / 'train'}", f"cache.dir={tmp_path / 'cache'}"]
    precompute.run(small_config("precompute", *PLUS, *data), tmp_path / "precompute_run")  # no text-only entries
    with pytest.raises(Built):
        train_stage.run(small_config("train", *PLUS, *data), tmp_path / "a")
    with pytest.raises(CacheMissError, match="prompt_embed"):
        train_stage.run(small_config("train", *PLUS, *data, "data.control_dropout_rate=0.5"), tmp_path / "b")
    with pytest.raises(ConfigError, match="needs a control image in every sample"):
        train_stage.run(small_config("train", *cached_data.overrides, "data.control_dropout_rate=0.5"), tmp_path)
    with pytest.raises(ConfigError, match="takes no control images"):
        cfg = small_config("train", "model=tiny_t2i", *cached_data.overrides, "data.control_dropout_rate=0.5")
        train_stage.run(cfg, tmp_path)
