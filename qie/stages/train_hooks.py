"""What the train stage runs after each optimizer step: the EMA update, image logging and validation sampling."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qie.components import LoadSettings, load_parts
from qie.errors import QieError
from qie.training.ema import Ema
from qie.training.logging import ImageLogger
from qie.training.loop import StepInfo, TrainState

REWARDS_FILE = "rewards.jsonl"  # in the validation folder: the rewards' means at each validation
# Steps in a row whose groups of edits all scored alike (`reward_std` 0) after which online RL stops: it learns nothing.
ZERO_SPREAD_STEPS = 20

if TYPE_CHECKING:
    from qie.stages.train_setup import TrainSetup


@dataclass(frozen=True, kw_only=True)
class HookInputs:
    """What the step hooks read of a training run: its setup, state, embedding source, the samples trained on and
    the held-out ones, the noise scheduler, the metrics logger, the run folder and the EMA weights (or None)."""

    setup: TrainSetup
    state: TrainState
    source: Any
    samples: list
    heldout: list
    scheduler: Any
    logger: Any
    run_dir: Path
    ema: Ema | None = None


def step_hooks(run: HookInputs, extra: Callable[[StepInfo], None] | None) -> list:
    """What runs after each optimizer step: the EMA update, the check that an online-RL reward tells edits apart,
    image logging, validation sampling, and `extra`."""
    s, ema = run.setup, run.ema
    hooks = [lambda info: ema.update(info.step)] if ema is not None else []
    hooks.append(ZeroSpread(reward_named(s.train.objective)))
    log = s.logging
    if log.log_images:
        by_id = {sample.id: sample for sample in run.samples}
        images = ImageLogger(run.logger, by_id, int(log.log_images_every), int(log.log_images_count))
        hooks.append(lambda info: images(info.step, info.batch))
    if s.validation.every > 0 and run.state.accelerator.is_main_process:
        hooks.append(_validation_hook(run, ema if s.validation.use_ema else None))
    if extra is not None:
        hooks.append(extra)
    return hooks


def reward_named(objective: Any) -> str:
    """How messages name the objective's reward: its `_target_` where the objective has one."""
    reward = objective.get("reward") if isinstance(objective, dict) else None
    target = reward.get("_target_") if isinstance(reward, dict) else None
    return f"train.objective.reward ({target})" if target else "the objective's reward"


class ZeroSpread:
    """Online RL learns only from rewards that differ within a group (its advantages): a step whose groups all scored
    alike (`reward_std` 0 in the objective's measures, alike on every process) is said once, and after
    `ZERO_SPREAD_STEPS` such steps in a row the run stops (its state kept) naming the reward."""

    def __init__(self, reward: str, limit: int = ZERO_SPREAD_STEPS) -> None:
        self.reward, self.limit, self.run, self.warned = reward, limit, 0, False

    def __call__(self, info: StepInfo) -> None:
        spread = info.metrics.get("reward_std")
        if spread is None:
            return
        self.run = self.run + 1 if spread == 0 else 0
        if self.run == 1 and not self.warned:
            self.warned = True
            print(
                f"qie: warning: step {info.step}: {self.reward} scored every edit of each group alike, so this step "
                "learned nothing (its advantages are 0)",
                flush=True,
            )
        if self.run >= self.limit:
            raise QieError(
                f"{self.reward} scored every edit of each group alike for {self.run} steps in a row (reward_std 0): "
                "online RL learns nothing from it; check that the reward reads the edits (a constant or a broken "
                "reward), or draw more varied edits (a larger train.objective.group_size or noise_level)"
            )


