"""Held-out samples of the training data set (`validation.heldout_samples`): kept out of training, and measured
after it by the flow-matching loss at fixed noise and noise levels (`qie.training.evaluate.heldout_loss`).

That loss is comparable across runs of the same data set, which makes it what a sweep's summary reports and what
`hydra/sweeper=optuna` minimises (the train entry point returns it).
"""

from __future__ import annotations

import hashlib
from typing import Any

from qie.data.samples import Sample
from qie.errors import ConfigError
from qie.models import ModelSpec
from qie.training.evaluate import heldout_loss
from qie.training.logging import MetricsLogger
from qie.training.loop import TrainState

SEED = 0


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
    result: dict, state: TrainState, source: Any, heldout: list[Sample], spec: ModelSpec, logger: MetricsLogger
) -> None:
    """Add the trained model's held-out loss to `result` (`heldout_loss`, `heldout_samples`), log and print it.
    The main process measures; the others add nothing."""
    if not heldout or not state.accelerator.is_main_process:
        return
    transformer = state.accelerator.unwrap_model(state.model)
    loss = heldout_loss(transformer, source, heldout, spec.loss, seed=SEED)
    result["heldout_loss"], result["heldout_samples"] = loss, len(heldout)
    logger.log_scalars({"heldout/loss": loss}, int(result["step"]))
    print(f"qie: held-out loss {loss:.4f} on {len(heldout)} samples kept out of training (validation.heldout_samples)")
