"""Held-out samples of the training data set (`validation.heldout_samples`): kept out of training, and measured
after it (and every `validation.every` steps) by the objective's loss and measures at fixed noise and noise levels
(`qie.training.evaluate.heldout_metrics`).

That loss is comparable across runs of the same data set, which makes it what a sweep's summary reports and what
`hydra/sweeper=optuna` minimises (the train entry point returns it).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
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


def measure_heldout(
    result: dict,
    state: TrainState,
    source: Any,
    heldout: list[Sample],
    objective: Objective,
    logger: MetricsLogger,
    negatives: bool = False,
) -> None:
    """Add the trained model's held-out measures to `result` (`heldout_loss`, `heldout_<measure>`,
    `heldout_samples`), log and print them. The main process measures; the others add nothing. `negatives`: the
    objective reads the samples' empty-prompt embeddings."""
    if not heldout or not state.accelerator.is_main_process:
        return
    metrics = _measure(state, source, heldout, objective, logger, int(result["step"]), negatives)
    result.update({f"heldout_{k}": v for k, v in metrics.items()})
    result["heldout_samples"] = len(heldout)
    others = "".join(f", {k.replace('_', ' ')} {v:.4f}" for k, v in metrics.items() if k != "loss")
    print(
        f"qie: held-out loss {metrics['loss']:.4f}{others} on {len(heldout)} samples kept out of training "
        "(validation.heldout_samples)"
    )


def heldout_hook(
    state: TrainState,
    source: Any,
    heldout: list[Sample],
    objective: Objective,
    logger: MetricsLogger,
    every: int,
    negatives: bool = False,
) -> Callable[[StepInfo], None]:
    """A step hook measuring and logging the held-out samples every `every` steps (`validation.every`), on the
    main process."""

    def hook(info: StepInfo) -> None:
        if info.step % every == 0 and state.accelerator.is_main_process:
            _measure(state, source, heldout, objective, logger, info.step, negatives)

    return hook


def _measure(
    state: TrainState,
    source: Any,
    heldout: list[Sample],
    objective: Objective,
    logger: MetricsLogger,
    step: int,
    negatives: bool = False,
) -> dict[str, float]:
    transformer = state.accelerator.unwrap_model(state.model)
    metrics = heldout_metrics(transformer, source, heldout, objective.evaluate, seed=SEED, negatives=negatives)
    logger.log_file(HELDOUT_FILE, step, {f"heldout/{k}": v for k, v in metrics.items()})
    return metrics
