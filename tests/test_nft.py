# ruff: noqa: F811 - the tests take the imported fixtures as arguments
"""Forward-process online RL (`train/objective=nft`, `awm`): the losses equal their formulas at fixed draws on the
tiny edit model, the sampling policy is a frozen copy that follows the trained weights, what the objective refuses,
and rows without targets train and resume exactly through the stages."""

from __future__ import annotations

import json
import math

import pytest
import torch
from test_grpo import lora_model, rollout_batch, rows, targetless, tiny  # noqa: F401 - fixtures, used as arguments

from qie.errors import ConfigError, ModelLoadError
from qie.models import model_spec
from qie.stages.train_model import objective_reward
from qie.training.flow_sde import group_advantages
from qie.training.objectives import ObjectiveUse, check_use
from qie.training.objectives.nft import Nft
from qie.training.objectives.run_context import RunContext
from qie.training.timesteps import SigmaSampling

SETTINGS = {"group_size": 3, "sampling_steps": 2, "reward": {"_target_": "qie.demo.reward.RecolourReward"}}
NFT = ["train/objective=nft", "train.objective.group_size=2", "train.objective.sampling_steps=2"]


def nft_objective(spec, parts, policy, **options) -> Nft:
    context = RunContext(
        family=spec.family,
        sigmas=SigmaSampling(method="uniform"),
        scheduler=parts.scheduler,
        pipeline_config=parts.pipeline_config,
        sampling_defaults=spec.call_defaults(),
        transformer=policy,
        decoder=lambda: parts.vae,
        rows=rows,
        rewards=objective_reward,
    )
    return Nft(context, **{**SETTINGS, **options})


def moved_copy(objective: Nft) -> None:
    """Make the sampling policy differ from the trained weights (as after some steps), and the next soft update
    keep half of it."""
    g = torch.Generator().manual_seed(11)
    for t in objective.policy.tensors.values():
        t.add_(torch.randn(t.shape, generator=g) * 0.05)
    objective.count.fill_(1000)  # decay = min(0.001 * 1000, 0.5) = 0.5


def by_hand(objective: Nft, policy, batch, seed: int):
    """(new prediction, sampling policy's prediction, advantages, sigmas) drawn as the objective's loss draws them,
    after the loss ran once (its soft update done)."""
    g = torch.Generator().manual_seed(seed)
    latents, rewards, _ = objective.rollout(policy, batch, g)
    own = batch.take([0] * 3)
    own.latents = latents
    noise, sigmas = objective.context.noise_and_sigmas(own, g)
    with torch.no_grad(), objective.policy.active():
        old = objective.context.flow_prediction(policy, own, noise, sigmas)
    new = objective.context.flow_prediction(policy, own, noise, sigmas)
    return new, old, group_advantages(rewards, 3), sigmas


def test_the_nft_loss_is_its_implicit_positive_and_negative_policies_at_the_same_draws(tiny) -> None:
    cfg, spec, parts = tiny
    policy = lora_model(cfg)
    objective = nft_objective(spec, parts, policy, beta=0.5, adv_clip=2.0)
    moved_copy(objective)
    batch = rollout_batch()
    loss = objective.loss(policy, batch, torch.Generator().manual_seed(7))
    metrics = objective.step_metrics()
    new, old, advantages, sigmas = by_hand(objective, policy, batch, 7)
    v, v_old, target = new.prediction.float(), old.prediction.float(), new.target.float()
    assert not torch.allclose(v, v_old)  # the sampling policy is the frozen copy, not the trained weights
    s = sigmas.view(-1, 1, 1)

    def error(velocity):
        x0 = s * (velocity - target)
        return x0.pow(2).flatten(1).mean(1) / x0.abs().flatten(1).mean(1)

    r = 0.5 + advantages.clamp(-2, 2) / 4
    positive, negative = error(0.5 * v_old + 0.5 * v), error(1.5 * v_old - 0.5 * v)
    expected = (2.0 / 0.5) * (r * positive + (1 - r) * negative).mean()
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=0)
    loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for n, p in policy.named_parameters() if "lora_B" in n)
    assert metrics["decay"] == 0.5 and metrics["reward_best"] >= metrics["reward_mean"] > 0
    assert {"rollout_seconds", "reward_seconds", "rewards_per_second", "reward_std"} <= set(metrics)


def test_the_awm_loss_is_ppos_clipped_loss_with_the_flow_error_as_log_likelihood(tiny) -> None:
    cfg, spec, parts = tiny
    policy = lora_model(cfg)
    objective = nft_objective(spec, parts, policy, loss="awm", clip_range=1e-3)
    moved_copy(objective)
    batch = rollout_batch()
    loss = objective.loss(policy, batch, torch.Generator().manual_seed(5))
    clipped = objective.step_metrics()["clip_fraction"]
    new, old, advantages, _ = by_hand(objective, policy, batch, 5)
    ratio = torch.exp(old.error() - new.error())
    unclipped, bounded = -advantages * ratio, -advantages * ratio.clamp(1 - 1e-3, 1 + 1e-3)
    torch.testing.assert_close(loss, torch.maximum(unclipped, bounded).mean(), rtol=1e-5, atol=1e-9)
    assert clipped == pytest.approx(float(((ratio - 1).abs() > 1e-3).float().mean()))


