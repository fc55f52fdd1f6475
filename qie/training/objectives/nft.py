"""Forward-process online RL of edits: DiffusionNFT (`train/objective=nft`) and Advantage Weighted Matching
(`train/objective=awm`, the same objective with `loss: awm`).

Each step, for each sample of the batch, the sampling policy (a frozen copy of the trained weights, `FrozenCopy`)
samples `group_size` edits from the sample's cached prompt and control embeddings with the family's own sampler, the
ODE in `sampling_steps` steps, without CFG by default and without recording anything of the trajectory: only the
clean latents x0 are kept. They are decoded and scored by the reward (`qie.extend.Reward`, higher is better); within
each group the rewards are normalised ((r - mean) / (std + eps)): the advantages A. Then the policy is trained on its
own samples with the flow-matching loss, at noise levels drawn as `train.timestep_sampling` says
(x_t = (1 - s) x0 + s eps, v* = eps - x0), with the sampling policy's velocity v_old beside the model's v:

- nft (Zheng et al. 2025, arXiv 2509.16117): the implicit positive and negative policies
  v+ = (1 - beta) v_old + beta v and v- = (1 + beta) v_old - beta v, and with the optimality probability
  r = 1/2 + clip(A, -c, c) / (2c) (c = `adv_clip`),

      loss = c / beta * mean(r |v+ - v*|^2 + (1 - r) |v- - v*|^2)

  each error taken in x0 space and divided by its mean absolute value (`adaptive_weight`, no gradient), so that every
  sample and noise level weighs alike;
- awm (Xue et al. 2025, arXiv 2509.25050): the flow-matching error as the log-likelihood, log p = -|v - v*|^2, in
  PPO's clipped policy-gradient loss against the sampling policy's (`clip_range`).

Optionally `kl_weight` times the velocity distance to the reference (the base, the adapter turned off). After each
batch the sampling policy follows the trained weights: copy <- d copy + (1 - d) trained, d = min(decay_rate * i,
decay_max) at the i-th batch (0 at first: on-policy), as DiffusionNFT's soft update; the copy and the count are kept in
every checkpoint, so a resumed run goes on exactly. Every draw comes from the batch's generator.

Logged: `reward_mean`, `reward_std` (within groups), `reward_best`, `decay`, `kl` (with a KL), `clip_fraction`
(awm), `rollout_seconds`, `reward_seconds`, `rewards_per_second`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from qie.errors import ConfigError
from qie.models.sampling import initial_noise
from qie.training.flow_sde import clipped_loss, group_advantages, unwrapped
from qie.training.objectives import ObjectiveUse, StepMeans
from qie.training.objectives.rollouts import Scoring, rollout_shape
from qie.types import Batch

if TYPE_CHECKING:
    from qie.models.flow import FlowPrediction
    from qie.training.objectives.context import ObjectiveContext

NAME = "nft"
LOSSES = ("nft", "awm")


@dataclass(frozen=True, kw_only=True)
class NftSettings:
    """The objective's settings (`conf/train/objective/nft.yaml`, `awm.yaml`)."""

    loss: str = "nft"
    group_size: int = 8
    sampling_steps: int = 4
    true_cfg_scale: float = 1.0
    reward: Any = None  # a {_target_: ..., keys} node
    beta: float = 1.0
    adv_clip: float = 5.0
    adaptive_weight: bool = True
    clip_range: float = 0.2
    kl_weight: float = 0.0
    reference_lora: str | None = None  # a LoRA file as the KL's reference (else the base with the adapter off)
    decay_rate: float = 0.001
    decay_max: float = 0.5
    rollout_pixels: int | None = None  # the rollouts' area in pixels; None: the batch's
    overlap_rewards: bool = True  # each group scored while the next one samples

    def checked(self) -> NftSettings:
        """These settings, or ConfigError (one line) for one out of range or a missing reward."""
        s = self
        checks = [
            ("loss", s.loss in LOSSES, f"give one of {', '.join(LOSSES)}"),
            ("group_size", s.group_size >= 2, "give 2 or more (advantages compare edits within a group)"),
            (
                "sampling_steps",
                s.sampling_steps >= 2,
                "give 2 or more (one step's sigmas are NaN once the scheduler stretches its shift to shift_terminal)",
            ),
            ("true_cfg_scale", s.true_cfg_scale >= 1, "give 1 (no CFG) or more"),
            ("beta", 0 < s.beta <= 10, "give a value above 0 and at most 10 (e.g. 1)"),
            ("adv_clip", s.adv_clip > 0, "give a value above 0 (e.g. 5)"),
            ("clip_range", s.clip_range > 0, "give a value above 0 (e.g. 0.2)"),
            ("kl_weight", s.kl_weight >= 0, "give 0 or more"),
            ("decay_rate", s.decay_rate >= 0, "give 0 or more (e.g. 0.001)"),
            ("decay_max", 0 <= s.decay_max < 1, "give a value from 0 to below 1 (e.g. 0.5)"),
            ("rollout_pixels", s.rollout_pixels is None or s.rollout_pixels >= 256, "give 256 or more, or null"),
        ]
        for name, ok, hint in checks:
            if not ok:  # NaN fails every comparison
                raise ConfigError(f"train.objective.{name}={getattr(s, name)} is out of range: {hint}")
        if s.reward is None:
            raise ConfigError(
                f"train/objective={s.loss} needs a reward: set train.objective.reward._target_ (e.g. "
                "qie.demo.reward.RecolourReward, or a qie.extend.Reward of your own)"
            )
        return s


