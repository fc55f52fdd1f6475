"""Flow-GRPO's stochastic sampling over a family's own denoising loop: the loop's ODE step replaced by an SDE step
with the same marginals, whose Gaussian log-probability of the step taken is what the policy gradient needs.

With the scheduler's noise levels sigma_i (1 at the start, 0 at the end), dt = sigma_{i+1} - sigma_i < 0 and the
velocity v predicted at x_i, the step is (Flow-GRPO, Liu et al. 2025, eq. 9)

    s_i = noise_level * sqrt(sigma_i / (1 - sigma_i))          (sigma_i = 1 taken as sigma_1)
    mean = x_i (1 + s_i^2 dt / (2 sigma_i)) + v (1 + s_i^2 (1 - sigma_i) / (2 sigma_i)) dt
    x_{i+1} = mean + s_i sqrt(-dt) eps,   eps ~ N(0, I)

and its log-probability the mean over the latent's elements of the Gaussian log-density of x_{i+1}.

The loop is the family's (`ModelFamily.denoise`): `SdeRun` gives it a scheduler whose `step` is this step. A
rollout (`mode="rollout"`) draws eps from a generator and records every state and log-probability; a replay
(`mode="replay"`) walks the recorded states again, runs the model only at the chosen steps (elsewhere `skipping`
answers zeros, which the replayed step ignores) and gives the log-probability, under the model now, of the recorded
step and its mean. A rollout whose first steps are the same for a whole group (one starting noise, the ODE's step
before the first noisy one) may take them once for one edit and `broadcast` them to the group before going on.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch


def sde_std(sigma: torch.Tensor, sigma_max: torch.Tensor, noise_level: float) -> torch.Tensor:
    """s_i of the module's text: noise_level * sqrt(sigma / (1 - sigma)), sigma = 1 taken as `sigma_max`."""
    safe = torch.where(sigma >= 1, sigma_max, sigma)
    return noise_level * torch.sqrt(sigma / (1 - safe))


def sde_mean(
    sample: torch.Tensor, velocity: torch.Tensor, sigma: torch.Tensor, sigma_next: torch.Tensor, std: torch.Tensor
) -> torch.Tensor:
    """The mean of x_{i+1} given x_i = `sample` and the velocity (float32)."""
    dt = sigma_next - sigma
    sample, velocity = sample.float(), velocity.float()
    return sample * (1 + std**2 / (2 * sigma) * dt) + velocity * (1 + std**2 * (1 - sigma) / (2 * sigma)) * dt


