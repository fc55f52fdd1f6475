"""EMA of the LoRA weights: the update rule, checkpoints that resume it exactly, its own LoRA export, validation
sampling with it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from diffusers import AutoModel
from helpers import CachedData, small_config
from safetensors.torch import load_file

from qie.adapters.lora import add_lora
from qie.errors import ConfigError
from qie.stages import train as train_stage
from qie.training.ema import Ema

RUN = ["train.max_steps=4", "train.checkpoint_every=2", "train.learning_rate=1e-2", "data.batch_size=2",
       "train.ema.decay=0.75", "train.ema.every=2"]  # fmt: skip


def test_the_average_moves_every_n_steps_and_can_be_applied() -> None:
    p = torch.nn.Parameter(torch.tensor([0.0, 4.0]))
    ema = Ema([p], decay=0.75, every=2, cpu=True)
    p.data = torch.tensor([4.0, 0.0])
    ema.update(1)  # not an update step
    assert ema.shadow[0].tolist() == [0.0, 4.0]
    ema.update(2)
    assert ema.shadow[0].tolist() == [1.0, 3.0]  # 0.75 * old + 0.25 * new
    with ema.applied():
        assert p.tolist() == [1.0, 3.0]
    assert p.tolist() == [4.0, 0.0]


def trained_names(path: Path) -> list[str]:
    """The LoRA weights' names (as saved) in the order the trainer holds its parameters."""
    transformer = AutoModel.from_pretrained(str(path), subfolder="transformer")
    add_lora(transformer, 16, 16, list(small_config("train").train.lora.target_modules))
    return [n.replace(".default", "") for n, p in transformer.named_parameters() if p.requires_grad]


def test_cli_ema_is_checkpointed_exported_and_resumes_exactly(
    cached_data: CachedData, tiny_path: Path, tmp_path: Path
) -> None:
    result = train_stage.run(small_config("train", *cached_data.overrides, *RUN), tmp_path / "whole")
    checkpoints = tmp_path / "whole" / "checkpoints"
    raw4 = load_file(checkpoints / "step-000004" / "state" / "model.safetensors")
    ema2 = load_file(checkpoints / "step-000002" / "state" / "ema.safetensors")
    ema4 = load_file(checkpoints / "step-000004" / "state" / "ema.safetensors")
    # The step-4 average from the step-2 one and the step-4 weights (the average is in the parameters' order).
    names = trained_names(tiny_path)
    assert len(names) == len(ema2) == len(ema4)
    for (i, old), name in zip(sorted(ema2.items()), names):
        torch.testing.assert_close(ema4[i], 0.75 * old + 0.25 * raw4[name].float(), rtol=1e-6, atol=1e-7)
    assert Path(result["ema_lora"]) == tmp_path / "whole" / "lora" / "ema" / "pytorch_lora_weights.safetensors"
    ema_file, raw_file = load_file(result["ema_lora"]), load_file(result["lora"])
    assert ema_file.keys() == raw_file.keys() and any(not torch.equal(ema_file[k], raw_file[k]) for k in ema_file)
    assert (checkpoints / "step-000004" / "ema" / "pytorch_lora_weights.safetensors").is_file()

    resumed = train_stage.run(
        small_config("train", *cached_data.overrides, *RUN, f"train.resume={checkpoints / 'step-000002'}"),
        tmp_path / "resumed",
    )
    again = load_file(resumed["ema_lora"])
    assert all(torch.allclose(again[k], ema_file[k], rtol=0, atol=1e-7) for k in ema_file)


def test_validation_samples_with_the_average(
    cached_data: CachedData, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from qie.training.validation import Validator

    seen = []

    def record(self, step, transformer):
        seen.append({n: p.detach().clone() for n, p in transformer.named_parameters() if p.requires_grad})
        return []

    monkeypatch.setattr(Validator, "__call__", record)
    run = [*RUN, "train.max_steps=2", "train.ema.every=1", "validation.every=2", "validation.use_ema=true"]
    result = train_stage.run(small_config("train", *cached_data.overrides, *run), tmp_path)
    ema = load_file(tmp_path / "checkpoints" / "step-000002" / "state" / "ema.safetensors")
    assert len(seen) == 1 and result["step"] == 2
    assert len(seen[0]) == len(ema)
    for got, (_, want) in zip(seen[0].values(), sorted(ema.items())):  # both in the parameters' order
        torch.testing.assert_close(got.float(), want)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["train.ema.decay=1.5"], "decay=1.5 is out of range"),
        (["train.mode=full", "train.ema.decay=0.9"], "needs train.mode=lora"),
        (["validation.use_ema=true"], "needs an EMA"),
    ],
)
def test_ema_settings_that_cannot_work_are_refused(
    cached_data: CachedData, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, overrides: list[str], match: str
) -> None:
    monkeypatch.setattr(train_stage, "build_train_state", lambda *a: pytest.fail("a model was built"))
    with pytest.raises(ConfigError, match=match):
        train_stage.run(small_config("train", *cached_data.overrides, *overrides), tmp_path)