class Nft:
    """DiffusionNFT and AWM (see the module's text).

    Args:
        context: the sampler, decoder, rows and reward (`sample`, `decode`, `reward`, `score`), the flow-matching
            prediction (`flow_prediction`), noise and noise levels, the frozen copy of the trained weights (the
            sampling policy) and, with a KL, the reference.
        loss, group_size, ...: `NftSettings`.
    """

    requires: ClassVar[frozenset[str]] = frozenset({"empty_prompt"})  # no target; CFG's negative when asked

    def __init__(
        self,
        context: ObjectiveContext,
        *,
        loss: str = "nft",
        group_size: int = 8,
        sampling_steps: int = 4,
        true_cfg_scale: float = 1.0,
        reward: Any = None,
        beta: float = 1.0,
        adv_clip: float = 5.0,
        adaptive_weight: bool = True,
        clip_range: float = 0.2,
        kl_weight: float = 0.0,
        reference_lora: str | None = None,
        decay_rate: float = 0.001,
        decay_max: float = 0.5,
        rollout_pixels: int | None = None,
        overlap_rewards: bool = True,
    ) -> None:
        settings = {k: v for k, v in locals().items() if k not in ("self", "context")}
        self.settings = NftSettings(**settings).checked()
        self.context = context
        self.reward = context.reward(self.settings.reward)
        self.policy = context.frozen_copy()
        self.count = torch.zeros((), dtype=torch.int64)  # batches trained: the soft update's schedule
        context.keep("nft", {"batches": self.count})
        kl = self.settings.kl_weight > 0
        self.reference = context.reference(self.settings.reference_lora) if kl else None
        self.means = StepMeans()

    @classmethod
    def use_problem(cls, use: ObjectiveUse) -> str | None:
        name = use.options.get("loss", NAME)
        if use.family.outputs.layers:
            return (
                f"train/objective={name} does not train a layered model: its rewards score one image per edit; "
                "use train/objective=flow_matching"
            )
        if use.regularization:
            return (
                f"train/objective={name} does not mix in data.regularization (its batches are its own samples, not "
                "targets): remove data.regularization.path"
            )
        if use.caption_dropout > 0:
            return (
                f"train/objective={name} scores each edit against its sample's instruction, which "
                f"data.caption_dropout_rate={use.caption_dropout} would hide from the model that samples it: "
                "set data.caption_dropout_rate=0"
            )
        NftSettings(**{k: v for k, v in use.options.items() if k in NftSettings.__dataclass_fields__}).checked()
        return None

    def prepare(self, transformer: torch.nn.Module) -> None:
        pass  # the sampling policy and the reference are the context's

    def decay(self) -> float:
        """The soft update's decay at the current batch."""
        s = self.settings
        return min(s.decay_rate * int(self.count), s.decay_max)

    def rollout(self, model: Any, batch: Batch, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """`group_size` edits of each sample by the sampling policy (no gradient), sample-major, at `rollout_pixels`
        where set, each group scored while the next samples: their clean latents, rewards (higher is better) and how
        long sampling and scoring took."""
        s, g = self.settings, self.settings.group_size
        shape = rollout_shape(self.context, batch, s.rollout_pixels)
        latents, rewards = [], []
        with Scoring(self.context, self.reward, s.overlap_rewards) as scoring:
            for i in range(len(batch.ids)):
                one, started = batch.take([i]), time.perf_counter()
                noise = initial_noise((g, *shape), generator, batch.latents.device, batch.prompt_embeds.dtype)
                with torch.no_grad(), self.policy.active():
                    sampled = self.context.sample(
                        unwrapped(model),
                        one,
                        noise=noise,
                        steps=s.sampling_steps,
                        copies=g,
                        true_cfg_scale=s.true_cfg_scale,
                    )
                scoring.sampled(time.perf_counter() - started)
                latents.append(sampled)
                rewards.append(scoring.submit(one, sampled))
            rewards = [r.result() for r in rewards]
        return torch.cat(latents), torch.cat(rewards), scoring.measures()

    def loss(self, model: torch.nn.Module, batch: Batch, generator: torch.Generator) -> torch.Tensor:
        s = self.settings
        decay = self.decay()
        self.policy.follow(decay)
        self.count += 1
        latents, rewards, measures = self.rollout(model, batch, generator)
        advantages = group_advantages(rewards, s.group_size).to(batch.latents.device)
        own = replace(batch.take([i for i in range(len(batch.ids)) for _ in range(s.group_size)]), latents=latents)
        noise, sigmas = self.context.noise_and_sigmas(own, generator)
        with torch.no_grad(), self.policy.active():
            old = self.context.flow_prediction(unwrapped(model), own, noise, sigmas)
        new = self.context.flow_prediction(model, own, noise, sigmas)
        if s.loss == "nft":
            loss = self._nft(new, old, advantages)
        else:
            loss, measures["clip_fraction"] = self._awm(new, old, advantages)
        if self.reference is not None:
            with torch.no_grad(), self.reference.active():
                base = self.context.flow_prediction(unwrapped(model), own, noise, sigmas)
            kl = (new.prediction.float() - base.prediction.float()).pow(2).flatten(1).mean(1).mean()
            loss, measures["kl"] = loss + s.kl_weight * kl, kl.detach()
        groups = rewards.reshape(-1, s.group_size)
        self.means.add(
            reward_mean=rewards.mean(),
            reward_std=groups.std(1, unbiased=False).mean(),
            reward_best=groups.max(1).values.mean(),
            decay=decay,
            **measures,
        )
        return loss * batch.loss_weight

    def _nft(self, new: FlowPrediction, old: FlowPrediction, advantages: torch.Tensor) -> torch.Tensor:
        s = self.settings
        r = 0.5 + advantages.clamp(-s.adv_clip, s.adv_clip) / (2 * s.adv_clip)
        v, v_old = new.prediction.float(), old.prediction.float().detach()
        positive = self._error(new, (1 - s.beta) * v_old + s.beta * v)
        negative = self._error(new, (1 + s.beta) * v_old - s.beta * v)
        return (s.adv_clip / s.beta) * (r * positive + (1 - r) * negative).mean()

    def _error(self, out: FlowPrediction, velocity: torch.Tensor) -> torch.Tensor:
        """Each sample's error of `velocity` to the true one: in x0 space (x0 - x0_pred = s (v - v*)) divided by its
        mean absolute value (no gradient) with `adaptive_weight`, else the plain flow-matching error."""
        if not self.settings.adaptive_weight:
            return out.error(velocity)
        sigmas = out.sigmas.float().to(velocity.device).view(-1, *([1] * (velocity.dim() - 1)))
        x0_error = sigmas * (velocity - out.target.float())
        scale = x0_error.detach().abs().flatten(1).mean(1).clamp_min(1e-5)
        return x0_error.pow(2).flatten(1).mean(1) / scale

    def _awm(
        self, new: FlowPrediction, old: FlowPrediction, advantages: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """PPO's clipped loss with the flow-matching error as the log-likelihood, and the share of ratios clipped."""
        log_p, log_p_old = -new.error(), -old.error().detach()
        return clipped_loss(advantages, log_p[:, None], log_p_old[:, None], self.settings.clip_range)

    def step_metrics(self) -> dict[str, float]:
        return self.means.pop()

    @torch.no_grad()
    def evaluate(
        self, model: torch.nn.Module, batch: Batch, noise: torch.Tensor, sigmas: torch.Tensor
    ) -> dict[str, float]:
        """The reward of each sample's edit sampled by the model (the family's ODE loop, `sampling_steps` steps)
        from `noise`; "loss" is its negative (lower is better, as every objective's). `sigmas` is not used."""
        s = self.settings
        latents = self.context.sample(
            model, batch, noise=noise, steps=s.sampling_steps, true_cfg_scale=s.true_cfg_scale
        )
        reward = float(self.context.score(self.reward, self.context.decode(latents), batch).mean())
        return {"loss": -reward, "reward": reward}
