"""Online reinforcement learning of edits: Flow-GRPO (`train/objective=grpo`, `conf/train/objective/grpo.yaml`).

Each step, for each sample of the batch, `train_timesteps` of the `sampling_steps` denoising steps are drawn, and
the policy (the base with the trained adapter) samples `group_size` edits from the sample's cached prompt and
control embeddings through the family's own sampling loop with its ODE step made an SDE at the drawn steps
(`qie.training.flow_sde`, noise `noise_level`; with `noisy_steps=all` at every step, as Flow-GRPO samples),
recording each SDE step's log-probability. With `shared_start` the group starts from one noise, so its edits differ
only by the drawn steps' noise: a group's spread of rewards is what those steps did. The final latents are decoded
(the VAE's decoder) to images in [0, 1] and scored by the reward (`qie.extend.Reward`, higher is better after
`reward_value`); each reward is normalised within its group ((r - mean) / (std + eps)): the advantage. Then the
drawn steps are replayed with the gradient:

    ratio = exp(log p_new(step) - log p_rollout(step))
    loss = mean(max(-A ratio, -A clip(ratio, 1 - clip_range, 1 + clip_range))) + kl_weight * KL

with KL that of the step's Gaussian under the policy to the one under the reference (the base with the adapter
turned off: `dpo.Reference`; or with `reference_lora` instead: a run that goes on from `train.init_lora` names the
same file, so the KL keeps the policy near its start), (mean - mean_ref)^2 / (2 scale^2) averaged over the latent.
One optimisation per rollout: the ratio is 1 and the policy-gradient term is -A (its gradient A d log p), as in
Flow-GRPO. Every draw (the starting noise, the steps' noise, the chosen steps) comes from the batch's generator.

Logged: `reward_mean`, `reward_std` (within groups), `reward_best` (the groups' mean best), `kl`, `clip_fraction`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from qie.errors import ConfigError
from qie.models.sampling import initial_noise
from qie.training.flow_sde import SdeRun, clipped_loss, group_advantages, unwrapped
from qie.training.objectives import ObjectiveUse, StepMeans
from qie.types import Batch

if TYPE_CHECKING:
    from qie.training.objectives.context import ObjectiveContext

NAME = "grpo"
NOISY_STEPS = ("all", "trained")


@dataclass(frozen=True)
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

    @classmethod
    def of(cls, options: Mapping[str, Any] | None) -> GrpoSettings:
        """The settings of `options` (plain values), checked."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in dict(options or {}).items() if k in known}).checked()

    def checked(self) -> GrpoSettings:
        """These settings, or ConfigError (one line) for one out of range or a missing reward."""
        s = self
        checks = [
            ("group_size", s.group_size >= 2, "give 2 or more (advantages compare edits within a group)"),
            ("sampling_steps", s.sampling_steps >= 1, "give 1 or more"),
            (
                "train_timesteps",
                1 <= s.train_timesteps <= s.sampling_steps,
                f"give 1 to sampling_steps ({s.sampling_steps})",
            ),
            ("noise_level", s.noise_level > 0, "give a value above 0 (e.g. 0.7)"),
            ("clip_range", s.clip_range > 0, "give a value above 0 (e.g. 1e-4)"),
            ("kl_weight", s.kl_weight >= 0, "give 0 or more (e.g. 0.04)"),
            ("true_cfg_scale", s.true_cfg_scale >= 1, "give 1 (no CFG) or more"),
            ("noisy_steps", s.noisy_steps in NOISY_STEPS, f"give one of {', '.join(NOISY_STEPS)}"),
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
    ) -> None:
        self.settings = s = GrpoSettings(
            group_size,
            sampling_steps,
            noise_level,
            clip_range,
            kl_weight,
            train_timesteps,
            true_cfg_scale,
            reward,
            reference_lora,
            noisy_steps,
            bool(shared_start),
        ).checked()
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

    def _sample(self, model: Any, batch: Batch, noise: torch.Tensor, scheduler: Any = None) -> torch.Tensor:
        """`batch`'s edits through the family's loop from `noise` (its samples' groups, sample-major), at the
        rollouts' settings; `scheduler` replaces the model's (an SDE run's)."""
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
        )

    def _run(self, model: Any, run: SdeRun, batch: Batch, noise: torch.Tensor) -> torch.Tensor:
        """`run` through the family's loop: a rollout calls the module itself (no gradient: a data-parallel wrapper
        has nothing to do), a replay calls it as `SdeRun.skipping` says."""
        caller = run.skipping(model) if run.mode == "replay" else unwrapped(model)
        return self._sample(caller, batch, noise, run.scheduler(self.context.scheduler))

    def _rewards(self, batch: Batch, latents: torch.Tensor) -> torch.Tensor:
        """The rewards (higher is better) of the final latents of each of `batch`'s samples' edits."""
        copies = latents.shape[0] // len(batch.ids)
        return self.context.score(self.reward, self.context.decode(latents), batch, copies)

    def rollout(
        self, model: Any, batch: Batch, i: int, generator: torch.Generator, noisy: list[int] | None = None
    ) -> tuple[SdeRun, torch.Tensor]:
        """Sample `i`'s group of edits under `model` (no gradient), with noise in the steps `noisy` (None: all):
        the recorded run and the rewards."""
        g, one = int(self.settings.group_size), batch.take([i])
        shape, device = batch.latents.shape[1:], batch.latents.device
        starts = 1 if self.settings.shared_start else g
        noise = initial_noise((starts, *shape), generator, device, batch.prompt_embeds.dtype).expand(g, *shape)
        run = SdeRun("rollout", self.settings.noise_level, generator, noisy=noisy)
        run.start = noise  # where a replay starts
        with torch.no_grad():
            latents = self._run(model, run, one, noise)
        return run, self._rewards(one, latents)

    def _chosen(self, generator: torch.Generator) -> list[int]:
        """The steps of one sample's rollouts that get a gradient, drawn at random."""
        s = self.settings
        return sorted(torch.randperm(int(s.sampling_steps), generator=generator)[: int(s.train_timesteps)].tolist())

    def _sample_loss(self, model: Any, batch: Batch, i: int, generator: torch.Generator) -> torch.Tensor:
        s = self.settings
        if s.noisy_steps == "trained":  # the steps with noise are chosen first: the rollout needs them
            chosen = self._chosen(generator)
            rollout, rewards = self.rollout(model, batch, i, generator, noisy=chosen)
        else:
            rollout, rewards = self.rollout(model, batch, i, generator)
            chosen = self._chosen(generator)
        advantages = group_advantages(rewards, s.group_size).to(batch.latents.device)
        one, noise = batch.take([i]), rollout.start
        policy = SdeRun("replay", s.noise_level, states=rollout.states, chosen=chosen)
        self._run(model, policy, one, noise)
        reference = SdeRun("replay", s.noise_level, states=rollout.states, chosen=chosen)
        with torch.no_grad(), self.reference.active():
            self._run(unwrapped(model), reference, one, noise)
        new = torch.stack([policy.log_probs[c] for c in chosen], 1)
        old = torch.stack([rollout.log_probs[c] for c in chosen], 1)
        pg, clipped = clipped_loss(advantages, new, old, float(s.clip_range))
        kl = torch.stack(
            [
                ((policy.means[c] - reference.means[c]) ** 2).flatten(1).mean(1) / (2 * policy.scales[c] ** 2)
                for c in chosen
            ]
        ).mean()
        groups = rewards.reshape(-1, s.group_size)
        self.means.add(
            reward_mean=rewards.mean(),
            reward_std=groups.std(1, unbiased=False).mean(),
            reward_best=groups.max(1).values.mean(),
            kl=kl.detach(),
            clip_fraction=clipped,
        )
        return pg + s.kl_weight * kl

    def loss(self, model: torch.nn.Module, batch: Batch, generator: torch.Generator) -> torch.Tensor:
        losses = [self._sample_loss(model, batch, i, generator) for i in range(len(batch.ids))]
        return torch.stack(losses).mean()

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