def _validation_hook(run: HookInputs, ema: Ema | None):
    """Every `validation.every` steps, sample the validation inputs as inference does; save (`run_dir/validation`;
    with `validation.step_counts`, `run_dir/validation/steps-N` per count), measure and log them; with
    `validation.rewards`, score the first count's images (`RewardLog`), on the held-out rows where there are some.

    Builds the VAE (its decoder decodes the samples); the inputs come through the run's source.
    """
    from qie.stages.settings import sampling_options
    from qie.stages.validation import validation_inputs, validation_references, validation_samples
    from qie.training.validation import Validator

    s, state, logger = run.setup, run.state, run.logger
    v, accelerator, spec = s.validation, state.accelerator, s.spec
    options = sampling_options(
        s.predict,
        negative_prompt=v.negative_prompt,
        true_cfg_scale=v.true_cfg_scale,
        num_inference_steps=v.num_inference_steps,
        seed=v.seed,
    )
    vae_parts = load_parts(LoadSettings.of(s.model), spec, ["vae"], {"vae": str(accelerator.device)})
    chosen = validation_samples(v, run.samples, s.logging.log_images_count)
    if v.rewards and run.heldout and not v.prompts:  # rewards measure rows kept out of training
        chosen = run.heldout
    inputs, negatives = validation_inputs(run.source, chosen, options.negative_prompt)
    references, out = validation_references(chosen, spec), run.run_dir / "validation"

    def validator(options: Any, name: str) -> Validator:
        return Validator(
            inputs,
            negatives,
            scheduler=run.scheduler,
            vae=vae_parts.vae,
            logger=logger,
            options=options,
            spec=spec,
            out_dir=out / name,
            references=references,
            pipeline_config=vae_parts.pipeline_config,
            tag=f"validation/{name}" if name else "validation",
        )

    counts = [int(n) for n in v.step_counts or []]
    validators = [validator(replace(options, num_inference_steps=n), f"steps-{n}") for n in counts]
    validators = validators or [validator(options, "")]
    every, scoring = v.every, RewardLog(s, chosen, out) if v.rewards else None

    def hook(info: StepInfo) -> None:
        if info.step % every == 0:
            with ema.applied() if ema is not None else contextlib.nullcontext():  # sample with the average
                for n, validator in enumerate(validators):
                    images = validator(info.step, accelerator.unwrap_model(state.model))
                    if n == 0 and scoring is not None:
                        scoring(info.step, images[:: max(1, options.num_images)], logger)

    return hook


class RewardLog:
    """Scores validation images with `validation.rewards` (each input's first image against its sample's target and
    edit region, as the eval stage scores); logs the means as validation/<name> and appends them (with each reward's
    direction) to `<folder>/rewards.jsonl`."""

    def __init__(self, s: TrainSetup, samples: list, folder: Path) -> None:
        from qie.evaluation.build import build_rewards

        self.rewards = build_rewards(s.validation.rewards, "validation.rewards", model=s.model)
        self.samples, self.spec, self.file = samples, s.spec, folder / REWARDS_FILE
        self.timeout = s.validation.reward_timeout

    def __call__(self, step: int, images: list, logger) -> dict[str, float | None]:
        from qie.evaluation.image_metrics import to_tensor
        from qie.evaluation.reward import direction
        from qie.evaluation.rows import reference_row
        from qie.evaluation.scoring import mean, score_row

        scores = []
        for sample, image in zip(self.samples, images):
            row = reference_row(sample, image.size, self.spec, None)
            scores.append(score_row(self.rewards, to_tensor(image).float(), row, "validation.rewards", self.timeout))
        means = {name: mean([score[name] for score in scores]) for name in self.rewards}
        logger.log_scalars({f"validation/{k}": v for k, v in means.items() if v is not None}, step)
        directions = {name: direction(reward) for name, reward in self.rewards.items()}
        self.file.parent.mkdir(parents=True, exist_ok=True)
        with open(self.file, "a", encoding="utf-8") as f:
            f.write(json.dumps({"step": step, "mean": means, "directions": directions}) + "\n")
        return means


def search_result(validation: Any, run_dir: Path) -> dict[str, Any]:
    """What the train stage adds to its result for `validation.search_metric`: the metric's name, its last
    validation's value (`validation_<name>`) and `search_value`, what a sweeper minimises (a higher-is-better
    metric negated); {} without one, or on a process that did not validate."""
    name = validation.search_metric
    path = run_dir / "validation" / REWARDS_FILE
    if name is None or not path.is_file():
        return {}
    lines = path.read_text(encoding="utf-8").strip().splitlines()
    last = json.loads(lines[-1]) if lines else {}
    value = last.get("mean", {}).get(name)
    if value is None:
        return {"search_metric": name}
    sign = 1 if last["directions"][name] == "lower" else -1
    return {"search_metric": name, f"validation_{name}": value, "search_value": sign * value}
