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

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, ClassVar

import torch

from qie.data.images import rgb
from qie.errors import ConfigError, DataError
from qie.evaluation.reward import needed_arguments, reward_value
from qie.evaluation.scoring import Row
from qie.models.sampling import PromptInputs, initial_noise
from qie.training.flow_sde import SdeRun, clipped_loss, group_advantages, unwrapped
from qie.training.objectives import ObjectiveInputs, ObjectiveUse, StepMeans
from qie.training.objectives.distill import sample_inputs
from qie.training.objectives.dpo import Reference
from qie.types import Batch

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
        inputs: the family (its `denoise` and `decode`), the scheduler, the decoder (it `ScoresOwnResults`) and
            `sample_rows` (a sample id's row for the reward: prompt, controls, target), `build_reward` (the reward
            of the `reward` node).
        group_size, ...: the settings (`GrpoSettings`, `conf/train/objective/grpo.yaml`).
    """

    requires: ClassVar[frozenset[str]] = frozenset({"empty_prompt"})  # no target; CFG's negative when asked

    def __init__(
        self,
        inputs: ObjectiveInputs,
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
        if inputs.scheduler is None or inputs.decoder is None:
            raise ValueError(f"train/objective={NAME} needs the model's scheduler and decoder (ObjectiveInputs)")
        self.family, self.scheduler, self.decoder = inputs.family, inputs.scheduler, inputs.decoder
        self.pipeline_config = dict(inputs.pipeline_config or {})
        self.rows: Callable[[str, tuple[int, int], Collection[str]], Row] | None = inputs.sample_rows
        if inputs.build_reward is None:
            raise ValueError(f"train/objective={NAME} needs a reward builder (ObjectiveInputs.build_reward)")
        self.reward = inputs.build_reward(s.reward)
        self.reference = Reference(s.reference_lora, objective=NAME)
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
        self.reference.prepare(transformer)

    def _inputs(self, batch: Batch, i: int, copies: int) -> tuple[PromptInputs, PromptInputs | None, list]:
        prompt, negative, controls = sample_inputs(batch, i)

        def repeated(p: PromptInputs) -> PromptInputs:
            image_mask = None if p.image_mask is None else p.image_mask.expand(copies, -1)
            return PromptInputs(p.embeds.expand(copies, -1, -1), None, image_mask)

        cfg = self.settings.true_cfg_scale > 1
        return (
            repeated(prompt),
            (repeated(negative) if cfg else None),
            [c.expand(copies, -1, -1, -1, -1) for c in controls],
        )

    def _denoise(self, model: Any, scheduler: Any, noise: torch.Tensor, inputs: tuple) -> torch.Tensor:
        """The family's loop over `inputs` (prompt, negative, controls) from `noise`, at the rollouts' settings."""
        prompt, negative, controls = inputs
        steps, scale = int(self.settings.sampling_steps), float(self.settings.true_cfg_scale)
        return self.family.denoise(
            model, scheduler, noise, prompt, negative, controls, steps, scale, False, self.pipeline_config
        )

    def _run(self, model: Any, run: SdeRun, noise: torch.Tensor, inputs: tuple) -> torch.Tensor:
        """`run` through the family's loop: a rollout calls the module itself (no gradient: a data-parallel wrapper
        has nothing to do), a replay calls it as `SdeRun.skipping` says."""
        caller = run.skipping(model) if run.mode == "replay" else unwrapped(model)
        return self._denoise(caller, run.scheduler(self.scheduler), noise, inputs)

    def _rewards(self, batch: Batch, i: int, latents: torch.Tensor) -> torch.Tensor:
        """The group's rewards (higher is better) of its final latents."""
        images = rgb(self.family.decode(self.decoder, latents, "pt").float().clamp(0, 1))
        n, size = latents.shape[0], (images.shape[-1], images.shape[-2])
        if self.rows is not None:
            row = self.rows(batch.ids[i], size, self.reward.needs)  # the target and region only where needed
        else:  # the controls as their latents decode
            decoded = [self.family.decode(self.decoder, c[i : i + 1], "pt")[0].float() for c in batch.control_latents]
            row = Row(batch.ids[i], "", None, decoded)
        needed = needed_arguments(self.reward, *self._references(row, n))
        scores = self.reward(images, [[rgb(c) for c in row.controls]] * n, [row.prompt] * n, **needed)
        return reward_value(self.reward, torch.as_tensor(scores, dtype=torch.float64).reshape(n))

    def _references(self, row: Row, n: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The row's target and edit region for each of its `n` edits, where the reward needs them.

        Raises:
            DataError: the reward needs what the row lacks (a row without a target).
        """
        have = {"target": row.target, "mask": row.region}
        missing = [{"mask": "edit region"}.get(k, k) for k in sorted(self.reward.needs) if have.get(k) is None]
        if missing:
            raise DataError(
                f"sample {row.id!r} has no {' or '.join(missing)}, which train.objective.reward "
                f"({type(self.reward).__name__}) compares each edit with: give it rows with targets, or choose a "
                "reward that reads the edit, its controls and its prompt"
            )
        targets = None if row.target is None else rgb(row.target)[None].expand(n, -1, -1, -1)
        masks = None if row.region is None else row.region[None].expand(n, -1, -1)
        return targets, masks

    def rollout(
        self, model: Any, batch: Batch, i: int, generator: torch.Generator, noisy: list[int] | None = None
    ) -> tuple[SdeRun, torch.Tensor]:
        """Sample `i`'s group of edits under `model` (no gradient), with noise in the steps `noisy` (None: all):
        the recorded run and the rewards."""
        g = int(self.settings.group_size)
        inputs = self._inputs(batch, i, g)
        shape, device = batch.latents.shape[1:], batch.latents.device
        starts = 1 if self.settings.shared_start else g
        noise = initial_noise((starts, *shape), generator, device, batch.prompt_embeds.dtype).expand(g, *shape)
        run = SdeRun("rollout", self.settings.noise_level, generator, noisy=noisy)
        run.start = noise  # where a replay starts
        with torch.no_grad():
            latents = self._run(model, run, noise, inputs)
        return run, self._rewards(batch, i, latents)

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
        inputs, noise = self._inputs(batch, i, s.group_size), rollout.start
        policy = SdeRun("replay", s.noise_level, states=rollout.states, chosen=chosen)
        self._run(model, policy, noise, inputs)
        reference = SdeRun("replay", s.noise_level, states=rollout.states, chosen=chosen)
        with torch.no_grad(), self.reference.active():
            self._run(unwrapped(model), reference, noise, inputs)
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
        rewards = []
        for i in range(len(batch.ids)):
            latents = self._denoise(model, self.scheduler, noise[i : i + 1], self._inputs(batch, i, 1))
            rewards.append(self._rewards(batch, i, latents))
        reward = float(torch.cat(rewards).mean())
        return {"loss": -reward, "reward": reward}
