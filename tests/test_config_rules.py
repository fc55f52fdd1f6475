"""The rules a config's settings keep that need no model loaded (`qie.checks.rules`, and an objective's `use_problem`):
`qie.checks.validate` refuses a config that breaks one, in one line, before any stage builds anything."""

from __future__ import annotations

from functools import cache

import pytest
from omegaconf import DictConfig

from qie.checks import compose, validate
from qie.config import updated
from qie.errors import ConfigError

INITS = "['true', 'false', 'gaussian', 'eva', 'olora', 'pissa', 'corda', 'loftq', 'orthogonal', 'mica']"
TEXT_ALONE = "reference dropout is for the models that also edit from text alone (Edit-Plus, 2511, Qwen-Image-2.1)"

# (stage, model, the keys set on a config that passes, the message validate gives)
DPO = {"_target_": "qie.training.objectives.dpo.Dpo"}
DISTILL = {"_target_": "qie.training.objectives.distill.Distill"}

CASES = [
    # train.mode, train.lora.init and the options of train.adapter's kind
    (
        "train",
        "tiny",
        {"train.mode": "full", "train.init_lora": "/runs/a/lora"},
        "train.init_lora needs train.mode=lora (it names a LoRA to go on training)",
    ),
    (
        "train",
        "tiny",
        {"train.lora.init": "runs/lora.safetensors"},
        f"train.lora.init='runs/lora.safetensors' is not one of peft's initialisations {INITS} (to start from a LoRA "
        "file, use train.init_lora=PATH)",
    ),
    (
        "train",
        "tiny",
        {"train.adapter": "loha", "train.lora.use_dora": True},
        "train.lora.use_dora=true is for train.adapter=lora, not loha",
    ),
    (
        "train",
        "tiny",
        {"train.adapter": "lokr", "train.lora.dropout": 0.1},
        "train.lora.dropout is for train.adapter=lora; set it to 0 with train.adapter=lokr",
    ),
    (
        "train",
        "tiny",
        {"train.adapter": "loha", "train.lora.init": "pissa"},
        "train.lora.init='pissa' is for train.adapter=lora; loha takes true or false",
    ),
    # train.mask
    (
        "train",
        "tiny",
        {"train.mask.source": "file", "train.mask.outside_weight": 2},
        "train.mask.outside_weight=2.0 is out of range: give a value from 0 to 1",
    ),
    (
        "train",
        "tiny",
        {"train.mask.source": "edit", "train.mask.threshold": 1.5},
        "train.mask.threshold=1.5 is out of range: give a value from 0 to 1",
    ),
    (
        "train",
        "tiny",
        {"train.mask.source": "edit", "train.mask.dilation": -1},
        "train.mask.dilation=-1 is out of range: give a value from 0 to 1000000",
    ),
    (
        "train",
        "tiny_t2i",
        {"train.mask.source": "edit"},
        "train.mask.source=edit compares each target with its control image, and model=tiny_t2i takes none: use "
        "train.mask.source=file",
    ),
    # data.control_dropout_rate (precompute caches the text-only prompts it trains on)
    (
        "train",
        "tiny_plus",
        {"data.control_dropout_rate": 1.5},
        "data.control_dropout_rate=1.5 is out of range: give a value from 0 to 1",
    ),
    (
        "train",
        "tiny",
        {"data.control_dropout_rate": 0.5},
        f"data.control_dropout_rate: model=tiny needs a control image in every sample; {TEXT_ALONE}",
    ),
    (
        "precompute",
        "tiny_t2i",
        {"data.control_dropout_rate": 0.5},
        f"data.control_dropout_rate: model=tiny_t2i takes no control images; {TEXT_ALONE}",
    ),
    # train.ema and validation.use_ema
    (
        "train",
        "tiny",
        {"train.ema.decay": 1.5},
        "train.ema.decay=1.5 is out of range: 0 (off) or a value below 1, e.g. 0.999",
    ),
    (
        "train",
        "tiny",
        {"train.ema.decay": 0.9, "train.ema.every": 0},
        "train.ema.every=0: give a number of optimizer steps, 1 or more",
    ),
    (
        "train",
        "tiny",
        {"train.ema.decay": 0.9, "train.mode": "full"},
        "train.ema averages LoRA weights: it needs train.mode=lora",
    ),
    (
        "train",
        "tiny",
        {"train.ema.decay": 0.9, "train.fsdp": True},
        "train.ema does not work with train.fsdp=true (each process holds only its shards)",
    ),
    (
        "train",
        "tiny",
        {"validation.use_ema": True},
        "validation.use_ema=true needs an EMA: set train.ema.decay (e.g. 0.999)",
    ),
    # data.regularization
    (
        "train",
        "tiny",
        {"data.regularization.path": "/data/reg", "data.regularization.weight": -1},
        "data.regularization.weight=-1.0 is out of range: give 0 or more",
    ),
    (
        "precompute",
        "tiny",
        {"data.regularization.path": "/data/reg", "data.regularization.ratio": 1},
        "data.regularization.ratio=1.0 is out of range: give the share of steps, above 0 and below 1",
    ),
    # the memory levers
    (
        "train",
        "tiny",
        {"train.blocks_to_swap": 4},
        "train.blocks_to_swap=4 needs train.gradient_checkpointing=true: without it the backward pass keeps every "
        "block's weights on the GPU, and swapping saves nothing",
    ),
    (
        "train",
        "tiny",
        {"train.blocks_to_swap": 4, "train.gradient_checkpointing": True, "train.mode": "full"},
        "train.blocks_to_swap works with train.mode=lora only: full fine-tuning updates the weights that swapping "
        "keeps in CPU memory; shard them over several GPUs with train.fsdp=true instead",
    ),
    (
        "train",
        "tiny",
        {"train.blocks_to_swap": 4, "train.gradient_checkpointing": True, "train.fsdp": True},
        "train.fsdp=true and train.blocks_to_swap cannot be combined: choose one",
    ),
    (
        "train",
        "tiny",
        {"train.fsdp": True, "model.quantize": "fp8"},
        "train.fsdp=true shards plain weights; model.quantize=fp8 weights (optimum-quanto tensors) cannot be sharded: "
        "set model.quantize=none (sharding divides the bf16 weights by the GPU count)",
    ),
    # the precompute and caption stages' counts
    (
        "precompute",
        "tiny",
        {"precompute.batch_size": 0},
        "precompute.batch_size=0 is out of range: it must be at least 1",
    ),
    (
        "precompute",
        "tiny",
        {"precompute.teachers": True},
        "precompute.teachers=true computes an objective's targets ahead of training, and FlowMatching "
        "(train.objective) computes none: give the training run's overrides (e.g. train/objective=distill)",
    ),
    ("caption", "tiny", {"caption.batch_size": 0}, "caption.batch_size=0 is out of range: it must be at least 1"),
    (
        "caption",
        "tiny",
        {"caption.max_new_tokens": 0},
        "caption.max_new_tokens=0 is out of range: it must be at least 1",
    ),
    (
        "caption",
        "tiny",
        {"caption.dry_run_samples": 0},
        "caption.dry_run_samples=0 is out of range: it must be at least 1",
    ),
    # predict.merge_to and predict.layers
    ("infer", "tiny", {"predict.merge_to": "/runs/merged"}, "predict.merge_to needs predict.lora: the LoRA to merge"),
    (
        "infer",
        "tiny",
        {"predict.merge_to": "/runs/merged", "predict.lora": "/runs/a/lora", "model.quantize": "int8"},
        "predict.merge_to needs the full-precision transformer: set model.quantize=none",
    ),
    (
        "infer",
        "tiny_t2i",
        {"predict.layers": 2},
        "predict.layers=2: model=tiny_t2i makes one image, not layers; remove it",
    ),
    ("infer", "tiny_qwen_image_layered", {"predict.layers": 0}, "predict.layers=0: set it to 1 or more layers"),
    # validation.prompts with validation.images
    (
        "train",
        "tiny_t2i",
        {"validation.prompts": ["a cat", "a dog"], "validation.images": ["x.png"]},
        "validation.images has 1 entries and validation.prompts 2: give one image (or 'a.png|b.png' for Edit-Plus) "
        "per prompt, or none for text to image",
    ),
    (
        "train",
        "tiny",
        {"validation.prompts": ["a cat"]},
        "validation.prompts[0] comes with 0 control images, but model 'tiny' needs at least 1 (its prompt holds the "
        "image): add a control image, or use an Edit-Plus model (e.g. model=qwen_image_edit_2511), which trains "
        "samples without one on the text-only prompt",
    ),
    (
        "train",
        "tiny_t2i",
        {"validation.prompts": ["a cat"], "validation.images": ["x.png"]},
        "validation.prompts[0] comes with 1 control images, but model 'tiny_t2i' is text-to-image and takes none: use "
        "an edit model (e.g. model=qwen_image_edit_2511) or a data set without control images",
    ),
    # train.objective's own rules (its use_problem) and settings
    (
        "train",
        "tiny",
        {"train.objective": DPO, "train.mode": "full"},
        "train/objective=dpo needs train.mode=lora: its reference is the base model with the adapter turned off (or "
        "train.objective.reference_lora), which training the whole transformer does not keep",
    ),
    (
        "train",
        "tiny_qwen_image_layered",
        {"train.objective": DPO},
        "train/objective=dpo does not train a layered model: a preference pair of layer stacks is not read; use "
        "train/objective=flow_matching",
    ),
    (
        "train",
        "tiny",
        {"train.objective": {**DPO, "beta": 0}},
        "train.objective.beta=0 is out of range: give a value above 0 and at most 1e+06 (e.g. 2000)",
    ),
    (
        "train",
        "tiny",
        {"train.objective": DISTILL, "data.regularization.path": "/data/reg"},
        "train/objective=distill does not mix in data.regularization (the student learns the teacher's outputs, not "
        "targets): remove data.regularization.path",
    ),
    (
        "train",
        "tiny",
        {"train.objective": {**DISTILL, "student_steps": 0}},
        "train.objective.student_steps=0 is out of range: give 1 or more",
    ),
]


