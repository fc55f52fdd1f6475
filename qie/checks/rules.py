"""How a composed config's settings go together, and with the model's family: the rules `qie.checks.validate` checks
beyond the schema and each group's own ranges (its `problem()`), with nothing loaded and no file read.

The rules are functions over the config's groups read once (`qie.config.groups.Groups`) and plain values: this
module imports no model library. They are asked twice: first without the model's spec (before any model library is
imported, so a mistake is answered in the time Hydra takes; a rule that needs the spec skips that part), then with
it (`qie.models.model_spec`: the model's family and control-image counts, made of the `model` group alone). Each rule
gives the first problem it finds as one line, the message a user sees, or None; a group a stage does not have is not
checked. Rules that need the data, a file's contents or the built model stay where those are read.
"""

from __future__ import annotations

from typing import Any

from qie.config.groups import Groups
from qie.config.train import TrainConfig, TrainMode

# peft's `init_lora_weights` names (peft/tuners/lora/config.py), what `train.lora.init` takes; "pissa_niter_N" too.
LORA_INITS = ("true", "false", "gaussian", "eva", "olora", "pissa", "corda", "loftq", "orthogonal", "mica")


def setting_problem(groups: Groups, spec: Any) -> str | None:
    """The first rule the settings of `groups` break, in the order a user fixes them (None: they keep every one).

    Args:
        spec: the model's `ModelSpec`, or None for a config without a `model` group.
    """
    checks = (
        _mode,
        _mask,
        _control_dropout,
        _ema,
        _regularization,
        _memory,
        _precompute,
        _caption,
        _predict,
        _validation,
        _demo,
        _ranges,
    )
    return next((problem for check in checks if (problem := check(groups, spec))), None)


def trains_lora(train: TrainConfig | None) -> bool:
    """Whether the `train` group trains a LoRA (`train.mode=lora`), not the whole transformer; a stage without one
    trains nothing in full."""
    return train is None or train.mode != TrainMode.full


def late_problem(groups: Groups) -> str | None:
    """The rules checked after the others: fp8 compute against the memory levers, the `validation` group's ranges,
    validation against FSDP, and the searched metric (`search_problem`)."""
    model, train, validation = groups.model, groups.train, groups.validation
    if (
        model is not None
        and model.fp8_compute == "always"
        and train is not None
        and (train.blocks_to_swap or train.fsdp)
    ):
        return (
            "model.fp8_compute=always casts the weights on the GPU, where block swap and FSDP cannot move them: set "
            "model.fp8_compute=auto (optimum-quanto's fp8 weights then) or train.blocks_to_swap=0 and train.fsdp=false"
        )
    if validation is None:
        return None
    if problem := validation.problem():
        return problem
    measured = {"validation.every": validation.every, "validation.heldout_samples": validation.heldout_samples}
    for key, value in measured.items():
        if train is not None and train.fsdp and value:
            return f"{key} needs an unsharded model (the main process measures alone): set {key}=0 with train.fsdp=true"
    return search_problem(groups)


def search_problem(groups: Groups) -> str | None:
    """Why `validation.search_metric` cannot be searched on (one line), or None: it names a reward of
    `validation.rewards`, measured by validation (`validation.every`) at the last step."""
    validation, train = groups.validation, groups.train
    if validation is None or validation.search_metric is None or train is None:
        return None
    name, rewards = validation.search_metric, list(validation.rewards)
    if name not in rewards:
        return f"validation.search_metric={name} is not a reward of validation.rewards ({', '.join(rewards) or 'none'})"
    every, steps = validation.every, train.max_steps
    if every <= 0 or steps % every:
        return (
            f"validation.search_metric={name} is read from the last validation: set validation.every to a "
            f"divisor of train.max_steps={steps} (now {every})"
        )
    return None


def _mode(groups: Groups, spec: Any) -> str | None:
    """`train.mode` with `train.init_lora`, `train.lora.init` and the options `train.adapter`'s kind has."""
    train = groups.train
    if train is None:
        return None
    if not trains_lora(train):
        if train.init_lora:
            return "train.init_lora needs train.mode=lora (it names a LoRA to go on training)"
        return None
    init, kind = train.lora.init, train.adapter  # the adapter: the schema's enum, lora, loha or lokr
    if init.lower() not in LORA_INITS and not init.lower().startswith("pissa_niter_"):
        hint = " (to start from a LoRA file, use train.init_lora=PATH)" if "/" in init or "." in init else ""
        return f"train.lora.init={init!r} is not one of peft's initialisations {list(LORA_INITS)}{hint}"
    if kind == "lora":
        return None
    if train.lora.use_dora:
        return f"train.lora.use_dora=true is for train.adapter=lora, not {kind}"
    if train.lora.dropout:
        return f"train.lora.dropout is for train.adapter=lora; set it to 0 with train.adapter={kind}"
    if init.lower() not in ("true", "false"):
        return f"train.lora.init={init!r} is for train.adapter=lora; {kind} takes true or false"
    return None


def _mask(groups: Groups, spec: Any) -> str | None:
    """`train.mask`: its ranges, and `source=edit` only for a model that takes control images."""
    if groups.train is None:
        return None
    mask = groups.train.mask
    if problem := mask.problem():
        return problem
    if mask.source == "edit" and spec is not None and spec.max_control_images == 0:
        return (
            f"train.mask.source=edit compares each target with its control image, and model={spec.name} takes "
            "none: use train.mask.source=file"
        )
    return None


