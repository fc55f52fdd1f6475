"""train.compile: the transformer's repeated block compiled (regional, dynamic shapes) gives the eager losses,
with gradient checkpointing on, and resumes exactly. Compilation on the CPU is slow: one tiny model, 2 steps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import CachedData, small_config
from safetensors.torch import load_file
from test_train import LOSSES, TRAINING

from qie.errors import ConfigError
from qie.runtime.compile import compile_blocks
from qie.stages import train as train_stage

# Compiled kernels sum in another order than eager ones: the first loss (before any update) agrees to float32
# rounding, the second (after one AdamW step on gradients from the compiled backward) within this.
REL = 1e-4
COMPILED = [*TRAINING[1:], "train.max_steps=2", "train.compile=true", "train.gradient_checkpointing=true"]


@pytest.mark.slow  # compiling on CPU takes minutes
def test_compiled_blocks_give_the_eager_losses(
    cached_data: CachedData, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    result = train_stage.run(small_config("train", *cached_data.overrides, *COMPILED), tmp_path / "run")
    out = capsys.readouterr().out
    assert "2 QwenImageTransformerBlock blocks compiled as one region with dynamic shapes" in out
    assert result["losses"] == pytest.approx(LOSSES[:2], rel=REL), f"losses: {result['losses']}"
    assert result["losses"][0] == pytest.approx(LOSSES[0], rel=1e-6)
    # The LoRA file names the eager modules: compiling changed no weight name.
    lora = load_file(tmp_path / "run" / "lora" / "pytorch_lora_weights.safetensors")
    assert lora and not any("_orig_mod" in k for k in lora)


@pytest.mark.slow  # three compiled runs: minutes on two busy CPU cores
def test_compiled_training_resumes_exactly(cached_data: CachedData, tmp_path: Path) -> None:
    whole = train_stage.run(small_config("train", *cached_data.overrides, *COMPILED, "train.checkpoint_every=1"),
                            tmp_path / "whole")  # fmt: skip
    resume = f"train.resume={tmp_path / 'whole' / 'checkpoints' / 'step-000001'}"
    resumed = train_stage.run(small_config("train", *cached_data.overrides, *COMPILED, resume), tmp_path / "resumed")
    assert resumed["losses"] == pytest.approx(whole["losses"][1:], rel=0, abs=1e-6)
    a = load_file(tmp_path / "whole" / "lora" / "pytorch_lora_weights.safetensors")
    b = load_file(tmp_path / "resumed" / "lora" / "pytorch_lora_weights.safetensors")
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], rtol=0, atol=1e-7) for k in a)
    steps = [json.loads(line)["step"] for line in (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [2]


def test_a_model_without_repeated_blocks_is_refused_in_one_line() -> None:
    with pytest.raises(ConfigError, match=r"train.compile=true: Linear names no repeated block to compile"):
        compile_blocks(torch.nn.Linear(2, 2))
