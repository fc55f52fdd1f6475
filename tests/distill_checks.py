"""What the distillation tests check for any family: the objective's teacher is the family's sampler on the base
model with the teacher's settings, and its student (with the gradient, checkpointed) is the sampler on the model with
the LoRA at the student's steps without CFG, for the same seed; the loss's gradient reaches the LoRA."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from stage_edges import data_for, parts_of, source_for

from qie.adapters.lora import add_lora
from qie.config import typed
from qie.data.collate import collate
from qie.models import model_spec
from qie.models.sampling import SamplingOptions
from qie.training.objectives import build_objective
from qie.training.objectives.distill import seed_noise
from qie.training.objectives.run_context import RunContext
from qie.training.timesteps import SigmaSampling


class DictStore:
    """A TeacherStore in a dict (fills: missing outputs are computed and written)."""

    def __init__(self, fills: bool = True) -> None:
        self.fills, self.entries = fills, {}

    def read(self, fields):
        return self.entries.get(repr(sorted(fields.items())))

    def write(self, fields, latents) -> None:
        self.entries[repr(sorted(fields.items()))] = latents.clone()

    def holds(self, fields) -> bool:
        return repr(sorted(fields.items())) in self.entries


def distill_objective(spec, parts, policy, options: Mapping, store: DictStore):
    """The distill objective over `parts`' scheduler and sampling sigmas (`Parts.pipeline_config`), its teacher the
    `policy` transformer with its adapter off, its teacher outputs kept in `store`."""
    context = RunContext(
        family=spec.family,
        sigmas=SigmaSampling(method="uniform"),
        scheduler=parts.scheduler,
        pipeline_config=parts.pipeline_config,
        sampling_defaults=spec.call_defaults(),
        model_key={"model": "test"},
        transformer=policy,
        stores=lambda entry_type: store,
    )
    return build_objective({"_target_": "qie.training.objectives.distill.Distill", **options}, context)


def randomised_lora(transformer, targets, seed: int = 1) -> None:
    """A LoRA whose B matrices have values, so the adapter changes the outputs."""
    add_lora(transformer, 4, 4, targets)
    g = torch.Generator().manual_seed(seed)
    for name, p in transformer.named_parameters():
        if "lora_B" in name:
            p.data = torch.randn(p.shape, generator=g) * 0.05


def check_teacher_and_student(cfg, options: Mapping, seed: int = 1) -> None:
    """For the first sample of `cfg`'s data (its cache read as training reads it) and `seed`, assert the teacher and
    the student are the family's sampler (exactly) and the loss trains the LoRA."""
    spec = model_spec(typed(cfg.model))
    family = spec.family
    base = parts_of(cfg.model, ["transformer", "scheduler", "vae"], spec=spec)
    policy = parts_of(cfg.model, ["transformer", "scheduler", "vae"], spec=spec)
    randomised_lora(policy.transformer, list(cfg.model.lora_target_modules))
    store = DictStore()
    objective = distill_objective(spec, base, policy.transformer, options, store)
    (item,) = source_for(cfg, mode="cached", spec=spec).get(data_for(cfg).samples[:1])
    batch = collate([item], negatives=True)
    shape = batch.latents.shape[1:]
    scale = family.vae_scale(base.vae)
    size = (int(shape[-2]) * scale, int(shape[-1]) * scale)
    layers = int(shape[1]) - 1 if family.outputs.layers else None
    prompt = (item.prompt_embed, item.prompt_image_mask)
    negative = (item.empty_prompt_embed, item.empty_prompt_image_mask)
    noise = seed_noise(shape, seed, torch.device("cpu"), batch.prompt_embeds.dtype)

    teacher = objective.teacher(policy.transformer, batch, 0, seed, noise)
    with torch.no_grad():
        expected = family.sample(base, prompt, negative, item.control_latents, size, SamplingOptions(
            negative_prompt="", true_cfg_scale=objective.settings.teacher_cfg, seed=seed, layers=layers,
            num_inference_steps=objective.settings.teacher_steps))  # fmt: skip
    assert torch.equal(teacher, expected), (teacher - expected).abs().max()
    assert len(store.entries) == 1 and torch.equal(next(iter(store.entries.values())), expected[0])

    student = objective.student(policy.transformer, batch, noise)  # with the gradient, checkpointed
    assert student.requires_grad
    with torch.no_grad():
        expected = family.sample(policy, prompt, None, item.control_latents, size, SamplingOptions(
            negative_prompt=None, true_cfg_scale=1.0, seed=seed, layers=layers,
            num_inference_steps=objective.settings.student_steps))  # fmt: skip
        plain_teacher = family.sample(base, prompt, None, item.control_latents, size, SamplingOptions(
            negative_prompt=None, true_cfg_scale=1.0, seed=seed, layers=layers,
            num_inference_steps=objective.settings.student_steps))  # fmt: skip
    assert torch.equal(student.detach(), expected), (student.detach() - expected).abs().max()
    assert not torch.equal(expected, plain_teacher)  # the LoRA takes part

    ((student.float() - teacher.float()) ** 2).mean().backward()
    grads = [p.grad for n, p in policy.transformer.named_parameters() if "lora_" in n and p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads) and sum(float(g.abs().sum()) for g in grads) > 0
