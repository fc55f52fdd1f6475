"""Held-out samples of the training data set (`validation.heldout_samples`): kept out of training, and measured
after it (and every `validation.every` steps) by the objective's loss and measures at fixed noise and noise levels
(`qie.training.evaluate.heldout_metrics`).

That loss is comparable across runs of the same data set, which makes it what a sweep's summary reports and what
`hydra/sweeper=optuna` minimises (the train entry point returns it).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from qie.data.samples import Sample
from qie.errors import ConfigError
from qie.training.evaluate import heldout_metrics
from qie.training.logging import MetricsLogger
from qie.training.loop import StepInfo, TrainState
from qie.training.objectives import Objective

SEED = 0
HELDOUT_FILE = "heldout.jsonl"  # in the run directory: the measures at each validation step and at the end


def split_heldout(samples: list[Sample], count: int) -> tuple[list[Sample], list[Sample]]:
    """(the samples to train on, the `count` held out). The held-out ones are those whose ids hash lowest: the
    same data set holds out the same samples whatever the order, and a sample added later rarely moves another.

    Raises:
        ConfigError: holding out `count` leaves nothing to train on.
    """
    if count <= 0:
        return samples, []
    if count >= len(samples):
        raise ConfigError(
            f"validation.heldout_samples={count} leaves no sample to train on: the data set has {len(samples)}"
        )
    ranked = sorted(samples, key=lambda s: hashlib.sha256(s.id.encode("utf-8")).hexdigest())
    held = {s.id for s in ranked[:count]}
    return [s for s in samples if s.id not in held], [s for s in samples if s.id in held]


@dataclass(frozen=True)
class HeldOut:
    """A run's held-out samples and what measures them: the state's model under the objective's `evaluate`, their
    embeddings from `source`, the measures logged by `logger`. `negatives`: the objective reads the samples'
    empty-prompt embeddings. The main process measures; the others do nothing."""

    state: TrainState
    source: Any
    samples: list[Sample]
    objective: Objective
    logger: MetricsLogger
    negatives: bool = False

    def measure_into(self, result: dict) -> None:
        """Add the trained model's held-out measures to `result` (`heldout_loss`, `heldout_<measure>`,
        `heldout_samples`), log and print them."""
        if not self.samples or not self.state.accelerator.is_main_process:
            return
        metrics = self.measure(int(result["step"]))
        result.update({f"heldout_{k}": v for k, v in metrics.items()})
        result["heldout_samples"] = len(self.samples)
        others = "".join(f", {k.replace('_', ' ')} {v:.4f}" for k, v in metrics.items() if k != "loss")
        print(
            f"qie: held-out loss {metrics['loss']:.4f}{others} on {len(self.samples)} samples kept out of training "
            "(validation.heldout_samples)"
        )

    def hook(self, every: int) -> Callable[[StepInfo], None]:
        """A step hook measuring and logging the held-out samples every `every` steps (`validation.every`)."""

        def hook(info: StepInfo) -> None:
            if info.step % every == 0 and self.state.accelerator.is_main_process:
                self.measure(info.step)

        return hook

    def measure(self, step: int) -> dict[str, float]:
        """The held-out measures of the model now, logged at `step`."""
        transformer = self.state.accelerator.unwrap_model(self.state.model)
        evaluate = self.objective.evaluate
        metrics = heldout_metrics(transformer, self.source, self.samples, evaluate, seed=SEED, negatives=self.negatives)
        self.logger.log_file(HELDOUT_FILE, step, {f"heldout/{k}": v for k, v in metrics.items()})
        return metrics
