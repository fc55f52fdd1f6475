"""User code that raises or returns the wrong thing ends in one line naming the component and its `_target_`, never
a traceback from deep inside the loop: an objective's loss (raising, returning a float, a detached tensor, several
numbers, NaN on finite inputs), a reward (raising, returning None, a string, the wrong count, NaN or inf, too slow),
scored through the one reward-calling function (`qie.evaluation.reward.score`). During training the last finished
step is saved and the resume command printed; a run whose validation reward fails at its end keeps its `lora/`; a
stop signal during a slow reward does not wait for it."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import threading
import time
import uuid
from pathlib import Path

import pytest
import torch

from qie.errors import PluginError
from qie.runtime.guards import NonFiniteLoss

OBJECTIVE = """
import torch

from qie.extend import FlowMatching


class Odd(FlowMatching):
    def __init__(self, *args, mode: str = "raise", at: int = 2, **kwargs):
        super().__init__(*args, **kwargs)
        self.mode, self.at, self.calls = mode, at, 0

    def loss(self, model, batch, generator):
        self.calls += 1
        loss = super().loss(model, batch, generator)
        if self.calls < self.at:
            return loss
        if self.mode == "raise":
            raise ValueError("no depth map in this batch")
        if self.mode == "float":
            return float(loss)
        if self.mode == "detached":
            return loss.detach()
        if self.mode == "vector":
            return loss.reshape(1).repeat(2)
        return loss * float("nan")
"""

REWARD = """
import time

import torch

from qie.extend import Reward


class Odd(Reward):
    def __init__(self, mode: str = "raise"):
        self.mode = mode

    def __call__(self, images, controls, prompts, **needed):
        n = images.shape[0]
        if self.mode == "raise":
            raise RuntimeError("the judge's server is down")
        if self.mode == "none":
            return None
        if self.mode == "string":
            return "0.5"
        if self.mode == "count":
            return torch.zeros(n + 1)
        if self.mode == "nan":
            return torch.full((n,), float("nan"))
        if self.mode == "inf":
            return torch.full((n,), float("inf"))
        if self.mode == "slow":
            time.sleep(60)
        if self.mode == "grad":
            return torch.full((n,), float(torch.is_grad_enabled()))
        return torch.ones(n)