def gaussian_log_prob(value: torch.Tensor, mean: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The mean over all but the first dimension of the elementwise log-density of N(mean, scale^2) at `value`."""
    value, mean = value.float(), mean.float()
    log_density = -((value - mean) ** 2) / (2 * scale**2) - torch.log(scale) - 0.5 * math.log(2 * math.pi)
    return log_density.flatten(1).mean(1)


class SdeRun:
    """One pass of the family's loop with the SDE step (see the module's text).

    Args:
        mode: "rollout" (draw the noise from `generator`, record) or "replay" (walk `states`).
        noise_level: Flow-GRPO's a.
        generator: a CPU generator; the rollout's step noise comes from it.
        states: a replay's recorded states x_0 .. x_N (each (B, ...) as the loop holds them).
        chosen: the steps a replay runs the model at.
        noisy: the steps a rollout draws noise at (an SDE step); elsewhere it takes the ODE's step (Euler, as the
            family's scheduler), which records no log-probability. None: every step.
    """

    def __init__(
        self,
        mode: str,
        noise_level: float,
        generator: torch.Generator | None = None,
        states: Sequence[torch.Tensor] = (),
        chosen: Sequence[int] = (),
        noisy: Sequence[int] | None = None,
    ) -> None:
        self.mode, self.noise_level, self.generator = mode, float(noise_level), generator
        self.states, self.chosen = list(states), set(int(c) for c in chosen)
        self.noisy = None if noisy is None else set(int(n) for n in noisy)
        self.index = 0
        self.start: torch.Tensor | None = None  # the loop's starting noise (its layout, not the steps')
        self.log_probs: dict[int, torch.Tensor] = {}  # step -> (B,) log-probability of the step taken
        self.means: dict[int, torch.Tensor] = {}  # step -> mean of x_{i+1} (replay)
        self.scales: dict[int, torch.Tensor] = {}  # step -> s_i sqrt(-dt)

    def scheduler(self, base: Any) -> Any:
        """A scheduler of `base`'s class and config whose `step` is this run's; the family's loop makes its own
        copy from it (`type(s).from_config(s.config)`), which steps through this run too."""
        run = self

        def step(
            self: Any,
            model_output: torch.Tensor,
            timestep: Any,
            sample: torch.Tensor,
            *args: Any,
            return_dict: bool = True,
            **kwargs: Any,
        ) -> tuple[torch.Tensor]:
            return (run.step(self.sigmas, model_output, sample),)

        cls = type(f"Sde{type(base).__name__}", (type(base),), {"step": step})
        return cls.from_config(base.config)

    def step(self, sigmas: torch.Tensor, velocity: torch.Tensor, sample: torch.Tensor) -> torch.Tensor:
        i = self.index
        self.index += 1
        sigma, sigma_next = (sigmas[i].float().to(sample.device), sigmas[i + 1].float().to(sample.device))
        if self.mode == "replay" and i not in self.chosen:
            return self.states[i + 1]
        std = sde_std(sigma, sigmas[1].float().to(sample.device), self.noise_level)
        scale = std * torch.sqrt(sigma - sigma_next)
        mean = sde_mean(sample, velocity, sigma, sigma_next, std)
        if self.mode == "replay":
            taken = self.states[i + 1]
            self.means[i], self.scales[i] = mean, scale
            self.log_probs[i] = gaussian_log_prob(taken, mean, scale)
            return taken
        if i == 0:
            self.states = [sample.detach()]
        if self.noisy is not None and i not in self.noisy:
            taken = (sample.float() + velocity.float() * (sigma_next - sigma)).to(sample.dtype)
            self.states.append(taken.detach())
            return taken
        eps = torch.randn(sample.shape, generator=self.generator, dtype=torch.float32).to(sample.device)
        taken = (mean + scale * eps).to(sample.dtype)
        self.states.append(taken.detach())
        self.log_probs[i], self.scales[i] = gaussian_log_prob(taken, mean, scale).detach(), scale
        return taken

    def broadcast(self, copies: int) -> None:
        """Repeat the states recorded so far (one edit's) for `copies` edits: a group's shared first steps."""
        self.states = [s.expand(copies, *s.shape[1:]) for s in self.states]

    def skipping(self, model: Any) -> Any:
        """`model` as a replay calls it: run at the chosen steps alone; elsewhere zeros shaped as its input. Its
        attributes are the model's (a loop reads its config). A loop that keeps what the model computes at its first
        call (Qwen-Image-2.1's key/value cache of its condition) keeps it from the first chosen step.

        Where `model` is a data-parallel wrapper, the first chosen step's call goes through it and the others through
        the module it wraps: one wrapper call per replay on every process, however many steps each draws, so the
        wrapper's per-call exchanges match across processes, and the backward pass still averages the gradients."""
        run, inner, first = self, unwrapped(model), min(self.chosen, default=None)

        class Skipping:
            def __call__(self, *args: Any, hidden_states: torch.Tensor, **kwargs: Any) -> tuple[torch.Tensor]:
                if run.index == first:
                    return model(*args, hidden_states=hidden_states, **kwargs)
                if run.index in run.chosen:
                    return inner(*args, hidden_states=hidden_states, **kwargs)
                return (torch.zeros_like(hidden_states),)

            def __getattr__(self, name: str) -> Any:
                return getattr(inner, name)

        return Skipping()


def unwrapped(model: Any) -> Any:
    """The module inside a data-parallel wrapper (its `.module`), else `model`."""
    inner = getattr(model, "module", None)
    return inner if isinstance(inner, torch.nn.Module) else model


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-4) -> torch.Tensor:
    """Each reward normalised within its group of `group_size` consecutive ones: (r - mean) / (std + eps)."""
    groups = rewards.double().reshape(-1, int(group_size))
    mean, std = groups.mean(1, keepdim=True), groups.std(1, unbiased=False, keepdim=True)
    return ((groups - mean) / (std + eps)).reshape(-1).float()


def clipped_loss(
    advantages: torch.Tensor, log_probs: torch.Tensor, old_log_probs: torch.Tensor, clip_range: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped policy-gradient loss over (B, steps) log-probabilities and (B,) advantages, and the share of
    ratios clipped."""
    ratio = torch.exp(log_probs - old_log_probs)
    adv = advantages[:, None].to(ratio.dtype)
    unclipped, clipped = -adv * ratio, -adv * torch.clamp(ratio, 1 - clip_range, 1 + clip_range)
    fraction = ((ratio - 1).abs() > clip_range).float().mean()
    return torch.maximum(unclipped, clipped).mean(), fraction.detach()


__all__ = [
    "SdeRun",
    "clipped_loss",
    "gaussian_log_prob",
    "group_advantages",
    "sde_mean",
    "sde_std",
    "unwrapped",
]
