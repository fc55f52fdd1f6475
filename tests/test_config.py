"""The config tree: every root composes with every option of its groups; bad configs fail early."""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from qie.checks import compose, register, validate
from qie.config import typed
from qie.config.tree import conf_dir
from qie.errors import ConfigError

CONF = conf_dir()
ROOT_GROUPS = {
    "precompute": ["model", "data", "cache"],
    "train": ["model", "data", "cache", "train", "train/optimizer", "predict"],
    "infer": ["model", "data", "predict"],
    "cache": ["cache"],
    "plan": ["model", "data", "train", "train/optimizer"],
    "caption": ["model", "data", "cache", "caption"],
    "eval": ["model", "data", "cache", "predict"],
}


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


@pytest.mark.parametrize(
    "stage,group,option",
    [(s, g, o) for s, groups in ROOT_GROUPS.items() for g in groups for o in options(g)],
)
def test_every_root_composes_with_every_option(stage: str, group: str, option: str) -> None:
    package = EXTRA.get((group, option))
    if package and importlib.util.find_spec(package) is None:
        pytest.skip(f"{package} (an optional extra) is not installed")
    cfg = compose(stage, [f"{group}={option}"])
    resolved = OmegaConf.to_container(cfg, resolve=True)
    assert OmegaConf.select(OmegaConf.create(resolved), group.replace("/", ".")) is not None
    if group == "model":
        assert cfg.model.name == option
    if group == "cache":
        assert cfg.cache.name == option and cfg.cache.backend._target_.startswith("qie.cache.")
    if group == "caption":
        assert cfg.caption.name == option


def test_experiment_presets_compose() -> None:
    for option in options("experiment"):
        cfg = compose("train", [f"experiment={option}", *NEEDS.get(("experiment", option), [])])
        assert cfg.train.max_steps > 0


@pytest.mark.parametrize("option", options("experiment"))
def test_the_precompute_a_preset_names_composes_with_it(option: str) -> None:
    """A training run's miss names `python -m qie.precompute experiment=...`: that command composes, with the
    preset's model and its training settings (which `precompute.teachers` reads)."""
    needs = NEEDS.get(("experiment", option), [])
    run = compose("train", [f"experiment={option}", *needs])
    pre = compose("precompute", [f"experiment={option}", *needs])
    assert pre.model == run.model and pre.train == run.train and pre.precompute.teachers is False


@pytest.mark.parametrize(
    "override,expected",
    [
        ("cache=nvme", "cache=nvme is not a preset of cache: choose one of memory, none, remote, ssd"),
        ("train.learning_rate=abc", "could not be converted to Float"),
        ("model.quantize=fp7", "expected one of [none, fp8, int8, int4, nf4]"),
        ("model.dtype=float8", "expected one of [bfloat16, float16, float32]"),
        ("model.foo=1", "unknown key model.foo: valid keys of 'model' are check, dtype"),
        ("+model.foo=1", "unknown key model.foo"),
        ("data.caption_dropout_rate=1.5", "data.caption_dropout_rate=1.5 is out of range"),
        ("train.mixed_precision=fp4", "expected one of [auto, no, bf16, fp16]"),
        ("validation.step_counts=[4,0]", "validation.step_counts[1]=0 is out of range"),
    ],
)
def test_bad_config_fails_naming_key_and_choices(override: str, expected: str) -> None:
    with pytest.raises(ConfigError) as err:
        compose("train", [override])
    assert expected in str(err.value)
    key = override.lstrip("+").split("=")[0]
    assert key in str(err.value) or key.split(".")[0] in str(err.value)


def test_tiny_paths_follow_qie_home(qie_home: Path) -> None:
    cfg = compose("train", ["model=tiny_plus"])
    assert cfg.model.pretrained_model_name_or_path == str(qie_home / "tiny" / "edit_plus-v1")
    assert cfg.model.variant == "edit_plus"
    assert cfg.data.target_pixels == cfg.model.vae_image_pixels == 4096


def test_real_model_presets_carry_their_condition_sizes() -> None:
    edit = compose("infer", ["model=qwen_image_edit"]).model
    plus = compose("infer", ["model=qwen_image_edit_plus"]).model
    assert (edit.vae_image_pixels, edit.vl_image_pixels) == (1024 * 1024, 1024 * 1024)
    assert (plus.vae_image_pixels, plus.vl_image_pixels) == (1024 * 1024, 384 * 384)
    assert plus.max_control_images > edit.max_control_images == 1


def test_unknown_stage() -> None:
    with pytest.raises(ConfigError, match="unknown stage 'fit'"):
        compose("fit")