"""


def plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str) -> str:
    """A module of its own name holding `source`, importable for the test; its name."""
    name = f"odd_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def train(tiny_path: Path, cached_data, run: Path, *overrides: str) -> dict:
    from qie.checks import compose
    from qie.stages import train as train_stage

    base = [f"model.pretrained_model_name_or_path={tiny_path}", *cached_data.overrides]
    fast = ["data.batch_size=2", "logging.report_to=none", "train.checkpoint_every=0", "train.learning_rate=1e-3"]
    return train_stage.run(compose("train", [*base, *fast, *overrides]), run)


# --- an objective's loss --------------------------------------------------------------------------------------------


def test_an_objective_that_fails_is_named_and_its_last_step_saved(
    tiny_path: Path, cached_data, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    module = plugin(tmp_path, monkeypatch, OBJECTIVE)
    run = tmp_path / "run"
    objective = [f"train.objective._target_={module}.Odd", "+train.objective.mode=raise"]
    with pytest.raises(PluginError) as info:
        train(tiny_path, cached_data, run, "train.max_steps=3", *objective)
    message = str(info.value)
    said = re.escape(f"train.objective ({module}.Odd) raised ValueError in the loss of samples ")
    said += ".*" + re.escape(": no depth map in this batch (at ") + f".*{module}\\.py:\\d+\\)"
    assert re.fullmatch(said, message), message
    out = capsys.readouterr().out
    assert "qie: saved the state after step 1 before stopping" in out
    assert f"qie: once it is fixed, continue with train.resume=latest hydra.run.dir={run}" in out
    assert json.loads((run / "checkpoints" / "step-000001" / "trainer_state.json").read_text())["step"] == 1
    # The traceback is kept for the plug-in's author, in the run folder.
    assert "ValueError: no depth map in this batch" in (run / "error_traceback.txt").read_text()


LOSSES = {
    "float": "'s loss returned a float: return one number as a tensor computed from the model's output",
    "detached": "'s loss returned a tensor without a gradient (detached, or computed under no_grad)",
    "vector": "'s loss returned a tensor of 2 numbers",
}


@pytest.mark.parametrize("mode", list(LOSSES))
def test_a_loss_that_is_no_scalar_with_a_gradient_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """What the loop hands to backward: `objective_loss` refuses a float, a detached tensor, several numbers."""
    from types import SimpleNamespace

    from qie.training.loop import objective_loss

    weight = torch.ones(2, requires_grad=True)
    values = {"float": 0.5, "detached": (weight * 2).sum().detach(), "vector": weight * 2}

    class Fixed:
        def loss(self, model, batch, generator):
            return values[mode]

    batch = SimpleNamespace(ids=["s0"])
    with pytest.raises(PluginError) as info:
        objective_loss(Fixed(), None, batch, None)
    assert str(info.value).startswith(f"train.objective ({__name__}.{Fixed.__qualname__}){LOSSES[mode]}")
    assert objective_loss(SimpleNamespace(loss=lambda *a: (weight * 2).sum()), None, batch, None).requires_grad


def test_a_plugin_losss_nan_names_the_objective_not_the_cache(
    tiny_path: Path, cached_data, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = plugin(tmp_path, monkeypatch, OBJECTIVE)
    objective = [f"train.objective._target_={module}.Odd", "+train.objective.mode=nan"]
    with pytest.raises(NonFiniteLoss) as info:
        train(tiny_path, cached_data, tmp_path / "run", "train.max_steps=2", *objective)
    message = str(info.value)
    assert message.startswith("step 2 gave a NaN or infinite loss or gradient on samples ")
    assert f"the loss train.objective ({module}.Odd) computed from them was not" in message
    assert "cache entries (python -m qie.cache action=verify)" not in message


# --- a reward, called through `score` --------------------------------------------------------------------------------


def call(prompts: int = 2):
    from qie.evaluation.reward import RewardCall

    images = torch.rand(prompts, 3, 8, 8)
    return RewardCall(setting="eval.rewards.mine", images=images, controls=[[]] * prompts, prompts=["p"] * prompts)


REWARDS = {
    "raise": "raised RuntimeError: the judge's server is down (at ",
    "none": "returned None, not one score per edit: return a tensor of 2",
    "string": "returned str '0.5', not one score per edit",
    "count": "returned 3 score(s) for 2 edit(s): return one per edit",
    "nan": "returned nan for edit 0 of 2 (prompt 'p'): a reward's scores must be finite numbers; fix the reward (or",
    "inf": "returned inf for edit 0 of 2 (prompt 'p'): a reward's scores must be finite numbers; fix the reward",
}


@pytest.mark.parametrize("mode", list(REWARDS))
def test_a_rewards_failure_or_wrong_output_is_named_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    from qie.evaluation.build import build_rewards
    from qie.evaluation.reward import score

    module = plugin(tmp_path, monkeypatch, REWARD)
    reward = build_rewards({"mine": {"_target_": f"{module}.Odd", "mode": mode}}, "eval.rewards")["mine"]
    with pytest.raises(PluginError) as info:
        score(reward, call())
    assert str(info.value).startswith(f"eval.rewards.mine ({module}.Odd) {REWARDS[mode]}") and "\n" not in str(
        info.value
    )


def test_a_slow_reward_is_bounded_by_its_timeout_and_never_holds_a_stop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from qie import stop_request
    from qie.evaluation.build import build_rewards
    from qie.evaluation.reward import RewardStopped, score

    module = plugin(tmp_path, monkeypatch, REWARD)
    slow = build_rewards({"mine": {"_target_": f"{module}.Odd", "mode": "slow"}}, "eval.rewards")["mine"]
    started = time.monotonic()
    with pytest.raises(PluginError, match=r"\(odd_\w+.Odd\) took more than 0.3 s: make it quicker, or raise"):
        score(slow, call(), timeout=0.3)
    assert time.monotonic() - started < 2
    threading.Timer(0.3, stop_request.request).start()
    started = time.monotonic()
    try:
        with pytest.raises(RewardStopped, match="stopped while eval.rewards.mine .* was scoring"):
            score(slow, call())
    finally:
        stop_request.clear()
    assert time.monotonic() - started < 2
    # The caller's grad mode holds in the reward's thread.
    grad = build_rewards({"mine": {"_target_": f"{module}.Odd", "mode": "grad"}}, "eval.rewards")["mine"]
    with torch.no_grad():
        assert score(grad, call()).tolist() == [0.0, 0.0]
    assert score(grad, call()).tolist() == [1.0, 1.0]


def test_eval_scores_refuse_a_broken_rewards_output_and_keep_an_unmeasured_nan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`qie.eval` showed a NaN as null and took the first of two scores per edit; now each is refused in one line,
    while a built-in metric's NaN (an empty edit region, declared `nan_when_unmeasured`) is still left out."""
    from qie.evaluation.build import build_rewards
    from qie.evaluation.scoring import Row, score_row, summarize

    module = plugin(tmp_path, monkeypatch, REWARD)
    image = torch.rand(3, 16, 16)
    row = Row("r0", "make it red", None, [torch.rand(3, 16, 16)], torch.rand(3, 16, 16), torch.zeros(16, 16) > 0)
    for mode, said in (("nan", "returned nan for edit 0 of 1"), ("count", "returned 2 score(s) for 1 edit(s)")):
        rewards = build_rewards({"mine": {"_target_": f"{module}.Odd", "mode": mode}}, "eval.rewards")
        with pytest.raises(PluginError, match="^" + re.escape(f"eval.rewards.mine ({module}.Odd) {said}")):
            score_row(rewards, image, row)
    psnr = build_rewards({"psnr": {"_target_": "qie.evaluation.metrics.EditPsnr"}}, "eval.rewards")
    scores = score_row(psnr, image, row)  # the edit region is empty: nothing to measure
    assert math.isnan(scores["psnr"]) and summarize([row], [[scores]], [0], ["psnr"])["metrics"] == {"psnr": None}


