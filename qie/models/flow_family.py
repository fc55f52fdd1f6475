"""The flow-matching families' denoising loop, written once: `FlowLoop.denoise` is every family's `denoise` piece.

The template makes a fresh scheduler from the model's, picks the sigmas (given, else the checkpoint's
`sample_sigmas` where the family's pipeline reads them, else the family's schedule), shifts them by the family's
`mu`, sets the timesteps, decides true CFG (a negative prompt and a scale above 1, diffusers' rule), and runs
`qie.models.sampling.denoise` over the predictions the family makes. A family subclasses `FlowLoop` with what
differs: how the noise and the controls are packed (`__init__`), one transformer call (`prediction`), the shift
(`mu`), the unpacking (`unpack`), and its class settings (`sigma_schedule`, `rescale`, `reads_sample_sigmas`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch
from diffusers.pipelines.qwenimage.pipeline_qwenimage import retrieve_timesteps

from qie.models.flow import inference_sigmas, shift_mu
from qie.models.sampling import Prediction, PromptInputs, denoise, true_cfg_enabled


class CalledThrough:
    """A model inside a data-parallel wrapper (its `.module`) as a sampling loop uses it: each call goes through the
    wrapper (so a gradient taken through the loop is synchronised across processes), every attribute (its config,
    its blocks) is the inner model's, which the wrapper does not forward."""

    def __init__(self, outer: Any) -> None:
        self.outer, self.inner = outer, outer.module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.outer(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def sampled(transformer: Any) -> Any:
    """`transformer` as a sampling loop calls it: through `CalledThrough` where it wraps a module."""
    return (
        CalledThrough(transformer) if isinstance(getattr(transformer, "module", None), torch.nn.Module) else transformer
    )


class FlowLoop:
    """One denoising run of a family: the packed noise (`latents`) and what its predictions need.

    Subclasses set `sigma_schedule` (a `qie.models.flow.SIGMA_SCHEDULES` name), `rescale` (true CFG brought back to
    the conditional prediction's norm) and `reads_sample_sigmas` (the checkpoint's model_index.json `sample_sigmas`
    are the sigmas), and implement `__init__(transformer, noise, controls)` (setting `latents`), `prediction` and
    `unpack`; `mu` defaults to the scheduler's dynamic shift for the packed target's length.
    """

    sigma_schedule: ClassVar[str] = "linspace_to_1_over_n"
    rescale: ClassVar[bool] = False
    reads_sample_sigmas: ClassVar[bool] = False

    latents: torch.Tensor
    transformer: Any

    def __init__(self, transformer: Any, noise: torch.Tensor, controls: Sequence[torch.Tensor]) -> None:
        raise NotImplementedError

    def prediction(self, inputs: PromptInputs, name: str) -> Prediction:
        """The transformer's prediction (packed like `latents`) for one prompt branch ("cond", "uncond")."""
        raise NotImplementedError

    def unpack(self, latents: torch.Tensor) -> torch.Tensor:
        """Packed latents -> normalised latents in the noise's layout."""
        raise NotImplementedError

    def mu(self, scheduler_config: Mapping[str, Any]) -> float:
        """The scheduler's shift: its dynamic shift for the target's tokens (the Qwen-Image pipelines')."""
        return shift_mu(self.latents.shape[1], scheduler_config)

    @classmethod
    def sigmas(cls, steps: int, pipeline_config: Mapping[str, Any] | None, sigmas: Sequence[float] | None) -> Any:
        """The sigmas the loop steps through: `sigmas`, else the checkpoint's `sample_sigmas` (where the family's
        pipeline reads them), else `steps` of the family's schedule."""
        if sigmas is None and cls.reads_sample_sigmas:
            sigmas = (pipeline_config or {}).get("sample_sigmas")
        return inference_sigmas(cls.sigma_schedule, steps) if sigmas is None else sigmas

    @classmethod
    def denoise(
        cls,
        transformer: Any,
        scheduler: Any,
        noise: torch.Tensor,
        prompt: PromptInputs,
        negative: PromptInputs | None,
        controls: Sequence[torch.Tensor],
        steps: int,
        true_cfg_scale: float = 1.0,
        checkpoint: bool = False,
        pipeline_config: Mapping[str, Any] | None = None,
        sigmas: Sequence[float] | None = None,
        progress: bool = False,
        span: tuple[int, int | None] | None = None,
    ) -> torch.Tensor:
        """The pipeline's denoising loop from `noise` (the family's `denoise`, `qie.models.family`): what the
        family's sampler runs after drawing its noise, and what distillation trains through (with the gradient on
        and `checkpoint`: each prediction recomputed in the backward pass).

        Args:
            transformer: what is called for each prediction (LoRA or not).
            scheduler: the model's scheduler (not modified: a fresh one is made from its config).
            noise: (B, C, F, h, w) on the transformer's device, in the dtype the loop runs in.
            prompt, negative: the prompts (B rows, or one for every image, on the device); true CFG runs with
                `negative` and a scale above 1.
            controls: normalised control latents, each (B or 1, C, 1, h, w), in the images' order.
            steps: denoising steps (unused where `sigmas` or the checkpoint's `sample_sigmas` give them).
            pipeline_config: the checkpoint's model_index.json (its `sample_sigmas`, for a family that reads them).
            sigmas: sampling sigmas, before any other.
            span: the steps (start, stop) of the schedule to run, `noise` being the latents at `start` (the rest of
                a run whose first steps were taken elsewhere: a group's shared prefix); stop None: to the end; None:
                every step.

        Returns:
            Normalised latents in the noise's layout (after step `stop - 1`).
        """
        run = cls(sampled(transformer), noise, controls)
        scheduler = type(scheduler).from_config(scheduler.config)
        chosen = cls.sigmas(steps, pipeline_config, sigmas)
        timesteps, _ = retrieve_timesteps(scheduler, None, noise.device, sigmas=chosen, mu=run.mu(scheduler.config))
        start, stop = span or (0, None)
        scheduler.set_begin_index(start)
        do_cfg = true_cfg_enabled(true_cfg_scale, negative is not None)
        uncond = run.prediction(negative, "uncond") if do_cfg else None
        latents = denoise(
            scheduler,
            timesteps[start:stop],
            run.latents,
            run.prediction(prompt, "cond"),
            uncond,
            true_cfg_scale,
            rescale=cls.rescale,
            progress=progress,
            checkpoint=checkpoint,
        )
        return run.unpack(latents)
