"""How images are sampled: one set of options for inference and validation, and the true-CFG rule.

Each model family's denoising loop (`ModelFamily.sample`) starts from already-encoded inputs (prompt
embeddings, normalised control latents, possibly none), so validation in cached mode can feed cached tensors;
inference, `Trainer.predict` and validation all call it with these options. A family's denoising from given
noise (`ModelFamily.denoise`) is the same loop with the noise drawn outside (`initial_noise`) and, for training
through the steps (distillation), a gradient: `denoise(checkpoint=True)` recomputes each step's prediction in the
backward pass instead of keeping its activations.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from qie.sampling_fields import SamplingFields

logger = logging.getLogger(__name__)


@dataclass(kw_only=True)
class SamplingOptions(SamplingFields):
    """How an image is sampled; one set of defaults for `python -m qie.infer`, `Trainer.predict` and
    validation (the `predict` config group fills it, `qie.stages.settings.sampling_options`; `validation.*` may
    override some fields). Its fields are the `predict` group's sampling fields (`SamplingFields`). It is not
    frozen (a frozen dataclass cannot share the fields of a schema, which OmegaConf needs writable): it is passed
    as a value and changed only through `dataclasses.replace`.

    The default negative prompt is the empty prompt: its embedding is what the cache stores for every
    sample, so validation runs classifier-free guidance from cached inputs. `None` turns CFG off.
    The CFG scale and the step count left None are the model's pipeline's own defaults (`resolved`).
    """

    @property
    def guidance(self) -> bool:
        """Whether true CFG runs with these options (diffusers' rule: a scale above 1 and a negative prompt)."""
        if self.true_cfg_scale is None:
            raise ValueError("SamplingOptions.true_cfg_scale is not resolved: call resolved(spec.call_defaults())")
        return true_cfg_enabled(self.true_cfg_scale, self.negative_prompt is not None, bool(self.negative_prompt))

    def resolved(self, defaults: Mapping[str, Any]) -> SamplingOptions:
        """These options, the fields left None taken from `defaults` (`ModelSpec.call_defaults()`)."""
        return replace(self, **{k: v for k, v in defaults.items() if getattr(self, k, 0) is None})


def true_cfg_enabled(true_cfg_scale: float, has_negative: bool, warn_unused_negative: bool = True) -> bool:
    """Whether true CFG runs: only with a scale above 1 *and* a negative prompt; warns as diffusers does
    (the warning for a negative prompt left unused can be turned off: the default empty one is no choice)."""
    if true_cfg_scale > 1 and not has_negative:
        logger.warning(
            f"true_cfg_scale is {true_cfg_scale}, but classifier-free guidance is not enabled since no "
            "negative prompt is given (set predict.negative_prompt, e.g. to ' ')"
        )
    elif true_cfg_scale <= 1 and has_negative and warn_unused_negative:
        logger.warning("a negative prompt is given, but classifier-free guidance is off since true_cfg_scale <= 1")
    return true_cfg_scale > 1 and has_negative


def latent_sizes(latents: Sequence[torch.Tensor], vae_scale: int) -> list[tuple[int, int]]:
    """(height, width) in pixels of images whose latents are (..., h, w)."""
    return [(vae_scale * int(x.shape[-2]), vae_scale * int(x.shape[-1])) for x in latents]


@dataclass(frozen=True)
class PromptInputs:
    """A batch of encoded prompts as the transformer takes them: embeddings (B, L, dim), their 1/0 mask (None when
    nothing is padded) and, for a transformer that places control latents in the prompt (Qwen-Image-2.1), the
    (B, L) bool image-slot mask."""

    embeds: torch.Tensor
    mask: torch.Tensor | None = None
    image_mask: torch.Tensor | None = None


def initial_noise(
    shape: Sequence[int], generator: torch.Generator | None, device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    """The starting noise of every family's sampler, in the latents' layout (B, C, F, h, w): drawn as the pipelines
    draw it, (B, F, C, h, w) from `generator` (on the generator's device, then moved)."""
    from diffusers.utils.torch_utils import randn_tensor

    b, c, f, h, w = (int(x) for x in shape)
    noise = randn_tensor((b, f, c, h, w), generator=generator, device=torch.device(device), dtype=dtype)
    return noise.transpose(1, 2).contiguous()


# A prediction of the transformer at step `i`, timestep `t`, for the current latents.
Prediction = Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]


def denoise(
    scheduler: Any,
    timesteps: torch.Tensor,
    latents: torch.Tensor,
    cond: Prediction,
    uncond: Prediction | None = None,
    scale: float = 1.0,
    rescale: bool = False,
    progress: bool = False,
    checkpoint: bool = False,
) -> torch.Tensor:
    """The denoising loop every family's sampler runs: at each timestep the conditional prediction, with true
    CFG (`uncond` given) `uncond + scale * (cond - uncond)`, with `rescale` brought back to the conditional
    prediction's norm token by token (Qwen-Image's rule; Layered and 2.1 do not rescale); then the scheduler's
    step. The scheduler must have its timesteps set (and begin index 0).

    With `checkpoint` and the gradient on, each prediction keeps no activations: it is computed again in the backward
    pass (the scheduler's step, which counts its steps, runs once)."""
    from qie.progress import progress as progress_bar

    if checkpoint and torch.is_grad_enabled():
        cond, uncond = _checkpointed(cond), (None if uncond is None else _checkpointed(uncond))
    bar = progress_bar(len(timesteps), "denoise", disable=not progress)
    for i, t in enumerate(timesteps):
        pred = cond(i, t, latents)
        if uncond is not None:
            neg = uncond(i, t, latents)
            combined = neg + scale * (pred - neg)
            if rescale:
                norm = torch.norm(pred, dim=-1, keepdim=True) / torch.norm(combined, dim=-1, keepdim=True)
                combined = combined * norm
            pred = combined
        latents = scheduler.step(pred, t, latents, return_dict=False)[0]
        bar.update(1)
    bar.close()
    return latents


def _checkpointed(prediction: Prediction) -> Prediction:
    from torch.utils.checkpoint import checkpoint

    def call(i: int, t: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
        return checkpoint(prediction, i, t, latents, use_reentrant=False)

    return call
