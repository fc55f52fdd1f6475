"""Schemas of the `train` group and of the training run's logging and validation."""

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from qie.config.ranges import at_least, first, out_of_range


class TrainMode(StrEnum):
    lora = "lora"
    full = "full"


class Adapter(StrEnum):
    """What `train.mode=lora` trains, through peft; `train.lora` sizes each."""

    lora = "lora"
    loha = "loha"
    lokr = "lokr"


class MixedPrecision(StrEnum):
    auto = "auto"  # bf16 on CUDA when the model is bf16, else no
    no = "no"
    bf16 = "bf16"
    fp16 = "fp16"


class TimestepSampling(StrEnum):
    uniform = "uniform"
    logit_normal = "logit_normal"
    mode = "mode"
    # uniform sigmas passed through the flow shift s*σ/(1+(s-1)σ); `dynamic_shift` picks s from resolution
    shift = "shift"


class LossWeighting(StrEnum):
    none = "none"
    sigma_sqrt = "sigma_sqrt"
    cosmap = "cosmap"


class OnNonfinite(StrEnum):
    """What training does on a NaN or infinite loss: save the last good state and stop, or skip the batch."""

    stop = "stop"
    skip = "skip"


class ReportTo(StrEnum):
    tensorboard = "tensorboard"
    wandb = "wandb"
    none = "none"


class MaskSource(StrEnum):
    """Where loss masks come from: none, mask images (`file`), or where the target differs from its control."""

    none = "none"
    file = "file"
    edit = "edit"


@dataclass
class MaskConfig:
    source: MaskSource = MaskSource.none
    # Loss weight where the mask is black (0..1); white weighs 1.
    outside_weight: float = 0.0
    # source=edit: a pixel changed when a channel differs by more than this (0..1), grown by `dilation` pixels.
    threshold: float = 0.05
    dilation: int = 16

    def problem(self) -> str | None:
        """Where masks are used: the first of its settings out of range, as one line."""
        if self.source == MaskSource.none:
            return None
        for name, v, low, high in (
            ("outside_weight", self.outside_weight, 0, 1),
            ("threshold", self.threshold, 0, 1),
            ("dilation", self.dilation, 0, 10**6),
        ):
            if not low <= v <= high:
                return f"train.mask.{name}={v} is out of range: give a value from {low} to {high}"
        return None


@dataclass
class EmaConfig:
    # 0: no EMA; else each update moves the average by (1 - decay) towards the weights (e.g. 0.999).
    decay: float = 0.0
    every: int = 1  # update every N optimizer steps
    cpu: bool = False  # keep the average in CPU memory

    def problem(self) -> str | None:
        """A decay of 0 (off) or below 1, and a step count from 1 where it is on."""
        if not 0.0 <= self.decay < 1.0:
            return f"train.ema.decay={self.decay} is out of range: 0 (off) or a value below 1, e.g. 0.999"
        if self.decay and self.every < 1:
            return f"train.ema.every={self.every}: give a number of optimizer steps, 1 or more"
        return None


@dataclass
class LoraConfig:
    rank: int = 16
    alpha: int = 16
    dropout: float = 0.0
    # peft's `init_lora_weights`: "true" (B=0), "gaussian", "pissa", ...
    init: str = "true"
    # DoRA (weight-decomposed LoRA, train.adapter=lora only)
    use_dora: bool = False
    # Default: the model's (`model.lora_target_modules`).
    target_modules: list[str] = "${model.lora_target_modules}"  # type: ignore[assignment]