def test_the_sampling_policy_follows_the_trained_weights_on_policy_at_first(tiny) -> None:
    cfg, spec, parts = tiny
    policy = lora_model(cfg)
    objective = nft_objective(spec, parts, policy, decay_rate=0.25, decay_max=0.6)
    trained = {n: p.detach().clone() for n, p in policy.named_parameters() if p.requires_grad}
    copy = objective.policy.tensors
    for t in copy.values():
        t.zero_()
    assert [objective.decay() for _ in range(1)] == [0.0]
    objective.policy.follow(objective.decay())  # decay 0: the copy is the trained weights
    assert all(torch.equal(copy[n], trained[n]) for n in trained)
    with torch.no_grad():
        for p in policy.parameters():
            if p.requires_grad:
                p.add_(1.0)
    objective.count.fill_(2)  # decay min(0.25 * 2, 0.6) = 0.5: half way to the moved weights
    objective.policy.follow(objective.decay())
    assert all(torch.allclose(copy[n], trained[n] + 0.5) for n in trained)
    objective.count.fill_(100)
    assert objective.decay() == 0.6
    with objective.policy.active():  # the copy computes; the trained weights are back after
        assert all(torch.allclose(p, trained[n] + 0.5) for n, p in policy.named_parameters() if p.requires_grad)
    assert all(torch.allclose(p, trained[n] + 1.0) for n, p in policy.named_parameters() if p.requires_grad)


@pytest.mark.parametrize(
    "options,use,message",
    [
        ({"loss": "dpo"}, {}, r"train.objective.loss=dpo is out of range: give one of nft, awm"),
        ({"group_size": 1}, {}, r"group_size=1 is out of range"),
        ({"sampling_steps": 1}, {}, r"sampling_steps=1 is out of range: give 2 or more \(one step's sigmas are NaN"),
        ({"decay_max": 1.0}, {}, r"decay_max=1.0 is out of range"),
        ({"reward": None}, {}, r"train/objective=nft needs a reward"),
        ({}, {"regularization": True}, r"does not mix in data.regularization"),
        ({}, {"caption_dropout": 0.1}, r"set data.caption_dropout_rate=0"),
    ],
)
def test_what_nft_refuses_in_one_line(small_cfg, options, use, message) -> None:
    family = model_spec(small_cfg("train").model).family
    node = {"_target_": "qie.training.objectives.nft.Nft", **SETTINGS, **options}
    with pytest.raises(ConfigError, match=message) as info:
        regularization, dropout = use.get("regularization", False), use.get("caption_dropout", 0.0)
        check_use(node, ObjectiveUse(family, True, regularization, caption_dropout=dropout))
    assert "\n" not in str(info.value)


@pytest.fixture(scope="module")
def targetless_nft(small_cfg, targetless, tmp_path_factory):  # noqa: F811
    from qie.stages import precompute

    cache = tmp_path_factory.mktemp("targetless_nft")
    data = [f"data.path={targetless}", f"cache.dir={cache}"]
    precompute.run(small_cfg("precompute", *data, *NFT), cache / "run")
    return data


def test_rows_without_targets_train_and_a_resumed_run_repeats_the_straight_runs_steps(
    small_cfg, targetless_nft, tmp_path
) -> None:
    from qie.stages import train

    run = [*targetless_nft, *NFT, "train.max_steps=4", "train.checkpoint_every=2", "train.learning_rate=1e-2"]
    run.append("train.objective.decay_rate=0.2")  # the sampling policy lags from the second step on
    straight = train.run(small_cfg("train", *run), tmp_path / "straight")
    checkpoint = tmp_path / "straight" / "checkpoints" / "step-000002"
    assert (checkpoint / "state" / "objective.safetensors").is_file()  # the frozen copy and the batch count
    resumed = train.run(small_cfg("train", *run, f"train.resume={checkpoint}"), tmp_path / "resumed")
    assert resumed["losses"] == straight["losses"][2:]
    assert resumed["param_checksums"] == straight["param_checksums"]
    steps = [json.loads(line) for line in (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()]
    assert [s["decay"] for s in steps if "decay" in s] == pytest.approx([0.0, 0.2, 0.4, 0.5])
    assert all(math.isfinite(s["loss"]) and 0 < s["reward_mean"] <= 1 for s in steps if "loss" in s)
    (checkpoint / "state" / "objective.safetensors").unlink()  # as a checkpoint of another objective
    with pytest.raises(ModelLoadError, match=r"keeps no state of the objective .*: it was saved by a run of another"):
        train.run(small_cfg("train", *run, f"train.resume={checkpoint}"), tmp_path / "refused")
