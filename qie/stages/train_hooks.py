"""What the train stage runs after each optimizer step: the EMA update, image logging and validation sampling."""

from __future__ import annotations

import contextlib
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qie.components import load_parts
from qie.training.ema import Ema
from qie.training.logging import ImageLogger
from qie.training.loop import StepInfo, TrainState

if TYPE_CHECKING:
    from qie.stages.train_setup import TrainSetup


def step_hooks(s: TrainSetup, state: TrainState, source: Any, samples: list, scheduler: Any, logger, extra,
               run_dir: Path, ema: Ema | None = None) -> list:  # fmt: skip
    """What runs after each optimizer step: the EMA update, image logging, validation sampling, and `extra`."""
    hooks = [lambda info: ema.update(info.step)] if ema is not None else []
    log = s.logging
    if log.log_images:
        by_id = {sample.id: sample for sample in samples}
        images = ImageLogger(logger, by_id, int(log.log_images_every), int(log.log_images_count))
        hooks.append(lambda info: images(info.step, info.batch))
    if int(s.validation.every) > 0 and state.accelerator.is_main_process:
        use_ema = ema if s.validation.use_ema else None
        hooks.append(_validation_hook(s, state, source, samples, scheduler, logger, run_dir, use_ema))
    if extra is not None:
        hooks.append(extra)
    return hooks


def _validation_hook(s: TrainSetup, state: TrainState, source: Any, samples: list, scheduler: Any, logger,
                     run_dir: Path, ema: Ema | None = None):  # fmt: skip
    """Every `validation.every` steps, sample the validation inputs as inference does; save (`run_dir/validation`;
    with `validation.step_counts`, `run_dir/validation/steps-N` per count), measure and log them.

    Builds the VAE (its decoder decodes the samples); the inputs come through the run's source.
    """
    from qie.stages.settings import sampling_options
    from qie.stages.validation import validation_inputs, validation_references, validation_samples
    from qie.training.validation import Validator

    v, accelerator, spec = s.validation, state.accelerator, s.spec
    options = sampling_options(
        s.predict, negative_prompt=v.negative_prompt, true_cfg_scale=v.true_cfg_scale,
        num_inference_steps=v.num_inference_steps, seed=v.seed,
    )  # fmt: skip
    vae_parts = load_parts(s.model, ["vae"], {"vae": str(accelerator.device)}, spec)
    chosen = validation_samples(v, samples, int(s.logging.log_images_count))
    inputs, negatives = validation_inputs(source, chosen, options.negative_prompt)
    references, out = validation_references(chosen, spec), run_dir / "validation"

    def validator(options: Any, name: str) -> Validator:
        return Validator(inputs, negatives, scheduler, vae_parts.vae, logger, options, spec, out / name, references,
                         vae_parts.pipeline_config, f"validation/{name}" if name else "validation")  # fmt: skip

    counts = [int(n) for n in v.step_counts or []]
    validators = [validator(replace(options, num_inference_steps=n), f"steps-{n}") for n in counts]
    validators = validators or [validator(options, "")]
    every = int(v.every)

    def hook(info: StepInfo) -> None:
        if info.step % every == 0:
            with ema.applied() if ema is not None else contextlib.nullcontext():  # sample with the average
                for validator in validators:
                    validator(info.step, accelerator.unwrap_model(state.model))

    return hook
