"""Training objectives: what one training step computes from a batch, behind one small protocol.

The loop (`qie.training.loop`) draws a generator per batch (seeded by the batch number and the process, so a
resumed run repeats its draws) and asks the run's objective for the loss; it knows no objective by name. An
objective is one module of this package named as `train.objective` names it, holding `build(inputs)`:
`flow_matching` (the default) is the family's flow-matching loss with loss masks and regularisation weights;
distillation and preference objectives join as modules of their own.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from qie.errors import ConfigError

if TYPE_CHECKING:  # names for annotations only: config validation lists the objectives without loading torch
    import torch

    from qie.training.timesteps import SigmaSampling
    from qie.types import Batch

class Objective(Protocol):
    """The loss of one batch, to be backpropagated."""

    def loss(self, model: torch.nn.Module, batch: Batch, generator: torch.Generator) -> torch.Tensor:
        """The scalar loss of `batch` (on the model's device and dtype) under `model`.

        Args:
            generator: a CPU generator seeded for this batch; every random draw of the step comes from it.
        """
        ...


@dataclass(frozen=True)
class ObjectiveInputs:
    """What the train stage hands an objective's `build`: the model family's pieces and the step's settings."""

    family: Any  # the ModelFamily: its loss pieces and patch size
    sigmas: SigmaSampling
    loss_weighting: str = "none"


def objective_names() -> list[str]:
    """The objectives there are: the modules of this package."""
    return sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))


def objective_problem(name: str) -> str | None:
    """Why `train.objective={name}` names no objective (one line), or None."""
    if name in objective_names():
        return None
    return f"train.objective={name!r} is not an objective: choose one of {', '.join(objective_names())}"


def build_objective(name: str, inputs: ObjectiveInputs) -> Objective:
    """The objective `train.objective` names, built from `inputs`.

    Raises:
        ConfigError: no objective of that name.
    """
    if problem := objective_problem(name):
        raise ConfigError(problem)
    return importlib.import_module(f"{__name__}.{name}").build(inputs)


__all__ = ["Objective", "ObjectiveInputs", "build_objective", "objective_names", "objective_problem"]
