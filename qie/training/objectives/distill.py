"""Distillation of a few-step LoRA from the base model's own sampling (`train/objective=distill`, settings
`train.objective.*`).

The teacher is the base model (the trained adapter turned off) sampling as `qie.infer` samples: `teacher_steps`
steps, true CFG at `teacher_cfg` against the sample's empty prompt, from the noise of a seed. The student (the base
with the adapter) denoises the same noise in `student_steps` steps without CFG, through the family's own sampling
loop (`ModelFamily.denoise`) with the gradient, each step's prediction recomputed in the backward pass; the loss is
the mean squared error of its final latents to the teacher's (the batch's loss mask applied). Each sample has
`seeds` seeds (0, 1, ...): each step draws one per sample from the batch's generator, so the student sees varied
noise and a resumed run draws the same.

Teacher outputs are kept as cache entries (`teacher_latent`, the teacher's final latents) keyed by the base model
(the run's model record and quantization), the teacher's settings (steps, scale, the scheduler's config and the
checkpoint's sampling sigmas), the seed, the latent shape and dtype, and the bytes of the sample's prompt,
empty-prompt and control tensors as the step reads them, in the store the objective asks its context for
(`ObjectiveContext.store`). `cache.mode=lazy` computes and writes a missing one on first use, `cached` only reads them
(a miss names the sample), `live` computes them every step.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from qie.errors import CacheMissError, ConfigError
from qie.models.sampling import initial_noise
from qie.training.objectives import ObjectiveUse
from qie.training.objectives.run_context import sample_inputs
from qie.types import Batch

if TYPE_CHECKING:
    from qie.training.objectives.context import ObjectiveContext

# The store's entry type: a teacher's final latents for one seed.
ENTRY_TYPE = "teacher_latent"


@dataclass(frozen=True)
class DistillSettings:
    """`train/objective=distill`'s settings (teacher_steps and teacher_cfg left None: the model's pipeline
    defaults)."""

    student_steps: int = 4
    teacher_steps: int | None = None
    teacher_cfg: float | None = None
    seeds: int = 2

    def resolved(self, defaults: Mapping[str, Any] | None = None) -> DistillSettings:
        """These settings checked, None taken from `defaults` (`ModelSpec.call_defaults()`: num_inference_steps,
        true_cfg_scale).

        Raises:
            ConfigError: a step count or seed count below 1, a teacher scale of 0 or less, a student taking more
                steps than its teacher.
        """
        defaults = defaults or {}
        s = self
        if s.teacher_steps is None and defaults.get("num_inference_steps") is not None:
            s = DistillSettings(s.student_steps, int(defaults["num_inference_steps"]), s.teacher_cfg, s.seeds)
        if s.teacher_cfg is None and defaults.get("true_cfg_scale") is not None:
            s = DistillSettings(s.student_steps, s.teacher_steps, float(defaults["true_cfg_scale"]), s.seeds)
        for name, value in (("student_steps", s.student_steps), ("teacher_steps", s.teacher_steps), ("seeds", s.seeds)):
            if value is not None and int(value) < 1:
                raise ConfigError(f"train.objective.{name}={value} is out of range: give 1 or more")
        if s.teacher_cfg is not None and not s.teacher_cfg > 0:
            raise ConfigError(
                f"train.objective.teacher_cfg={s.teacher_cfg} is out of range: give a value above 0 (1: no CFG; e.g. 4)"
            )
        if s.teacher_steps is not None and int(s.student_steps) > int(s.teacher_steps):
            named = f"train.objective.teacher_steps={self.teacher_steps}"
            if self.teacher_steps is None:
                named = (
                    f"the teacher's {s.teacher_steps} (train.objective.teacher_steps unset: model.num_inference_steps)"
                )
            raise ConfigError(
                f"train.objective.student_steps={s.student_steps} is above {named}: the student learns to sample in "
                "fewer steps than its teacher; lower train.objective.student_steps or raise "
                "train.objective.teacher_steps"
            )
        return s


def digest(tensors: Sequence[torch.Tensor | None]) -> str:
    """sha256 of the tensors' dtypes, shapes and bytes, in order."""
    h = hashlib.sha256()
    for t in tensors:
        if t is None:
            h.update(b"none;")
            continue
        t = t.detach().to("cpu").contiguous()
        h.update(f"{t.dtype}{tuple(t.shape)};".encode())
        if t.numel():
            h.update(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
    return h.hexdigest()


def seed_noise(shape: Sequence[int], seed: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """The starting noise (1, C, F, h, w) of seed `seed`: what the sampler draws for one image with that seed."""
    return initial_noise((1, *shape), torch.Generator("cpu").manual_seed(int(seed)), device, dtype)


def masked_error(student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Each sample's mean squared error (B,), float32; with a loss mask (B, 1, 1, h, w) weighted by it and divided
    by its mean weight (as the flow-matching loss weighs)."""
    error = (student.float() - teacher.float()) ** 2
    if mask is None:
        return error.flatten(1).mean(1)
    w = mask.to(error.device, torch.float32).expand_as(error)
    return (error * w).flatten(1).mean(1) / w.flatten(1).mean(1).clamp_min(1e-12)


class Distill:
    """The distillation objective (see the module's text).

    Args:
        context: the family's sampling loop, the model's noise scheduler and the checkpoint's model_index.json, the
            model's sampling defaults, what the base model is (part of every teacher entry's key), the store of
            teacher outputs and the reference (the base, the adapter off) the teacher samples with.
        student_steps, teacher_steps, teacher_cfg, seeds: `DistillSettings`.
    """

    # A target per sample (its shape) and the teacher's negative prompt: batches carry each sample's empty-prompt
    # embedding.
    requires: ClassVar[frozenset[Any]] = frozenset({"target", "empty_prompt"})

    def __init__(
        self,
        context: ObjectiveContext,
        student_steps: int = 4,
        teacher_steps: int | None = None,
        teacher_cfg: float | None = None,
        seeds: int = 2,
    ) -> None:
        settings = DistillSettings(student_steps, teacher_steps, teacher_cfg, seeds).resolved(context.sampling_defaults)
        if settings.teacher_steps is None or settings.teacher_cfg is None:
            raise ConfigError(
                "train.objective.teacher_steps and teacher_cfg are not set and the model names no pipeline defaults: "
                "set both (e.g. train.objective.teacher_steps=20 train.objective.teacher_cfg=4)"
            )
        self.context, self.settings = context, settings
        self.store = context.store(ENTRY_TYPE)
        scheduler_config = {k: v for k, v in dict(context.scheduler.config).items() if not k.startswith("_")}
        key = {
            "model": dict(context.model_key),
            "steps": settings.teacher_steps,
            "cfg": settings.teacher_cfg,
            "scheduler": scheduler_config,
            "sigmas": dict(context.pipeline_config or {}).get("sample_sigmas"),
        }
        self.teacher_key = json.loads(json.dumps(key, default=str))
        self.reference = context.reference()
        self.computed = self.samples = 0

    @classmethod
    def use_problem(cls, use: ObjectiveUse) -> str | None:
        if not use.lora:
            return (
                "train/objective=distill needs train.mode=lora: its teacher is the base model with the adapter "
                "turned off, which training the whole transformer does not keep"
            )
        if use.regularization:
            return (
                "train/objective=distill does not mix in data.regularization (the student learns the teacher's "
                "outputs, not targets): remove data.regularization.path"
            )
        names = ("student_steps", "teacher_steps", "teacher_cfg", "seeds")
        DistillSettings(**{k: use.options[k] for k in names if k in use.options}).resolved(use.sampling_defaults)
        return None

    def fills_per_sample(self) -> int:
        return int(self.settings.seeds)

    def prepare(self, transformer: torch.nn.Module) -> None:
        pass  # the reference is the context's

    def key_fields(self, batch: Batch, i: int, seed: int, noise: torch.Tensor) -> dict[str, Any]:
        """The fields of sample `i`'s teacher entry for `seed` (`noise` its starting noise)."""
        prompt, negative, controls = sample_inputs(batch, i, negatives=True)
        inputs = digest([prompt.embeds, prompt.image_mask, negative.embeds, negative.image_mask, *controls])
        return {
            **self.teacher_key,
            "seed": int(seed),
            "shape": list(noise.shape[1:]),
            "dtype": str(noise.dtype),
            "inputs": inputs,
        }

    def teach(self, model: torch.nn.Module, batch: Batch, i: int, noise: torch.Tensor) -> torch.Tensor:
        """The teacher's latents (1, C, F, h, w) of sample `i` from `noise`: the base model sampling with
        `teacher_steps` steps and true CFG at `teacher_cfg` against the empty prompt, without a gradient."""
        cfg = float(self.settings.teacher_cfg or 1.0)
        steps = int(self.settings.teacher_steps)
        with torch.no_grad(), self.reference.active():
            return self.context.sample(model, batch.take([i]), noise=noise, steps=steps, true_cfg_scale=cfg)

    def teacher(
        self, model: torch.nn.Module, batch: Batch, i: int, seed: int, noise: torch.Tensor, fill: bool = True
    ) -> torch.Tensor:
        """Sample `i`'s teacher latents for `seed`: read from the store, else computed (and written where the store
        fills). Without `fill`, a miss is computed even where the store does not fill (held-out measures).

        Raises:
            CacheMissError: the store holds no such entry and does not fill (cache.mode=cached).
        """
        self.samples += 1
        fields = self.key_fields(batch, i, seed, noise)
        found = self.store.read(fields)
        if found is not None:
            return found.to(noise.device, noise.dtype).unsqueeze(0)
        if fill and not self.store.fills:
            damaged = self.store.holds(fields)
            raise CacheMissError(
                f"sample {batch.ids[i]!r}: its teacher output (seed {seed}) is "
                f"{'damaged in the cache (its bytes changed)' if damaged else 'not in the cache'}: "
                f"{'write them again' if damaged else 'fill them'} with this run's overrides and `python -m "
                f"qie.precompute precompute.teachers=true{' cache.repair=true' if damaged else ''}`, or train with "
                "cache.mode=lazy once to compute and store them (or keep training lazy)"
            )
        latents = self.teach(model, batch, i, noise)
        self.computed += 1
        if self.store.fills:
            self.store.write(fields, latents[0])
        return latents

    def fill(self, model: torch.nn.Module, batch: Batch) -> int:
        """Make sure every sample of `batch` has its teacher output for each of the `seeds` seeds in the store,
        computing the missing ones (`precompute.teachers=true`); returns how many were computed."""
        shape, device, dtype = batch.latents.shape[1:], batch.latents.device, batch.prompt_embeds.dtype
        computed, samples = self.computed, self.samples
        for seed in range(int(self.settings.seeds)):
            noise = seed_noise(shape, seed, device, dtype)
            for i in range(batch.latents.shape[0]):
                self.teacher(model, batch, i, seed, noise, fill=True)
        out = self.computed - computed
        self.computed, self.samples = computed, samples  # not a training step's measure
        return out

    def student(self, model: torch.nn.Module, batch: Batch, noise: torch.Tensor) -> torch.Tensor:
        """The student's latents (B, C, F, h, w) from `noise`: `student_steps` steps without CFG, with the gradient
        where it is on (each prediction recomputed in the backward pass)."""
        steps = int(self.settings.student_steps)
        return self.context.denoise(model, batch, noise, steps=steps, checkpoint=True)

    def _errors(self, model: torch.nn.Module, batch: Batch, seeds: Sequence[int], fill: bool) -> torch.Tensor:
        shape, device, dtype = batch.latents.shape[1:], batch.latents.device, batch.prompt_embeds.dtype
        noise = [seed_noise(shape, s, device, dtype) for s in seeds]
        teacher = torch.cat([self.teacher(model, batch, i, s, n, fill) for i, (s, n) in enumerate(zip(seeds, noise))])
        return masked_error(self.student(model, batch, torch.cat(noise)), teacher, batch.loss_mask)

    def loss(self, model: torch.nn.Module, batch: Batch, generator: torch.Generator) -> torch.Tensor:
        seeds = torch.randint(int(self.settings.seeds), (batch.latents.shape[0],), generator=generator).tolist()
        out = self._errors(model, batch, seeds, fill=True).mean()
        return out if batch.loss_weight == 1.0 else out * batch.loss_weight

    def step_metrics(self) -> dict[str, float]:
        """`teacher_computed`: the share of the window's teacher outputs computed (not read from the cache)."""
        out = {"teacher_computed": self.computed / self.samples} if self.samples else {}
        self.computed = self.samples = 0
        return out

    @torch.no_grad()
    def evaluate(
        self, model: torch.nn.Module, batch: Batch, noise: torch.Tensor, sigmas: torch.Tensor
    ) -> dict[str, float]:
        """The student's error to the teacher from seed 0's noise ("loss"); `noise` and `sigmas` are not used: the
        measure is of whole sampling runs. A held-out sample's missing teacher output is computed, not required."""
        computed, samples = self.computed, self.samples
        loss = float(self._errors(model, batch, [0] * batch.latents.shape[0], fill=False).mean())
        self.computed, self.samples = computed, samples  # held-out measures are not the steps' own
        return {"loss": loss}
