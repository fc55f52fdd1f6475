"""4-bit base weights: int4 (optimum-quanto) trains, resumes exactly and infers on the CPU; nf4 (bitsandbytes)
is refused in one line where there is no GPU."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import CachedData, small_config, write_noise_image

from qie.errors import ConfigError
from qie.stages import train as train_stage

TRAINING = ["model.quantize=int4", "train.max_steps=4", "train.checkpoint_every=2", "train.learning_rate=1e-3",
            "data.batch_size=2", "train.seed=7", "train.lr_scheduler.num_warmup_steps=3"]  # fmt: skip


def losses(run_dir: Path) -> list[tuple[int, float]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [(r["step"], r["loss"]) for r in map(json.loads, lines) if "loss" in r]


@pytest.mark.slow  # int4 on CPU: the slowest quantized run; int8 and fp8 run in the family battery
def test_int4_trains_resumes_exactly_and_infers(cached_data: CachedData, tmp_path: Path) -> None:
    from optimum.quanto import QLinear, qint4
    from stage_edges import parts_of, predictor_for

    cfg = small_config("train", *cached_data.overrides, *TRAINING)
    transformer = parts_of(cfg.model, ["transformer"]).transformer
    quantized = [m for m in transformer.modules() if isinstance(m, QLinear)]
    assert quantized and all(m.weight.qtype == qint4 for m in quantized)
    assert not isinstance(transformer.img_in, QLinear)  # the family's full-precision modules stay so

    whole = train_stage.run(cfg, tmp_path / "whole")
    plain = train_stage.run(small_config("train", *cached_data.overrides, *TRAINING[1:]), tmp_path / "plain")
    assert all(map(math.isfinite, whole["losses"])) and whole["losses"] != plain["losses"]
    np.testing.assert_allclose(whole["losses"], plain["losses"], rtol=0.1)  # near the unquantized run's
    resume = f"train.resume={tmp_path / 'whole' / 'checkpoints' / 'step-000002'}"
    resumed = train_stage.run(small_config("train", *cached_data.overrides, *TRAINING, resume), tmp_path / "resumed")
    assert resumed["step"] == 4 and losses(tmp_path / "resumed") == losses(tmp_path / "whole")[2:]

    image = write_noise_image(tmp_path / "in.png", 1)
    kw = dict(num_inference_steps=2, true_cfg_scale=1.0, seed=3, output_type="np")
    lora = f"predict.lora={tmp_path / 'whole' / 'lora'}"
    out = predictor_for(small_config("infer", "model.quantize=int4", lora)).predict([image], "a cat", **kw)
    full = predictor_for(small_config("infer", lora)).predict([image], "a cat", **kw)
    assert out.shape == full.shape and np.isfinite(out).all()
    assert 0 < np.abs(out - full).max() < 0.2  # the 4-bit base moves the image a little


def test_nf4_is_refused_without_a_gpu_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    from qie.checks.weights import nf4_problem

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError) as err:
        small_config("train", "model.quantize=nf4")
    assert (
        str(err.value).count("\n") == 0
        and "needs a CUDA GPU" in str(err.value)
        and "model.quantize=int4" in str(err.value)
    )
    assert 'pip install "qie[bnb]"' in nf4_problem(cuda=True, installed=False)
    assert nf4_problem(cuda=True, installed=True) is None


def test_nf4_is_refused_for_a_transformer_off_the_gpu(tiny_path: Path) -> None:
    """Where the config passed (a GPU is there) but the transformer is placed on the CPU."""
    from qie.components import build_parts
    from qie.components.registry import Placement
    from qie.models import families

    placements = {"transformer": Placement(torch.device("cpu"), torch.float32)}
    with pytest.raises(ConfigError, match="model.quantize=nf4 .* its device is cpu"):
        build_parts(str(tiny_path), ["transformer"], families()["qwen_image"].part_classes, placements, quantize="nf4")


def test_4_bit_weights_refuse_block_swap_when_composed() -> None:
    """The swapper moves plain and 8-bit weights; int4's are packed tensors inside tensors (nf4's likewise)."""
    train = ("train", "train.blocks_to_swap", ["train.gradient_checkpointing=true"])
    for stage, key, extra in (train, ("infer", "predict.blocks_to_swap", [])):
        with pytest.raises(ConfigError, match=f"{key} moves plain and 8-bit weights only.*set {key}=0"):
            small_config(stage, "model.quantize=int4", f"{key}=2", *extra)
