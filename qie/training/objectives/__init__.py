"""Training objectives: what one training step computes from a batch, behind one small protocol.

The loop (`qie.training.loop`) draws a generator per batch (seeded by the batch number and the process, so a
resumed run repeats its draws) and asks the run's objective for the loss; it knows no objective by name. An
objective is a component, as an optimizer is: `train/objective=<name>` picks `conf/train/objective/<name>.yaml`,
whose `_target_` names the class and whose other keys are the objective's own settings (`train.objective.beta=...`);
an objective from outside qie is `train.objective._target_=pkg.Cls +train.objective.key=value`. The class:

- is built as `cls(context, **settings)`: the `ObjectiveContext` (`qie.training.objectives.context`) is what it asks
  the run for, when it needs it (noise and sigmas, the flow loss and prediction, the sampler, the decoder, rows,
  rewards, the reference model, a store of its own entry type); its settings are keyword parameters of `__init__`,
  checked against it when the config is composed;
- `requires`: the sample fields it trains on (names or `SampleField`s; the train stage refuses samples without
  them, and precompute fills every one); without "target", rows without a target train (an objective that samples
  its own results);
- `use_problem(use)` (a class method): why it cannot train this run (`ObjectiveUse`, known before any model loads:
  `qie.checks.validate` asks it when the config is composed), or None.

An objective that computes targets ahead of training into a store (distillation's teacher outputs) also implements
`PrecomputesTargets`; `precompute.teachers=true` asks for it.

`FlowMatching` (the default) is the family's flow-matching loss with loss masks and regularisation weights and the
base class a new objective usually extends; `Dpo` is Diffusion-DPO carried to flow matching on preference pairs;
`Distill` trains a few-step student on the base model's own sampling (its teacher outputs kept in the cache);
`Grpo` is online RL (Flow-GRPO): groups of edits sampled by the model, scored by a reward.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from qie.errors import ConfigError

if TYPE_CHECKING:  # names for annotations only: config validation reads the classes without loading the models
    import torch

    from qie.training.objectives.context import ObjectiveContext
    from qie.types import Batch

# Where a run's objective is set, and the class `train/objective=flow_matching` names.
SETTING = "train.objective"
DEFAULT_TARGET = "qie.training.objectives.flow_matching.FlowMatching"


class Objective(Protocol):
    """The loss of one batch, to be backpropagated, and what it measures besides."""

    def prepare(self, transformer: torch.nn.Module) -> None:
        """Add what the objective needs to the model with its trained adapter, before the model is wrapped for
        training; most objectives add nothing (the reference model comes from `ObjectiveContext.reference`)."""
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


@runtime_checkable
class PrecomputesTargets(Protocol):
    """An objective that computes what it trains against from the base model, ahead of training, into the cache
    (`precompute.teachers=true`; distillation's teacher outputs)."""

    def fill(self, model: torch.nn.Module, batch: Batch) -> int:
        """Compute and store the batch's missing targets; returns how many were computed."""
        ...

    def fills_per_sample(self) -> int:
        """How many targets one sample has (a count of seeds), for the precompute summary."""
        ...


class StepMeans:
    """What an objective measures on its batches, averaged for `step_metrics()`: `add` once per batch, `pop` the
    means since the last pop ({} when nothing was added) and start afresh."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.count = 0

    def add(self, **values: Any) -> None:
        for name, value in values.items():
            self.sums[name] = self.sums.get(name, 0.0) + float(value)
        self.count += 1

    def pop(self) -> dict[str, float]:
        out = {k: v / self.count for k, v in self.sums.items()} if self.count else {}
        self.sums, self.count = {}, 0
        return out


@dataclass(frozen=True)
class ObjectiveUse:
    """What a run asks of its objective, known before any model loads (`use_problem`)."""

    family: Any  # the ModelFamily
    lora: bool  # a LoRA is trained (not the whole transformer)
    regularization: bool  # regularisation batches are mixed in (`data.regularization`)
    options: Mapping[str, Any] = field(default_factory=dict)  # the objective's own settings, as plain values
    sampling_defaults: Mapping[str, Any] = field(default_factory=dict)  # `ModelSpec.call_defaults()`
    caption_dropout: float = 0.0  # `data.caption_dropout_rate`


def objective_class(node: Any) -> type:
    """The class a `train.objective` node names (its `_target_`).

    Raises:
        ConfigError: a plain name instead of a node (`train/objective=dpo`: the group is chosen as
            `train/objective=dpo`), no `_target_`, nothing importable there, or a class that is no objective.
    """
    if not isinstance(node, Mapping):
        raise ConfigError(
            f"{SETTING}={node!r} is not an objective node: choose a preset with train/objective=NAME "
            "(flow_matching, dpo, distill, ...) or give a class with train.objective._target_=pkg.Cls"
        )
    from qie.config.targets import target_class  # the config package (Hydra) only where a config is read

    target = node.get("_target_")
    if not target:
        raise ConfigError(f"{SETTING} has no _target_: give the objective's class, e.g. {DEFAULT_TARGET}")
    cls = target_class(f"{SETTING}._target_", str(target), f"an objective class such as {DEFAULT_TARGET}")
    # A class, but not an objective (torch.nn.Linear, a reward): what the stages and the checks call of one.
    lacks = sorted({"requires", "use_problem", "prepare", "loss", "step_metrics", "evaluate"} - set(dir(cls)))
    if lacks:
        raise ConfigError(
            f"{SETTING}._target_={target!r} is not an objective (it has no {', '.join(lacks)}): give a subclass of "
            "qie.extend.FlowMatching, or a class with the qie.extend.Objective protocol's methods"
        )
    return cls


def settings_of(node: Mapping[str, Any]) -> dict[str, Any]:
    """The objective's own settings: the node's keys but `_target_`."""
    return {k: v for k, v in node.items() if k != "_target_"}


def accepted_settings(cls: type) -> set[str] | None:
    """The keyword settings `cls(context, **settings)` takes: the named parameters of each constructor along the
    class's bases while one passes `**kwargs` on; None when the last one takes any keyword."""
    names: set[str] = set()
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        params = list(inspect.signature(init).parameters.values())[2:]  # self, context
        names |= {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            return names
    return None


def settings_problem(cls: type, settings: Iterable[str]) -> str | None:
    """Why `settings` do not fit `cls`'s constructor (one line naming the first unknown key), or None."""
    accepted = accepted_settings(cls)
    if accepted is None:
        return None
    unknown = sorted(set(settings) - accepted)
    if not unknown:
        return None
    return (
        f"unknown key {SETTING}.{unknown[0]}: {cls.__module__}.{cls.__qualname__} takes "
        f"{', '.join(sorted(accepted)) or 'no settings'}"
    )


def field_names(cls: type) -> frozenset[str]:
    """The names of the sample fields the objective class requires."""
    return frozenset(f if isinstance(f, str) else f.name for f in cls.requires)


def trains_on_targets(cls: type) -> bool:
    """Whether the objective class trains on each sample's target (`requires` names "target"); one that samples
    and scores its own results (GRPO) does not, and rows without a target then train."""
    return "target" in field_names(cls)


def check_use(node: Mapping[str, Any], use: ObjectiveUse) -> None:
    """Raise ConfigError (one line, naming the setting) when the objective `node` names cannot train as `use` says:
    a setting its constructor does not take, or its `use_problem`."""
    cls = objective_class(node)
    settings = settings_of(node)
    problem = settings_problem(cls, settings) or cls.use_problem(replace(use, options=settings))
    if problem:
        raise ConfigError(problem)


def build_objective(node: Mapping[str, Any], context: ObjectiveContext) -> Objective:
    """The objective `node` (`train.objective`, plain values) names, built from the run's `context` and its
    settings.

    Raises:
        ConfigError: no objective there, or settings it refuses.
    """
    cls = objective_class(node)
    settings = settings_of(node)
    if problem := settings_problem(cls, settings):
        raise ConfigError(problem)
    return cls(context, **settings)


def __getattr__(name: str) -> object:
    from qie.training.objectives.renamed import renamed_error

    raise renamed_error(__name__, name)


__all__ = [
    "DEFAULT_TARGET",
    "Objective",
    "ObjectiveUse",
    "PrecomputesTargets",
    "StepMeans",
    "accepted_settings",
    "build_objective",
    "check_use",
    "field_names",
    "objective_class",
    "settings_of",
    "settings_problem",
    "trains_on_targets",
]
