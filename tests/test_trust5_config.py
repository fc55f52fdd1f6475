"""Counts and ranges refused when the config is composed, in one line naming the key, before any stage writes: a
negative `train.checkpoints_total_limit` (which deleted every checkpoint as it was written), and every count-like
setting of the schemas the same way; an objective `_target_` that is no objective; a plug-in field named like a
built-in manifest key."""

from __future__ import annotations

from pathlib import Path

import pytest

from qie.checks import compose
from qie.config import updated
from qie.errors import ConfigError

REFUSED = [
    ("train", "train.checkpoints_total_limit=-1", "train.checkpoints_total_limit=-1 is out of range: keep 1 or more"),
    ("train", "train.checkpoints_total_limit=0", "train.checkpoints_total_limit=0 is out of range: keep 1 or more"),
    ("train", "train.checkpoint_every=-5", "train.checkpoint_every=-5 is out of range: it must lie in [0, inf]"),
    ("train", "train.max_grad_norm=-1", "train.max_grad_norm=-1.0 is out of range"),
    ("train", "train.lora.rank=0", "train.lora.rank=0 is out of range: it must lie in [1, inf]"),
    ("train", "train.lora.alpha=0", "train.lora.alpha=0 is out of range"),
    ("train", "train.lora.dropout=1.0", "train.lora.dropout=1.0 is out of range"),
    ("train", "logging.log_every=0", "logging.log_every=0 is out of range: it must be at least 1"),
    ("train", "logging.log_images_every=0", "logging.log_images_every=0 is out of range"),
    ("train", "logging.log_images_count=0", "logging.log_images_count=0 is out of range"),
    ("train", "validation.every=-1", "validation.every=-1 is out of range"),
    ("train", "validation.num_inference_steps=0", "validation.num_inference_steps=0 is out of range"),
    ("train", "validation.reward_timeout=-1", "validation.reward_timeout=-1.0 is out of range"),
    ("train", "data.multiple_of=0", "data.multiple_of=0 is out of range"),
    ("train", "data.target_pixels=0", "data.target_pixels=0 is out of range"),
    ("train", "model.num_inference_steps=0", "model.num_inference_steps=0 is out of range"),
    ("infer", "predict.num_images=0", "predict.num_images=0 is out of range"),
    ("infer", "predict.num_inference_steps=0", "predict.num_inference_steps=0 is out of range"),
    ("infer", "predict.height=0", "predict.height=0 is out of range"),
    ("precompute", "precompute.start=-1", "precompute.start=-1 is out of range: it must be at least 0"),
    ("precompute", "precompute.start=4 precompute.end=2", "precompute.end=2 is out of range: it must be at least 4"),
    ("caption", "caption.start=-2", "caption.start=-2 is out of range"),
    ("eval", "eval.seeds=[]", "eval.seeds is empty: give at least one seed"),
    ("eval", "eval.tile=0", "eval.tile=0 is out of range: it must be at least 16"),
    ("eval", "eval.tile=-64", "eval.tile=-64 is out of range"),
    ("eval", "eval.reward_timeout=-1", "eval.reward_timeout=-1.0 is out of range"),
    ("eval", "eval.output_dir=../../x", "eval.output_dir='../../x' leaves the run folder: give a folder inside it"),
    ("eval", "eval.output_dir=/tmp/elsewhere", "eval.output_dir='/tmp/elsewhere' leaves the run folder"),
    ("export", "export.samples=-1", "export.samples=-1 is out of range: it must be at least 0"),
    ("extract_lora", "extract.rank=0", "extract.rank=0 is out of range: it must be at least 1"),
    ("extract_lora", "extract.niter=-1", "extract.niter=-1 is out of range: it must be at least 0"),
]


@pytest.mark.parametrize(("stage", "overrides", "message"), REFUSED, ids=[c[1] for c in REFUSED])
def test_a_count_out_of_range_is_refused_when_composed(stage: str, overrides: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        compose(stage, [*([] if stage == "export" else ["model=tiny"]), *overrides.split()])
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


def test_the_counts_in_range_pass() -> None:
    compose("train", ["train.checkpoints_total_limit=1", "train.checkpoint_every=0", "validation.every=0"])
    compose("eval", ["eval.output_dir=scores/a", "eval.tile=16", "eval.reward_timeout=0.5"])
    compose("precompute", ["precompute.start=3", "precompute.end=3"])


def test_a_negative_limit_set_in_code_stops_the_train_stage_before_it_writes(
    tiny_path: Path, cached_data, tmp_path: Path
) -> None:
    """The probe's run: rc 0 and an empty checkpoints/ before; refused now at the stage's edge, nothing written."""
    from qie.stages import train

    base = [f"model.pretrained_model_name_or_path={tiny_path}", *cached_data.overrides]
    cfg = updated(compose("train", base), {"train.checkpoints_total_limit": -1, "train.max_steps": 2})
    run = tmp_path / "run"
    with pytest.raises(ConfigError, match="train.checkpoints_total_limit=-1 is out of range"):
        train.run(cfg, run)
    assert not run.exists()


@pytest.mark.parametrize("target", ["torch.nn.Linear", "qie.evaluation.metrics.PixelError"])
def test_a_class_that_is_no_objective_is_refused_in_one_line(target: str) -> None:
    with pytest.raises(ConfigError) as info:
        compose("train", [f"train.objective._target_={target}"])
    message = str(info.value)
    assert message.startswith(f"train.objective._target_={target!r} is not an objective (it has no evaluate, loss")
    assert "qie.extend.FlowMatching" in message and "\n" not in message


PLUGIN = """
from qie.extend import FlowMatching, SampleField

FIELD = SampleField({name!r})


class Objective(FlowMatching):
    requires = FlowMatching.requires | {{FIELD}}
"""


@pytest.mark.parametrize("name", ["target", "prompt", "mask", "controls", "pixel"])
def test_a_plugin_field_named_like_a_built_in_key_is_refused(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from helpers import fields_forgotten

    module = f"field_named_{name}"
    (tmp_path / f"{module}.py").write_text(PLUGIN.format(name=name))
    monkeypatch.syspath_prepend(str(tmp_path))
    with fields_forgotten(), pytest.raises(ConfigError) as info:
        compose("train", [f"train.objective._target_={module}.Objective"])
    message = str(info.value)
    assert f"cannot be imported: a sample field cannot be named {name!r} (" in message and "\n" not in message


@pytest.mark.parametrize("raised", ["RuntimeError('no GPU here')", "KeyError('HOME')", "SystemError('x')"])
def test_a_plugin_module_that_fails_as_it_is_imported_is_named_in_one_line(
    raised: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = f"broken_{abs(hash(raised))}"
    (tmp_path / f"{module}.py").write_text(f"x = 1\nraise {raised}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for stage, key in (("train", "train.objective._target_"), ("eval", "eval.rewards.mine._target_")):
        with pytest.raises(ConfigError) as info:
            compose(stage, [f"{'+' if stage == 'eval' else ''}{key}={module}.Thing"])
        message = str(info.value)
        kind = raised.split("(")[0]
        assert message.startswith(f"{key}='{module}.Thing' cannot be imported: its module {module} raised {kind}: ")
        assert f"{module}.py:2)" in message and "\n" not in message