def _control_dropout(groups: Groups, spec: Any) -> str | None:
    """`data.control_dropout_rate`: from 0 to 1, and above 0 only for a model that also edits from text alone."""
    if groups.data is None:
        return None
    rate = groups.data.control_dropout_rate
    if not 0.0 <= rate <= 1.0:
        return f"data.control_dropout_rate={rate} is out of range: give a value from 0 to 1"
    if rate and spec is not None and (spec.max_control_images == 0 or spec.min_control_images > 0):
        why = "takes no control images" if spec.max_control_images == 0 else "needs a control image in every sample"
        return (
            f"data.control_dropout_rate: model={spec.name} {why}; reference dropout is for the models that also "
            "edit from text alone (Edit-Plus, 2511, Qwen-Image-2.1)"
        )
    return None


def _ema(groups: Groups, spec: Any) -> str | None:
    """`train.ema` against the mode and FSDP, and `validation.use_ema` against it."""
    train = groups.train
    if train is None:
        return None
    if problem := train.ema.problem():
        return problem
    decay = train.ema.decay
    if decay and not trains_lora(train):
        return "train.ema averages LoRA weights: it needs train.mode=lora"
    if decay and train.fsdp:
        return "train.ema does not work with train.fsdp=true (each process holds only its shards)"
    if groups.validation is not None and groups.validation.use_ema and not decay:
        return "validation.use_ema=true needs an EMA: set train.ema.decay (e.g. 0.999)"
    return None


def _regularization(groups: Groups, spec: Any) -> str | None:
    """`data.regularization`, where it has a path: a weight of 0 or more, a share of the steps inside (0, 1)."""
    return None if groups.data is None else groups.data.regularization.problem()


def _memory(groups: Groups, spec: Any) -> str | None:
    """The memory levers of `train` (block swap, checkpointing, FSDP) against each other, the mode and the
    weights' quantization."""
    train = groups.train
    if train is None:
        return None
    swap, fsdp = train.blocks_to_swap, train.fsdp
    quantize = "none" if groups.model is None else groups.model.quantize
    if swap and not train.gradient_checkpointing:
        return (
            f"train.blocks_to_swap={swap} needs train.gradient_checkpointing=true: without it the backward pass "
            "keeps every block's weights on the GPU, and swapping saves nothing"
        )
    if swap and not trains_lora(train):
        return (
            "train.blocks_to_swap works with train.mode=lora only: full fine-tuning updates the weights that "
            "swapping keeps in CPU memory; shard them over several GPUs with train.fsdp=true instead"
        )
    if fsdp and swap:
        return "train.fsdp=true and train.blocks_to_swap cannot be combined: choose one"
    if fsdp and quantize != "none":
        return (
            f"train.fsdp=true shards plain weights; model.quantize={quantize} weights (optimum-quanto tensors) "
            "cannot be sharded: set model.quantize=none (sharding divides the bf16 weights by the GPU count)"
        )
    return None


def _precompute(groups: Groups, spec: Any) -> str | None:
    """`precompute.batch_size` and the group's other ranges (`precompute.teachers` against the objective's class is
    checked with the objective, `qie.checks.components`)."""
    return None if groups.precompute is None else groups.precompute.problem()


def _demo(groups: Groups, spec: Any) -> str | None:
    """The demo's data set: its sample counts, image size and threads."""
    return None if groups.demo is None else groups.demo.problem()


def _ranges(groups: Groups, spec: Any) -> str | None:
    """The ranges of the groups no other rule checks: logging, eval, export and extract."""
    own = (groups.logging, groups.eval, groups.export, groups.extract)
    return next((problem for group in own if group is not None and (problem := group.problem())), None)


def _caption(groups: Groups, spec: Any) -> str | None:
    """The caption stage's counts: each at least 1."""
    return None if groups.caption is None else groups.caption.problem()


def _predict(groups: Groups, spec: Any) -> str | None:
    """`predict.merge_to` (a LoRA to merge into plain weights) and `predict.layers` against the model's outputs."""
    predict = groups.predict
    if predict is not None and predict.merge_to:
        if not predict.lora:
            return "predict.merge_to needs predict.lora: the LoRA to merge"
        if groups.model is not None and groups.model.quantize != "none":
            return "predict.merge_to needs the full-precision transformer: set model.quantize=none"
    layers = None if predict is None else predict.layers
    return None if spec is None else spec.family.outputs.option_problem(spec.name, layers)


def _validation(groups: Groups, spec: Any) -> str | None:
    """`validation.prompts` with `validation.images`: one entry per prompt (or none), each with as many images as
    the model takes (an Edit-Plus entry joins its images with '|')."""
    validation = groups.validation
    if validation is None or not validation.prompts:
        return None
    prompts, given = validation.prompts, validation.images
    images = given or [""] * len(prompts)
    if len(images) != len(prompts):
        return (
            f"validation.images has {len(given)} entries and validation.prompts {len(prompts)}: give one image "
            "(or 'a.png|b.png' for Edit-Plus) per prompt, or none for text to image"
        )
    for i, image in enumerate(images):
        count = len([p for p in image.split("|") if p])
        if spec is not None and (problem := spec.control_problem(count)):
            return f"validation.prompts[{i}] comes with {problem}"
    return None