# --- during training ---------------------------------------------------------------------------------------------


def test_a_validation_reward_failing_at_the_end_keeps_the_runs_lora(
    tiny_path: Path, cached_data, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    module = plugin(tmp_path, monkeypatch, REWARD)
    run = tmp_path / "run"
    rewards = [f"+validation.rewards.mine._target_={module}.Odd", "+validation.rewards.mine.mode=none"]
    with pytest.raises(PluginError) as info:
        train(
            tiny_path,
            cached_data,
            run,
            "train.max_steps=2",
            "validation.every=2",
            "validation.heldout_samples=2",
            "predict.num_inference_steps=2",
            *rewards,
        )
    assert str(info.value).startswith(f"validation.rewards.mine ({module}.Odd) returned None, not one score per edit")
    assert (run / "lora" / "pytorch_lora_weights.safetensors").is_file()  # the weights of the finished run kept
    result = json.loads((run / "train_result.json").read_text())
    assert result["step"] == 2 and result["error"] == str(info.value) and not result["stopped_by_signal"]
    assert (run / "checkpoints" / "step-000002").is_dir()
    assert "qie: stopped by an error at step 2" in capsys.readouterr().out


def test_a_stop_signal_during_a_slow_validation_reward_does_not_wait_for_it(
    tiny_path: Path, cached_data, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The probe's SIGTERM waited 104 s for a slow reward; now the step's state is saved and training stops."""
    module = plugin(tmp_path, monkeypatch, REWARD)
    rewards = [f"+validation.rewards.mine._target_={module}.Odd", "+validation.rewards.mine.mode=slow"]
    from qie.evaluation import reward as reward_module

    real = reward_module._in_thread

    def signalled(fn, name, timeout):  # the signal arrives while the slow reward runs
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()
        return real(fn, name, timeout)

    monkeypatch.setattr(reward_module, "_in_thread", signalled)
    started = time.monotonic()
    result = train(
        tiny_path,
        cached_data,
        tmp_path / "run",
        "train.max_steps=4",
        "validation.every=1",
        "validation.heldout_samples=2",
        "predict.num_inference_steps=2",
        *rewards,
    )
    assert time.monotonic() - started < 40  # not the reward's 60 s per validation
    assert result["stopped_by_signal"] and result["signal"] == signal.SIGTERM and result["step"] == 1
    assert (tmp_path / "run" / "checkpoints" / "step-000001").is_dir()