@cache
def passing(stage: str, model: str) -> DictConfig:
    """`stage`'s composed config for `model`: one that validate passes."""
    return compose(stage, [f"model={model}"])


@pytest.mark.parametrize(("stage", "model", "values", "message"), CASES, ids=[c[3][:60] for c in CASES])
def test_validate_refuses_what_no_stage_can_run(stage: str, model: str, values: dict, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        validate(updated(passing(stage, model), values))
    assert str(info.value) == message


def test_the_same_overrides_fail_when_composed() -> None:
    """The CLI's path: `compose` (as an entry point's run_stage) validates, so nothing of the stage runs."""
    with pytest.raises(ConfigError) as info:
        compose("train", ["model=tiny_t2i", "train.mask.source=edit"])
    assert str(info.value).startswith("train.mask.source=edit compares each target with its control image")


def test_settings_within_the_rules_pass() -> None:
    within = {"train.mask.source": "edit", "train.mask.outside_weight": 0.5, "data.control_dropout_rate": 0.5,
              "train.ema.decay": 0.99, "validation.use_ema": True, "data.regularization.path": "/data/reg",
              "train.blocks_to_swap": 2, "train.gradient_checkpointing": True, "train.adapter": "loha",
              "validation.prompts": ["a|b"], "validation.images": ["a.png|b.png"]}  # fmt: skip
    validate(updated(passing("train", "tiny_plus"), within))
    validate(updated(passing("infer", "tiny_qwen_image_layered"), {"predict.layers": 3}))


@pytest.mark.parametrize("stage", ["train", "precompute", "infer", "plan"])
def test_a_stage_run_checks_a_config_changed_after_it_was_composed(stage: str, tmp_path) -> None:
    """Code that composes a config, then sets keys on it, reaches the same rules at the stage's edge."""
    import importlib

    bad = {"train": {"data.path": "/data", "train.ema.decay": 1.5},
           "precompute": {"data.path": "/data", "precompute.batch_size": 0},
           "infer": {"predict.merge_to": str(tmp_path / "merged")},
           "plan": {"train.ema.decay": 1.5}}[stage]  # fmt: skip
    cfg = updated(passing(stage, "tiny"), bad)
    with pytest.raises(ConfigError) as info:
        importlib.import_module(f"qie.stages.{stage}").run(cfg, tmp_path)
    assert "\n" not in str(info.value) and not list(tmp_path.iterdir())  # refused before anything was written


def test_each_schema_checks_its_own_ranges_without_a_config() -> None:
    """A group's ranges are its dataclass's own `problem()`: the same one line as validate gives, from the
    dataclass alone (what a stage holds below its edge)."""
    from qie.config.cache import PrecomputeConfig
    from qie.config.data import DataConfig, RegularizationConfig
    from qie.config.model import ModelConfig
    from qie.config.train import EmaConfig, MaskConfig, MaskSource, TrainConfig, ValidationConfig

    refused = [
        (DataConfig(batch_size=0), "data.batch_size=0 is out of range: it must lie in [1, inf]"),
        (TrainConfig(learning_rate=-1.0), "train.learning_rate=-1.0 is out of range: it must lie in [0.0, 3.4e+38]"),
        (ModelConfig(min_control_images=2), "model.max_control_images=1 is out of range: it must lie in [2, inf]"),
        (
            MaskConfig(MaskSource.file, outside_weight=2.0),
            "train.mask.outside_weight=2.0 is out of range: give a value from 0 to 1",
        ),
        (EmaConfig(decay=0.9, every=0), "train.ema.every=0: give a number of optimizer steps, 1 or more"),
        (RegularizationConfig("/reg", weight=-1.0), "data.regularization.weight=-1.0 is out of range: give 0 or more"),
        (
            ValidationConfig(step_counts=[4, 0]),
            "validation.step_counts[1]=0 is out of range: each count must be 1 or more",
        ),
        (PrecomputeConfig(batch_size=0), "precompute.batch_size=0 is out of range: it must be at least 1"),
    ]
    for group, message in refused:
        assert group.problem() == message
    assert MaskConfig(outside_weight=2.0).problem() is None  # no masks: their settings are not read


def test_a_stage_without_a_group_skips_its_rules() -> None:
    """The rules read the groups a stage has (`Groups`: None for the others): an extract config has no `train`,
    `predict` or `validation`, and passes with the settings of the ones it has."""
    from qie.checks.rules import setting_problem
    from qie.checks.weights import weight_problem
    from qie.config.groups import Groups
    from qie.config.model import ModelConfig, Quantize

    groups = Groups(model=ModelConfig(name="m", pretrained_model_name_or_path="hub/id", quantize=Quantize.int4))
    assert weight_problem(groups) is None and setting_problem(groups, None) is None
    validate(compose("extract_lora", ["model=tiny"]))