@dataclass
class TrainConfig:
    mode: TrainMode = TrainMode.lora
    # lora, loha or lokr (LyCORIS' LoHa / LoKr through peft), of train.lora's rank, alpha and modules
    adapter: Adapter = Adapter.lora
    max_steps: int = 1000
    # A wall-clock budget from the run's start, in minutes: training stops at the first step boundary past it,
    # saves and exports as at the end (train.resume=latest goes on); null: none.
    max_minutes: float | None = None
    seed: int = 42
    learning_rate: float = 1e-4
    gradient_accumulation_steps: int = 1
    gradient_checkpointing: bool = False
    # Compile the transformer's repeated block with torch.compile (regional compilation, dynamic shapes): the
    # first step compiles (minutes for a real model), later steps run the compiled block.
    compile: bool = False
    # Memory levers (docs/guide.md, "Memory"; `python -m qie.plan` picks them for a GPU size):
    # keep N transformer blocks in pinned CPU memory, copied to the GPU just before they run (LoRA; needs
    # gradient_checkpointing) ...
    blocks_to_swap: int = 0
    # ... keep the activations saved for the backward pass (with checkpointing: the block inputs) in CPU memory ...
    activation_offload: bool = False
    # ... shard the transformer by block over the processes of torchrun / accelerate launch (FSDP2).
    fsdp: bool = False
    mixed_precision: MixedPrecision = MixedPrecision.auto
    max_grad_norm: float = 1.0
    checkpoint_every: int = 500
    checkpoints_total_limit: int | None = None
    # "latest" (newest checkpoint of this run directory) or a checkpoint folder.
    resume: str | None = None
    # Resume even when the checkpoint's RNG state is missing or unreadable (the run is then not an exact
    # continuation); by default that stops the resume.
    resume_inexact: bool = False
    on_nonfinite: OnNonfinite = OnNonfinite.stop
    # Beside the diffusers file, write `comfyui_lora.safetensors` (ComfyUI, DiffSynth-Studio) and
    # `kohya_lora.safetensors` (musubi-tuner, kohya-style loaders); every file is at the trained strength.
    export_comfyui: bool = False
    export_kohya: bool = False
    timestep_sampling: TimestepSampling = TimestepSampling.logit_normal
    logit_mean: float = 0.0
    logit_std: float = 1.0
    mode_scale: float = 1.29
    shift: float = 3.0
    dynamic_shift: bool = False
    loss_weighting: LossWeighting = LossWeighting.none
    # What each step's loss is, a component as the optimizer is: `train/objective=NAME` picks
    # conf/train/objective/NAME.yaml (flow_matching: the family's flow-matching loss with loss masks and
    # regularisation weights; dpo: preference pairs, docs/guide.md "Preference training"; distill: a few-step LoRA
    # from the base's own sampling, "Distillation"), whose `_target_` names the class and whose other keys are its
    # settings (train.objective.beta=...); an objective from outside qie: train.objective._target_=pkg.Cls.
    objective: Any = field(default_factory=lambda: {"_target_": "qie.training.objectives.flow_matching.FlowMatching"})
    lora: LoraConfig = field(default_factory=LoraConfig)
    # Loss masks (docs/guide.md, "Masked and edit-region loss").
    mask: MaskConfig = field(default_factory=MaskConfig)
    # An exponential moving average of the LoRA weights, exported as lora/ema/ (docs/guide.md, "EMA").
    ema: EmaConfig = field(default_factory=EmaConfig)
    # Go on training from this LoRA file (or folder): any file qie.infer reads (diffusers, ComfyUI, kohya/musubi,
    # ai-toolkit). Its rank, alpha and modules replace train.lora's.
    init_lora: str | None = None
    # A preset of the nested `train/optimizer` group (adamw, adamw8bit, adafactor, sgd) or any `_target_`.
    optimizer: Any = field(
        default_factory=lambda: {"_target_": "torch.optim.AdamW", "_partial_": True, "weight_decay": 1e-2}
    )
    lr_scheduler: Any = field(
        default_factory=lambda: {
            "_target_": "transformers.get_constant_schedule_with_warmup",
            "_partial_": True,
            "num_warmup_steps": 0,
        }
    )

    def problem(self) -> str | None:
        """The first of the step counts, the learning rate, the swapped blocks, the checkpoints kept and the LoRA's
        sizes out of range, as one line."""
        limit = self.checkpoints_total_limit
        return first(
            out_of_range("train.max_steps", self.max_steps, 0),
            None if self.max_minutes is None else out_of_range("train.max_minutes", self.max_minutes, 1e-6),
            out_of_range("train.gradient_accumulation_steps", self.gradient_accumulation_steps, 1),
            out_of_range(
                "train.learning_rate", self.learning_rate, 0.0, 3.4e38
            ),  # what a float32 optimizer state holds
            out_of_range("train.max_grad_norm", self.max_grad_norm, 0.0),
            out_of_range("train.blocks_to_swap", self.blocks_to_swap, 0),
            out_of_range("train.checkpoint_every", self.checkpoint_every, 0),
            # Below 1 would delete every checkpoint as it is written: null keeps them all.
            (
                f"train.checkpoints_total_limit={limit} is out of range: keep 1 or more checkpoints, or null to keep "
                "every one"
                if limit is not None and limit < 1
                else None
            ),
            out_of_range("train.lora.rank", self.lora.rank, 1),
            out_of_range("train.lora.alpha", self.lora.alpha, 1),
            out_of_range("train.lora.dropout", self.lora.dropout, 0.0, 0.99),
        )