def test_slurm_launcher_composes() -> None:
    """`hydra/launcher=submitit_slurm` (the `slurm` extra) configures a SLURM sweep of the train stage."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register("train")  # as the train entry point does
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF), version_base=None):
            cfg = hydra_compose(
                "train",
                ["hydra/launcher=submitit_slurm", "hydra.launcher.gpus_per_node=8", "train.learning_rate=3e-4"],
                return_hydra_config=True,
            )
    finally:
        GlobalHydra.instance().clear()
    assert cfg.hydra.launcher._target_.endswith("SlurmLauncher")
    assert cfg.hydra.launcher.gpus_per_node == 8 and cfg.train.learning_rate == 3e-4


# --- every `_target_` of every group option builds ---------------------------------------------------------

# The groups of the train root, nested ones included (the caption stage's own group names no class: composed above).
GROUPS = sorted(
    p.relative_to(CONF).as_posix()
    for p in CONF.rglob("*")
    if p.is_dir() and list(p.glob("*.yaml")) and p.name != "caption"
)
# Where a composed train config may name a class to build, and how the stages build it.
BUILT = {"cache.backend", "train.optimizer", "train.lr_scheduler", "train.objective"}
# Classes an option names besides those (GRPO's reward, built by the objective through the train stage's builder).
# The online objectives build their reward.
ALSO_BUILT = {("train/objective", o): {"train.objective.reward"} for o in ("grpo", "nft", "awm")}
# Options whose class lives in an optional extra (test_memory checks the error when it is missing).
EXTRA = {("train/optimizer", "adamw8bit"): "bitsandbytes"}
# Settings an option needs to build (the remote cache needs a store: fsspec's in-process one will do; the Lightning
# preset a LoRA file to fuse, of which composing checks only that it is there).
NEEDS = {
    ("cache", "remote"): ["cache.backend.url=memory://config-test/cache"],
    ("experiment", "lightning"): [f"model.fuse_loras=[{__file__}]"],
}


def _targets(node: object, path: str = "") -> list[str]:
    """Dotted paths of the config nodes that carry a `_target_`."""
    if not isinstance(node, dict):
        return []
    found = [path] if "_target_" in node else []
    for key, child in node.items():
        found += _targets(child, f"{path}.{key}" if path else str(key))
    return found


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in options(g)])
def test_every_target_of_every_group_option_builds(group: str, option: str, tmp_path: Path) -> None:
    import torch
    from hydra.utils import instantiate

    from qie.cache import CacheBackend
    from qie.config.backend import build_backend

    package = EXTRA.get((group, option))
    if package and importlib.util.find_spec(package) is None:
        pytest.skip(f"{package} (an optional extra) is not installed")
    cfg = compose("train", [f"{group}={option}", *NEEDS.get((group, option), [])])
    assert set(_targets(OmegaConf.to_container(cfg))) == BUILT | ALSO_BUILT.get((group, option), set())
    cfg.cache.dir = str(tmp_path / "cache")
    backend = build_backend(typed(cfg.cache))  # as the stages build it
    assert isinstance(backend, CacheBackend)
    param = torch.nn.Parameter(torch.zeros(3))
    optimizer = instantiate(cfg.train.optimizer)([param], lr=float(cfg.train.learning_rate))
    lr_scheduler = instantiate(cfg.train.lr_scheduler)(optimizer)
    # A schedule with warm-up starts at a learning rate of 0: step until it has risen (at most 100 steps).
    for _ in range(100):
        param.grad = torch.ones(3)
        optimizer.step()
        lr_scheduler.step()
        if not torch.equal(param.detach(), torch.zeros(3)):
            break
    assert isinstance(optimizer, torch.optim.Optimizer) and not torch.equal(param.detach(), torch.zeros(3))
    assert callable(_objective(cfg).loss)


def _objective(cfg):
    """The run's objective, built as the train stage builds it (its scheduler, the model's sampling defaults)."""
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler
    from peft import LoraConfig, inject_adapter_in_model

    from qie.config import typed
    from qie.models import model_spec
    from qie.stages.train_model import objective_reward
    from qie.training.objectives import build_objective
    from qie.training.objectives.run_context import RunContext
    from qie.training.timesteps import SigmaSampling

    spec = model_spec(typed(cfg.model))
    # A model with an adapter, for an objective's reference (the adapter switched off) to be prepared on.
    transformer = inject_adapter_in_model(
        LoraConfig(r=2, target_modules=["0"]), torch.nn.Sequential(torch.nn.Linear(4, 4))
    )
    context = RunContext(
        family=spec.family,
        sigmas=SigmaSampling(),
        scheduler=FlowMatchEulerDiscreteScheduler(),
        sampling_defaults=spec.call_defaults(),
        transformer=transformer,
        rewards=objective_reward,
    )
    return build_objective(typed(cfg.train).objective, context)


def test_a_nested_group_preset_named_with_a_dot_says_how_to_choose_it() -> None:
    with pytest.raises(ConfigError, match=r"train\.optimizer=adafactor is an old spelling: .* train/optimizer=adafac"):
        compose("train", ["train.optimizer=adafactor"])


def test_compose_can_leave_the_checks_to_the_stage_that_runs_the_config() -> None:
    """`checked=False` composes as Hydra does and checks nothing more: the stage's `run` checks it once (the CLI's
    order), and the rebuilt command of a run from code composes its defaults that way."""
    cfg = compose("train", ["train.max_steps=-5"], checked=False)
    assert cfg.train.max_steps == -5
    with pytest.raises(ConfigError, match=r"train\.max_steps=-5 is out of range"):
        validate(cfg)
    with pytest.raises(ConfigError, match="unknown key train.max_step"):
        compose("train", ["train.max_step=5"], checked=False)  # Hydra's own errors stay
