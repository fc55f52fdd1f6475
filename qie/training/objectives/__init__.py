"""Training objectives: what one training step computes from a batch, behind one small protocol.

The loop (`qie.training.loop`) draws a generator per batch (seeded by the batch number and the process, so a
resumed run repeats its draws) and asks the run's objective for the loss; it knows no objective by name. An
objective is one module of this package named as `train.objective` names it, holding:

- `REQUIRES`: the sample fields it trains on beyond a target (`("rejected",)` for preference pairs); the train
  stage refuses samples without them and drops such fields where the objective does not read them
  (`"empty_prompt"`, which every sample has: batches carry each sample's empty-prompt embedding);
- `use_problem(use)`: why it cannot train this run (`ObjectiveUse`, known before any model loads: `qie.config.validate`
  asks it when the config is composed), or None;
- `build(inputs)`: the `Objective`, its own settings read from `inputs.options` (the `train.<name>` node).

`flow_matching` (the default) is the family's flow-matching loss with loss masks and regularisation weights;
`dpo` is Diffusion-DPO carried to flow matching on preference pairs; `distill` trains a few-step student on the
base model's own sampling (its teacher outputs kept in the cache).
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from qie.errors import ConfigError

if TYPE_CHECKING:  # names for annotations only: config validation lists the objectives without loading torch
    import torch

    from qie.training.timesteps import SigmaSampling
    from qie.types import Batch


class Objective(Protocol):
    """The loss of one batch, to be backpropagated, and what it measures besides."""

    def prepare(self, transformer: torch.nn.Module) -> None:
        """Add what the objective needs to the model with its trained adapter, before the model is wrapped for
        training (a reference adapter); most objectives add nothing."""
        ...

    def loss(self, model: torch.nn.Module, batch: Batch, generator: torch.Generator) -> torch.Tensor:
        """The scalar loss of `batch` (on the model's device and dtype) under `model`.

        Args:
            generator: a CPU generator seeded for this batch; every random draw of the step comes from it.
        """
        ...

    def step_metrics(self) -> dict[str, float]:
        """The means of what the objective measured on the batches since the last call (the same names on every
        process and step, logged beside the loss), and a fresh start; {} for an objective that measures nothing
        else."""
        ...

    def evaluate(
        self, model: torch.nn.Module, batch: Batch, noise: torch.Tensor, sigmas: torch.Tensor
    ) -> dict[str, float]:
        """Measures of `batch` at the given noise and noise levels, without a gradient and without loss weighting:
        "loss" (comparable across runs of one data set, what held-out samples report) and the objective's own."""
        ...


@dataclass(frozen=True)
class ObjectiveUse:
    """What a run asks of its objective, known before any model loads (`use_problem`)."""

    family: Any  # the ModelFamily
    lora: bool  # a LoRA is trained (not the whole transformer)
    regularization: bool  # regularisation batches are mixed in (`data.regularization`)
    options: Mapping[str, Any] = field(default_factory=dict)  # the `train.<name>` node, as `ObjectiveInputs`


@dataclass(frozen=True)
class ObjectiveInputs:
    """What the train stage hands an objective's `build`: the model family's pieces and the step's settings."""

    family: Any  # the ModelFamily: its loss pieces, patch size and sampling loop
    sigmas: SigmaSampling
    loss_weighting: str = "none"
    # The objective's own settings: the `train.<name>` node as plain values ({} where there is none).
    options: Mapping[str, Any] = field(default_factory=dict)
    # What an objective that samples needs (distillation): the model's noise scheduler, the checkpoint's
    # model_index.json (`Parts.pipeline_config`), the model's sampling defaults (`ModelSpec.call_defaults()`).
    scheduler: Any = None
    pipeline_config: Mapping[str, Any] = field(default_factory=dict)
    sampling_defaults: Mapping[str, Any] = field(default_factory=dict)
    # Where an objective keeps what it computes from the base model (distillation's teacher outputs, in the cache
    # backend; None: kept nowhere), and what the base model is (the run's model record, part of their keys).
    teacher_store: Any = None
    model_key: Mapping[str, Any] = field(default_factory=dict)
    # What an objective that scores its own samples needs (`needs_decoder`): the VAE (its decoder), a sample id's
    # prompt and control images (float (3, h, w) in [0, 1]) for its reward, and what builds a reward from its
    # config node (`qie.evaluation.build`); None where not asked for.
    decoder: Any = None
    sample_views: Any = None
    build_reward: Any = None


def objective_names() -> list[str]:
    """The objectives there are: the modules of this package."""
    return sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))


def objective_problem(name: str) -> str | None:
    """Why `train.objective={name}` names no objective (one line), or None."""
    if name in objective_names():
        return None
    return f"train.objective={name!r} is not an objective: choose one of {', '.join(objective_names())}"


def _module(name: str) -> Any:
    if problem := objective_problem(name):
        raise ConfigError(problem)
    return importlib.import_module(f"{__name__}.{name}")


def objective_requires(name: str) -> tuple[str, ...]:
    """The sample fields `train.objective={name}` trains on beyond a target."""
    return tuple(_module(name).REQUIRES)


def objective_traits(name: str) -> tuple[bool, bool]:
    """(whether `train.objective={name}` trains on each sample's target, whether it decodes latents to images):
    an objective that samples and scores its own results (GRPO) needs no target and the VAE's decoder."""
    module = _module(name)
    return bool(getattr(module, "TARGETS", True)), bool(getattr(module, "NEEDS_DECODER", False))


def check_use(name: str, use: ObjectiveUse) -> None:
    """Raise ConfigError (one line, naming the setting) when the objective cannot train as `use` says."""
    if problem := _module(name).use_problem(use):
        raise ConfigError(problem)


def build_objective(name: str, inputs: ObjectiveInputs) -> Objective:
    """The objective `train.objective` names, built from `inputs`.

    Raises:
        ConfigError: no objective of that name, or settings it refuses.
    """
    return _module(name).build(inputs)


__all__ = ["Objective", "ObjectiveInputs", "ObjectiveUse", "build_objective", "check_use", "objective_names",
           "objective_problem", "objective_requires", "objective_traits"]  # fmt: skip