@dataclass
class RunConfig:
    """Where the run's outputs go besides the run folder (docs/guide.md, "Outputs on an object store")."""

    # s3://BUCKET/PREFIX (any fsspec URL): every checkpoint, the weights, metrics and the run record are uploaded
    # there, and train.resume=latest resumes from its newest complete checkpoint. null: the run folder alone.
    output_url: str | None = None
    # The S3 endpoint (MinIO, R2, a local server) and file system options; by default those of cache=remote.
    endpoint_url: str | None = "${oc.select:cache.backend.endpoint_url,null}"
    storage_options: Any = "${oc.select:cache.backend.storage_options,null}"


@dataclass
class LoggingConfig:
    report_to: ReportTo = ReportTo.tensorboard
    log_every: int = 1
    log_images: bool = False
    log_images_every: int = 100
    log_images_count: int = 4

    def problem(self) -> str | None:
        """Step counts and the image count from 1."""
        counts = [("log_every", self.log_every, 1), ("log_images_every", self.log_images_every, 1)]
        return at_least("logging", [*counts, ("log_images_count", self.log_images_count, 1)])


@dataclass
class ValidationConfig:
    # Sample the validation inputs every N optimizer steps; 0 turns validation off.
    every: int = 0
    # Keep this many samples of data.path out of training and report their loss at fixed noise when it ends
    # (`heldout_loss` in train_result.json): what sweep summaries show and `hydra/sweeper=optuna` minimises.
    heldout_samples: int = 0
    # Sample with the EMA weights (train.ema.decay > 0) instead of the trained ones.
    use_ema: bool = False
    prompts: list[str] = field(default_factory=list)
    images: list[str] = field(default_factory=list)
    # Sampling options; null takes the `predict` group's value (one set of defaults everywhere).
    num_inference_steps: int | None = None
    # Sample at each of these step counts instead (e.g. [4, 8] on a few-step base, `model.fuse_loras`), each into
    # its own `validation/steps-N/`; empty: one count, `num_inference_steps`.
    step_counts: list[int] = field(default_factory=list)
    true_cfg_scale: float | None = None
    negative_prompt: str | None = None
    seed: int | None = None
    # Rewards (as `eval.rewards`: name -> {_target_: a qie.extend.Reward, its keys}) measured on the validation
    # samples' images at each validation, which are then the held-out rows (`heldout_samples`) where there are
    # some and no `prompts`; logged as validation/<name> and to validation/rewards.jsonl.
    rewards: dict[str, Any] = field(default_factory=dict)
    # The reward whose last validation the train stage returns to a sweeper (`hydra/sweeper=optuna` minimises it;
    # a higher-is-better one negated), instead of the held-out loss.
    search_metric: str | None = None
    # Seconds a reward may take to score one validation's images (null: no limit); a stop signal never waits for
    # a reward (`qie.evaluation.reward`).
    reward_timeout: float | None = None

    def problem(self) -> str | None:
        """`every` and `heldout_samples` from 0, step counts from 1 (`step_counts` instead of `num_inference_steps`,
        not beside it), a reward timeout from 0."""
        problem = first(
            out_of_range("validation.every", self.every, 0),
            out_of_range("validation.heldout_samples", self.heldout_samples, 0),
            out_of_range("validation.num_inference_steps", self.num_inference_steps, 1),
            out_of_range("validation.reward_timeout", self.reward_timeout, 0.0),
        )
        if problem:
            return problem
        if self.step_counts and self.num_inference_steps is not None:
            return (
                "validation.step_counts and validation.num_inference_steps are both set: keep one "
                "(step_counts samples at each of its counts)"
            )
        for i, count in enumerate(self.step_counts):
            if count < 1:
                return f"validation.step_counts[{i}]={count} is out of range: each count must be 1 or more"
        return None
