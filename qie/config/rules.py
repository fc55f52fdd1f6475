"""How a composed config's settings go together, and with the model's family: the rules `qie.config.validate` checks
beyond the schema and the plain ranges, with nothing loaded and no file read.

The model's family and control-image counts come from its spec (`qie.models.model_spec`), which is made of the
`model` group alone. Each rule gives the first problem it finds as one line, the message a user sees, or None; a
group a stage does not have is not checked. Rules that need the data, a file's contents or the built model stay
where those are read.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from omegaconf import DictConfig, OmegaConf

# peft's `init_lora_weights` names (peft/tuners/lora/config.py), what `train.lora.init` takes; "pissa_niter_N" too.
LORA_INITS = ("true", "false", "gaussian", "eva", "olora", "pissa", "corda", "loftq", "orthogonal", "mica")


def setting_problem(cfg: DictConfig, spec: Any) -> str | None:
    """The first rule `cfg`'s settings break, in the order a user fixes them (None: they keep every one).

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
        _cache,
        _caption,
        _predict,
        _validation,
        _demo,
    )
    return next((problem for check in checks if (problem := check(cfg, spec))), None)


def trains_lora(cfg: DictConfig) -> bool:
    """Whether `cfg` trains a LoRA (`train.mode=lora`), not the whole transformer."""
    return _get(cfg, "train.mode", "lora") != "full"


def objective_options(train: Any) -> dict:
    """The objective's own settings (`train.objective`'s keys but `_target_`) as plain values, of the `train` group
    as a config node or as its schema's dataclass."""
    node = train.objective
    if OmegaConf.is_config(node):
        node = OmegaConf.to_container(node, resolve=True)
    return {k: v for k, v in dict(node).items() if k != "_target_"} if isinstance(node, Mapping) else {}


def _get(cfg: DictConfig, key: str, default: Any = None) -> Any:
    return OmegaConf.select(cfg, key, default=default)


def _mode(cfg: DictConfig, spec: Any) -> str | None:
    """`train.mode` with `train.init_lora`, `train.lora.init` and the options `train.adapter`'s kind has."""
    if not trains_lora(cfg):
        if _get(cfg, "train.init_lora"):
            return "train.init_lora needs train.mode=lora (it names a LoRA to go on training)"
        return None
    init = str(_get(cfg, "train.lora.init", "true"))
    if init.lower() not in LORA_INITS and not init.lower().startswith("pissa_niter_"):
        hint = " (to start from a LoRA file, use train.init_lora=PATH)" if "/" in init or "." in init else ""
        return f"train.lora.init={init!r} is not one of peft's initialisations {list(LORA_INITS)}{hint}"
    kind = str(_get(cfg, "train.adapter", "lora"))  # the schema's enum: lora, loha or lokr
    if kind == "lora":
        return None
    if _get(cfg, "train.lora.use_dora", False):
        return f"train.lora.use_dora=true is for train.adapter=lora, not {kind}"
    if float(_get(cfg, "train.lora.dropout", 0.0)):
        return f"train.lora.dropout is for train.adapter=lora; set it to 0 with train.adapter={kind}"
    if init.lower() not in ("true", "false"):
        return f"train.lora.init={init!r} is for train.adapter=lora; {kind} takes true or false"
    return None


def _mask(cfg: DictConfig, spec: Any) -> str | None:
    """`train.mask`: its ranges, and `source=edit` only for a model that takes control images."""
    source = _get(cfg, "train.mask.source")
    if source is None or source == "none":
        return None
    for name, v, low, high in (
        ("outside_weight", float(_get(cfg, "train.mask.outside_weight")), 0, 1),
        ("threshold", float(_get(cfg, "train.mask.threshold")), 0, 1),
        ("dilation", int(_get(cfg, "train.mask.dilation")), 0, 10**6),
    ):
        if not low <= v <= high:
            return f"train.mask.{name}={v} is out of range: give a value from {low} to {high}"
    if source == "edit" and spec is not None and spec.max_control_images == 0:
        return (
            f"train.mask.source=edit compares each target with its control image, and model={spec.name} takes "
            "none: use train.mask.source=file"
        )
    return None


def _control_dropout(cfg: DictConfig, spec: Any) -> str | None:
    """`data.control_dropout_rate`: from 0 to 1, and above 0 only for a model that also edits from text alone."""
    rate = _get(cfg, "data.control_dropout_rate")
    if rate is None:
        return None
    rate = float(rate)
    if not 0.0 <= rate <= 1.0:
        return f"data.control_dropout_rate={rate} is out of range: give a value from 0 to 1"
    if rate and spec is not None and (spec.max_control_images == 0 or spec.min_control_images > 0):
        why = "takes no control images" if spec.max_control_images == 0 else "needs a control image in every sample"
        return (
            f"data.control_dropout_rate: model={spec.name} {why}; reference dropout is for the models that also "
            "edit from text alone (Edit-Plus, 2511, Qwen-Image-2.1)"
        )
    return None


def _ema(cfg: DictConfig, spec: Any) -> str | None:
    """`train.ema` against the mode and FSDP, and `validation.use_ema` against it."""
    decay = _get(cfg, "train.ema.decay")
    if decay is None:
        return None
    decay, every = float(decay), int(_get(cfg, "train.ema.every", 1))
    if not 0.0 <= decay < 1.0:
        return f"train.ema.decay={decay} is out of range: 0 (off) or a value below 1, e.g. 0.999"
    if decay and every < 1:
        return f"train.ema.every={every}: give a number of optimizer steps, 1 or more"
    if decay and not trains_lora(cfg):
        return "train.ema averages LoRA weights: it needs train.mode=lora"
    if decay and _get(cfg, "train.fsdp", False):
        return "train.ema does not work with train.fsdp=true (each process holds only its shards)"
    if _get(cfg, "validation.use_ema", False) and not decay:
        return "validation.use_ema=true needs an EMA: set train.ema.decay (e.g. 0.999)"
    return None


