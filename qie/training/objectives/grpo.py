"""Online reinforcement learning of edits: Flow-GRPO (`train/objective=grpo`, `conf/train/objective/grpo.yaml`).

Each step, for each sample of the batch, `train_timesteps` of the `sampling_steps` denoising steps are drawn (from
the steps `window` names, else from all), and the policy (the base with the trained adapter) samples `group_size`
edits from the sample's cached prompt and control embeddings through the family's own sampling loop with its ODE step
made an SDE at the drawn steps (`qie.training.flow_sde`, noise `noise_level`; with `noisy_steps=all` at every step, as
Flow-GRPO samples), recording each SDE step's log-probability. With `shared_start` the group starts from one noise,
so its edits differ only by the drawn steps' noise: a group's spread of rewards is what those steps did, and
(`shared_prefix`) the steps before the first drawn one, the same for the whole group, are taken once. Rollouts are
sampled at `rollout_pixels` where set (a smaller area costs less; the reward scores them at that size). The final
latents are decoded (the VAE's decoder) to images in [0, 1] and scored by the reward (`qie.extend.Reward`, higher is
better after `reward_value`), each group while the next one samples (`overlap_rewards`); each reward is normalised
within its group ((r - mean) / (std + eps)): the advantage. Then the drawn steps are replayed with the gradient:

    ratio = exp(log p_new(step) - log p_rollout(step))
    loss = mean(max(-A ratio, -A clip(ratio, 1 - clip_range, 1 + clip_range))) + kl_weight * KL

with KL that of the step's Gaussian under the policy to the one under the reference (the base with the adapter
turned off; or with `reference_lora` instead: a run that goes on from `train.init_lora` names the same file, so the
KL keeps the policy near its start), (mean - mean_ref)^2 / (2 scale^2) averaged over the latent. One optimisation per
rollout: the ratio is 1 and the policy-gradient term is -A (its gradient A d log p), as in Flow-GRPO. Every draw (the
starting noise, the steps' noise, the chosen steps) comes from the batch's generator.

Logged: `reward_mean`, `reward_std` (within groups), `reward_best` (the groups' mean best), `kl`, `clip_fraction`,
`rollout_seconds`, `reward_seconds` and `rewards_per_second` (`qie.training.objectives.rollouts`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from qie.errors import ConfigError
from qie.models.sampling import initial_noise
from qie.training.flow_sde import SdeRun, clipped_loss, group_advantages, unwrapped
from qie.training.objectives import ObjectiveUse, StepMeans
from qie.training.objectives.rollouts import Scoring, rollout_shape
from qie.types import Batch

if TYPE_CHECKING:
    from qie.training.objectives.context import ObjectiveContext

NAME = "grpo"
NOISY_STEPS = ("all", "trained")


@dataclass(frozen=True, kw_only=True)
class GrpoSettings:
    """The objective's settings (`conf/train/objective/grpo.yaml`)."""

    group_size: int = 4
    sampling_steps: int = 10
    noise_level: float = 0.7
    clip_range: float = 1e-4
    kl_weight: float = 0.04
    train_timesteps: int = 2
    true_cfg_scale: float = 1.0
    reward: Any = None  # a {_target_: ..., keys} node
    reference_lora: str | None = None  # a LoRA file as the reference (else the base with the adapter off)
    noisy_steps: str = "trained"  # "trained": only the trained steps are SDE steps (ODE elsewhere); "all": every one
    shared_start: bool = True  # a group's edits start from one noise
    shared_prefix: bool = True  # ... and the steps before the first noisy one are taken once for the group
    window: tuple[int, int] | None = None  # the steps (first, last + 1) the trained steps are drawn from; None: all
    rollout_pixels: int | None = None  # the rollouts' area in pixels; None: the batch's
    overlap_rewards: bool = True  # each group scored while the next one samples

    @classmethod
    def of(cls, options: Mapping[str, Any] | None) -> GrpoSettings:
        """The settings of `options` (plain values), checked."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in dict(options or {}).items() if k in known}).checked()

    def span(self) -> tuple[int, int]:
        """The steps (first, last + 1) the trained steps are drawn from."""
        return (int(self.window[0]), int(self.window[1])) if self.window is not None else (0, int(self.sampling_steps))

    def checked(self) -> GrpoSettings:
        """These settings, or ConfigError (one line) for one out of range or a missing reward."""
        s = self
        first, last = s.span() if s.window is None or len(s.window) == 2 else (0, -1)
        checks = [
            ("group_size", s.group_size >= 2, "give 2 or more (advantages compare edits within a group)"),
            (
                "sampling_steps",
                s.sampling_steps >= 2,
                "give 2 or more (one step's sigmas are NaN once the scheduler stretches its shift to shift_terminal)",
            ),
            ("window", 0 <= first < last <= s.sampling_steps, f"give [first, last] within 0..{s.sampling_steps}"),
            (
                "train_timesteps",
                1 <= s.train_timesteps <= last - first,
                f"give 1 to the steps it is drawn from ({last - first})",
            ),
            ("noise_level", s.noise_level > 0, "give a value above 0 (e.g. 0.7)"),
            ("clip_range", s.clip_range > 0, "give a value above 0 (e.g. 1e-4)"),
            ("kl_weight", s.kl_weight >= 0, "give 0 or more (e.g. 0.04)"),
            ("true_cfg_scale", s.true_cfg_scale >= 1, "give 1 (no CFG) or more"),
            ("noisy_steps", s.noisy_steps in NOISY_STEPS, f"give one of {', '.join(NOISY_STEPS)}"),
            ("rollout_pixels", s.rollout_pixels is None or s.rollout_pixels >= 256, "give 256 or more, or null"),
        ]
        for name, ok, hint in checks:
            if not ok:  # NaN fails every comparison
                raise ConfigError(f"train.objective.{name}={getattr(s, name)} is out of range: {hint}")
        if s.reference_lora and not Path(s.reference_lora).exists():
            raise ConfigError(
                f"train.objective.reference_lora={s.reference_lora!r} does not exist: give a LoRA file or folder "
                "(e.g. train.init_lora's), or leave it unset to use the base model as the reference"
            )
        if s.reward is None:
            raise ConfigError(
                f"train/objective={NAME} needs a reward: set train.objective.reward._target_ (e.g. "
                "qie.demo.reward.RecolourReward, or a qie.extend.Reward of your own)"
            )
        return s


@dataclass
class Rollout:
    """One sample's group of edits as sampled: the recorded SDE run, the steps that get a gradient and the
    rewards to come (`Scoring`)."""

    run: SdeRun
    chosen: list[int]
    rewards: Future


class Grpo:
    """The Flow-GRPO objective (see the module's text).

    Args:
        context: the family's sampling loop and the model's scheduler (`sample`), the decoder (`decode`), the rows
            and the reward of the `reward` setting (`reward`, `score`), the reference model (`reference`).
        group_size, ...: the settings (`GrpoSettings`, `conf/train/objective/grpo.yaml`).
    """

    requires: ClassVar[frozenset[str]] = frozenset({"empty_prompt"})  # no target; CFG's negative when asked

    def __init__(
        self,
        context: ObjectiveContext,
        *,
        group_size: int = 4,
        sampling_steps: int = 10,
        noise_level: float = 0.7,
        clip_range: float = 1e-4,
        kl_weight: float = 0.04,
        train_timesteps: int = 2,
        true_cfg_scale: float = 1.0,
        reward: Any = None,
        reference_lora: str | None = None,
        noisy_steps: str = "trained",
        shared_start: bool = True,
        shared_prefix: bool = True,
        window: tuple[int, int] | None = None,
        rollout_pixels: int | None = None,
        overlap_rewards: bool = True,
    ) -> None:
        settings = {k: v for k, v in locals().items() if k not in ("self", "context")}
        self.settings = s = GrpoSettings(**settings).checked()
        self.context = context
        self.reward = context.reward(s.reward)
        self.reference = context.reference(s.reference_lora)
        self.means = StepMeans()

    @classmethod
    def use_problem(cls, use: ObjectiveUse) -> str | None:
        if not use.lora:
            return (
                f"train/objective={NAME} needs train.mode=lora: its reference is the base model with the "
                "adapter turned off, which training the whole transformer does not keep"
            )
        if use.family.outputs.layers:
            return (
                f"train/objective={NAME} does not train a layered model: its rewards score one image per edit; "
                "use train/objective=flow_matching"
            )
        if use.regularization:
            return (
                f"train/objective={NAME} does not mix in data.regularization (its batches are rollouts, not "
                "targets): remove data.regularization.path"
            )
        if use.caption_dropout > 0:
            return (
                f"train/objective={NAME} scores each edit against its sample's instruction, which "
                f"data.caption_dropout_rate={use.caption_dropout} would hide from the model that samples it: "
                "set data.caption_dropout_rate=0"
            )
        GrpoSettings.of(use.options)
        return None

    def prepare(self, transformer: torch.nn.Module) -> None:
        pass  # the reference is the context's

    def _sample(
        self, model: Any, batch: Batch, noise: torch.Tensor, scheduler: Any = None, span: tuple | None = None
    ) -> torch.Tensor:
        """`batch`'s edits through the family's loop from `noise` (its samples' groups, sample-major), at the
        rollouts' settings; `scheduler` replaces the model's (an SDE run's); `span` runs those steps alone."""
        s = self.settings
        copies = noise.shape[0] // len(batch.ids)
        return self.context.sample(
            model,
            batch,
            noise=noise,
            steps=s.sampling_steps,
            copies=copies,
            true_cfg_scale=s.true_cfg_scale,
            scheduler=scheduler,
            span=span,
        )

    def _run(self, model: Any, run: SdeRun, batch: Batch, noise: torch.Tensor, span: tuple | None = None) -> Any:
        """`run` through the family's loop: a rollout calls the module itself (no gradient: a data-parallel wrapper
        has nothing to do), a replay calls it as `SdeRun.skipping` says."""
        caller = run.skipping(model) if run.mode == "replay" else unwrapped(model)
        return self._sample(caller, batch, noise, run.scheduler(self.context.scheduler), span)

    def _rewards(self, batch: Batch, latents: torch.Tensor) -> torch.Tensor:
        """The rewards (higher is better) of the final latents of each of `batch`'s samples' edits."""
        with Scoring(self.context, self.reward, overlap=False) as scoring:
            return scoring.submit(batch, latents).result()

    def _chosen(self, generator: torch.Generator) -> list[int]:
        """The steps of one sample's rollouts that get a gradient, drawn at random (from `window` where set)."""
        first, last = self.settings.span()
        drawn = torch.randperm(last - first, generator=generator)[: int(self.settings.train_timesteps)]
        return sorted((drawn + first).tolist())

    def _rollout(self, model: Any, batch: Batch, i: int, generator: torch.Generator, scoring: Scoring) -> Rollout:
        """Sample `i`'s group of edits under `model` (no gradient) and hand them to `scoring`; with noise at the
        trained steps alone, those are drawn first (the rollout needs them)."""
        s = self.settings
        chosen = self._chosen(generator) if s.noisy_steps == "trained" else None
        g, one = int(s.group_size), batch.take([i])
        shape = rollout_shape(self.context, batch, s.rollout_pixels)
        starts = 1 if s.shared_start else g
        noise = initial_noise((starts, *shape), generator, batch.latents.device, batch.prompt_embeds.dtype)
        noise = noise.expand(g, *shape)
        run = SdeRun("rollout", s.noise_level, generator, noisy=chosen)
        run.start = noise  # where a replay starts
        first = min(chosen) if chosen and s.shared_start and s.shared_prefix else 0
        started = time.perf_counter()
        with torch.no_grad():
            start = noise
            if first > 0:  # the group's steps before the first noisy one: one edit's, for all
                start = self._run(model, run, one, noise[:1], (0, first)).expand(g, *shape)
                run.broadcast(g)
            latents = self._run(model, run, one, start, (first, None))
        scoring.sampled(time.perf_counter() - started)
        rewards = scoring.submit(one, latents)
        return Rollout(run, chosen if chosen is not None else self._chosen(generator), rewards)

    def rollout(
        self, model: Any, batch: Batch, i: int, generator: torch.Generator, noisy: list[int] | None = None
    ) -> tuple[SdeRun, torch.Tensor]:
        """Sample `i`'s group of edits under `model` (no gradient), with noise in the steps `noisy` (None: all):
        the recorded run and the rewards."""
        s = self.settings
        g, one = int(s.group_size), batch.take([i])
        shape = rollout_shape(self.context, batch, s.rollout_pixels)
        starts = 1 if s.shared_start else g
        noise = initial_noise((starts, *shape), generator, batch.latents.device, batch.prompt_embeds.dtype)
        run = SdeRun("rollout", s.noise_level, generator, noisy=noisy)
        run.start = noise.expand(g, *shape)
        with torch.no_grad():
            latents = self._run(model, run, one, run.start)
        return run, self._rewards(one, latents)

    def _replay(self, model: Any, batch: Batch, i: int, rollout: Rollout) -> tuple[torch.Tensor, dict]:
        """Sample `i`'s loss from its rollout: the trained steps replayed under the policy and the reference."""
        s, chosen = self.settings, rollout.chosen
        rewards = rollout.rewards.result()
        advantages = group_advantages(rewards, s.group_size).to(batch.latents.device)
        one, noise, states = batch.take([i]), rollout.run.start, rollout.run.states
        policy = SdeRun("replay", s.noise_level, states=states, chosen=chosen)
        self._run(model, policy, one, noise)
        reference = SdeRun("replay", s.noise_level, states=states, chosen=chosen)
        with torch.no_grad(), self.reference.active():
            self._run(unwrapped(model), reference, one, noise)
        new = torch.stack([policy.log_probs[c] for c in chosen], 1)
        old = torch.stack([rollout.run.log_probs[c] for c in chosen], 1)
        pg, clipped = clipped_loss(advantages, new, old, float(s.clip_range))
        kl = torch.stack(
            [
                ((policy.means[c] - reference.means[c]) ** 2).flatten(1).mean(1) / (2 * policy.scales[c] ** 2)
                for c in chosen
            ]
        ).mean()
        groups = rewards.reshape(-1, s.group_size)
        measures = {
            "reward_mean": float(rewards.mean()),
            "reward_std": float(groups.std(1, unbiased=False).mean()),
            "reward_best": float(groups.max(1).values.mean()),
            "kl": float(kl.detach()),
            "clip_fraction": float(clipped),
        }
        return pg + s.kl_weight * kl, measures

    def loss(self, model: torch.nn.Module, batch: Batch, generator: torch.Generator) -> torch.Tensor:
        """Every sample's group rolled out first (each scored while the next samples), then replayed."""
        with Scoring(self.context, self.reward, self.settings.overlap_rewards) as scoring:
            rollouts = [self._rollout(model, batch, i, generator, scoring) for i in range(len(batch.ids))]
            losses, measures = zip(*(self._replay(model, batch, i, r) for i, r in enumerate(rollouts)), strict=True)
        means = {k: sum(m[k] for m in measures) / len(measures) for k in measures[0]}
        self.means.add(**means, **scoring.measures())
        return torch.stack(list(losses)).mean()

    def step_metrics(self) -> dict[str, float]:
        return self.means.pop()

    @torch.no_grad()
    def evaluate(
        self, model: torch.nn.Module, batch: Batch, noise: torch.Tensor, sigmas: torch.Tensor
    ) -> dict[str, float]:
        """The reward of each sample's edit sampled without noise in its steps (the family's ODE loop) from
        `noise`; "loss" is its negative (lower is better, as every objective's). `sigmas` is not used."""
        rewards = self._rewards(batch, self._sample(model, batch, noise))
        reward = float(rewards.mean())
        return {"loss": -reward, "reward": reward}