def _regularization(cfg: DictConfig, spec: Any) -> str | None:
    """`data.regularization`, where it has a path: a weight of 0 or more, a share of the steps inside (0, 1)."""
    if not _get(cfg, "data.regularization.path"):
        return None
    weight, ratio = float(_get(cfg, "data.regularization.weight")), float(_get(cfg, "data.regularization.ratio"))
    if weight < 0:
        return f"data.regularization.weight={weight} is out of range: give 0 or more"
    if not 0.0 < ratio < 1.0:
        return f"data.regularization.ratio={ratio} is out of range: give the share of steps, above 0 and below 1"
    return None


def _memory(cfg: DictConfig, spec: Any) -> str | None:
    """The memory levers of `train` (block swap, checkpointing, FSDP) against each other, the mode and the
    weights' quantization."""
    swap = int(_get(cfg, "train.blocks_to_swap", 0))
    checkpointing, fsdp = bool(_get(cfg, "train.gradient_checkpointing", False)), bool(_get(cfg, "train.fsdp", False))
    quantize = str(_get(cfg, "model.quantize", "none"))
    if swap and not checkpointing:
        return (
            f"train.blocks_to_swap={swap} needs train.gradient_checkpointing=true: without it the backward pass "
            "keeps every block's weights on the GPU, and swapping saves nothing"
        )
    if swap and not trains_lora(cfg):
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


def _precompute(cfg: DictConfig, spec: Any) -> str | None:
    """`precompute.batch_size`; `precompute.teachers` only with an objective that computes targets ahead of training
    (`PrecomputesTargets`: distillation's teacher outputs)."""
    size = _get(cfg, "precompute.batch_size")
    if size is not None and int(size) < 1:
        return f"precompute.batch_size={size} is out of range: it must be at least 1"
    if not _get(cfg, "precompute.teachers", False):
        return None
    objectives = importlib.import_module("qie.training.objectives")
    cls = objectives.objective_class(OmegaConf.to_container(cfg.train.objective, resolve=True))
    if issubclass(cls, objectives.PrecomputesTargets):
        return None
    return (
        f"precompute.teachers=true computes an objective's targets ahead of training, and {cls.__qualname__} "
        "(train.objective) computes none: give the training run's overrides (e.g. train/objective=distill)"
    )


def _cache(cfg: DictConfig, spec: Any) -> str | None:
    """`cache.local_max_gb`: unset (no limit) or a size above 0."""
    size = _get(cfg, "cache.local_max_gb")
    if size is not None and not 0 < float(size) < float("inf"):
        return (
            f"cache.local_max_gb={size} is out of range: give the node-local copy's limit in GiB, above 0 (e.g. 500), "
            "or leave it unset for no limit"
        )
    return None


def _demo(cfg: DictConfig, spec: Any) -> str | None:
    """The demo's data set: at least one training and one held-out sample, images of 16 px or more a side (the
    synthetic shapes need the room)."""
    for key, low in (("train_samples", 1), ("heldout_samples", 1), ("image_size", 16), ("threads", 0)):
        value = _get(cfg, f"demo.{key}")
        if value is not None and int(value) < low:
            return f"demo.{key}={value} is out of range: it must be at least {low}"
    return None


def _caption(cfg: DictConfig, spec: Any) -> str | None:
    """The caption stage's counts: each at least 1."""
    for key in ("batch_size", "max_new_tokens", "dry_run_samples"):
        count = _get(cfg, f"caption.{key}")
        if count is not None and int(count) < 1:
            return f"caption.{key}={count} is out of range: it must be at least 1"
    return None


def _predict(cfg: DictConfig, spec: Any) -> str | None:
    """`predict.merge_to` (a LoRA to merge into plain weights) and `predict.layers` against the model's outputs."""
    if _get(cfg, "predict.merge_to"):
        if not _get(cfg, "predict.lora"):
            return "predict.merge_to needs predict.lora: the LoRA to merge"
        if _get(cfg, "model.quantize", "none") != "none":
            return "predict.merge_to needs the full-precision transformer: set model.quantize=none"
    return None if spec is None else spec.family.outputs.option_problem(spec.name, _get(cfg, "predict.layers"))


def _validation(cfg: DictConfig, spec: Any) -> str | None:
    """`validation.prompts` with `validation.images`: one entry per prompt (or none), each with as many images as
    the model takes (an Edit-Plus entry joins its images with '|')."""
    prompts = list(_get(cfg, "validation.prompts") or [])
    if not prompts:
        return None
    given = list(_get(cfg, "validation.images") or [])
    images = given or [""] * len(prompts)
    if len(images) != len(prompts):
        return (
            f"validation.images has {len(given)} entries and validation.prompts {len(prompts)}: give one image "
            "(or 'a.png|b.png' for Edit-Plus) per prompt, or none for text to image"
        )
    for i, image in enumerate(images):
        count = len([p for p in str(image).split("|") if p])
        if spec is not None and (problem := spec.control_problem(count)):
            return f"validation.prompts[{i}] comes with {problem}"
    return None
