"""Shared fixtures: a private QIE_HOME per test session, the tiny models built once in it, the real config
shrunk for tests, a cached 8-sample data set, and the diffusers pipelines held to the tiny model's sizes."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import CachedData, small_config
from omegaconf import DictConfig


@pytest.fixture(scope="session", autouse=True)
def qie_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    home = Path(os.environ.get("QIE_TEST_HOME") or tmp_path_factory.mktemp("qie_home"))
    os.environ["QIE_HOME"] = str(home)
    return home


@pytest.fixture(scope="session")
def tiny_path(qie_home: Path) -> Path:
    from qie.components.tiny import default_tiny_path, ensure_tiny_model

    return ensure_tiny_model(default_tiny_path("edit"), "edit")


@pytest.fixture(scope="session")
def tiny_plus_path(qie_home: Path) -> Path:
    from qie.components.tiny import default_tiny_path, ensure_tiny_model

    return ensure_tiny_model(default_tiny_path("edit_plus"), "edit_plus")


@pytest.fixture(scope="session")
def tiny_2511_path(qie_home: Path) -> Path:
    from qie.components.tiny import default_tiny_path, ensure_tiny_model

    return ensure_tiny_model(default_tiny_path("edit_2511"), "edit_2511")


@pytest.fixture(scope="session")
def tiny_t2i_path(qie_home: Path) -> Path:
    from qie.components.tiny import default_tiny_path, ensure_tiny_model

    return ensure_tiny_model(default_tiny_path("t2i"), "t2i")


@pytest.fixture(scope="session")
def foreign_parts():
    """Builds pipeline parts of other sizes than qie's tiny presets, with diffusers' and transformers' own
    classes: for folders qie did not build (`Pipeline(tokenizer=..., **parts).save_pretrained(dir)`)."""
    import torch
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from qie.models.qwen_image import SCHEDULER_CONFIG

    def build(tokenizer, **transformer) -> dict:
        pad = tokenizer.pad_token_id
        text = Qwen2_5_VLConfig(
            text_config={"vocab_size": len(tokenizer), "hidden_size": 32, "intermediate_size": 48,
                         "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2,
                         "bos_token_id": pad, "eos_token_id": tokenizer.eos_token_id, "pad_token_id": pad,
                         "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]}},
            vision_config={"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2,
                           "out_hidden_size": 32, "fullatt_block_indexes": [0]},
            image_token_id=tokenizer.convert_tokens_to_ids("<|image_pad|>"),
            video_token_id=tokenizer.convert_tokens_to_ids("<|video_pad|>"),
            vision_start_token_id=tokenizer.convert_tokens_to_ids("<|vision_start|>"),
            vision_end_token_id=tokenizer.convert_tokens_to_ids("<|vision_end|>"),
        )  # fmt: skip
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(11)
            return {
                "scheduler": FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG),
                "vae": AutoencoderKLQwenImage(base_dim=16, z_dim=4, dim_mult=[1, 2, 2], num_res_blocks=1,
                                              temperal_downsample=[False, True], latents_mean=[0.1, -0.2, 0.3, 0.0],
                                              latents_std=[0.9, 1.1, 1.3, 0.7]),
                "text_encoder": Qwen2_5_VLForConditionalGeneration(text).eval(),
                "transformer": QwenImageTransformer2DModel(patch_size=2, in_channels=16, out_channels=4, num_layers=1,
                                                           attention_head_dim=8, num_attention_heads=2,
                                                           joint_attention_dim=32, axes_dims_rope=(2, 2, 4),
                                                           **transformer),
            }  # fmt: skip

    return build


@pytest.fixture(scope="session")
def small_cfg(tiny_path: Path) -> Callable[..., DictConfig]:
    """`small_cfg(stage, *overrides)`: the stage's real config shrunk for tests (see helpers.SHRINK)."""
    return small_config


@pytest.fixture(scope="session")
def cached_data(tiny_path: Path, tmp_path_factory: pytest.TempPathFactory) -> CachedData:
    """Eight 64 px samples of the synthetic task, cached for the tiny model. Tests read it, never write it."""
    from qie.demo.synthetic import make_dataset
    from qie.stages import precompute

    root = tmp_path_factory.mktemp("cached_data")
    make_dataset(root, train=8, heldout=0, size=64)
    data = CachedData(root, root / "train", root / "cache")
    precompute.run(small_config("precompute", *data.overrides), root / "precompute_run")
    return data


@pytest.fixture
def small_conditions(monkeypatch: pytest.MonkeyPatch) -> int:
    """Make the diffusers pipelines resize condition images (and pick output sizes) at the tiny model's
    64x64 area instead of ~1 MP; returns that area."""
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit, pipeline_qwenimage_edit_plus

    area = 64 * 64
    for module in (pipeline_qwenimage_edit, pipeline_qwenimage_edit_plus):
        full = module.calculate_dimensions
        monkeypatch.setattr(module, "calculate_dimensions", lambda _, ratio, full=full: full(area, ratio))
    monkeypatch.setattr(pipeline_qwenimage_edit_plus, "CONDITION_IMAGE_SIZE", area)
    monkeypatch.setattr(pipeline_qwenimage_edit_plus, "VAE_IMAGE_SIZE", area)
    return area


@pytest.fixture(scope="session")
def tiny_demo_path(qie_home: Path) -> Path:
    from qie.components.tiny import default_tiny_path, ensure_tiny_model

    return ensure_tiny_model(default_tiny_path("demo"), "demo")


@pytest.fixture(scope="session")
def tiny21_path(qie_home: Path) -> Path:
    from qie.components.tiny import default_tiny_path, ensure_tiny_model

    return ensure_tiny_model(default_tiny_path("qwen_image_21"), "qwen_image_21")


@pytest.fixture(scope="session")
def tiny_layered_path(qie_home: Path) -> Path:
    from qie.components.tiny import default_tiny_path, ensure_tiny_model

    return ensure_tiny_model(default_tiny_path("qwen_image_layered"), "qwen_image_layered")


@pytest.fixture(scope="session")
def tiny_demo_layered_path(qie_home: Path) -> Path:
    from qie.components.tiny import default_tiny_path, ensure_tiny_model

    return ensure_tiny_model(default_tiny_path("demo_layered"), "demo_layered")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Groups for pytest-xdist's `--dist loadgroup` (the README's test command runs the tests on every core): a
    module's tests stay on one worker, so its module fixtures are built once; the family battery's tests go by
    family, so one worker prepares each family, and its FSDP case (one torchrun over every family) goes apart."""
    for item in items:
        module = item.nodeid.split("::")[0]
        family = getattr(item, "callspec", None) and item.callspec.params.get("family")
        if module.endswith("test_family_battery.py") and family and "fsdp" not in item.name:
            item.add_marker(pytest.mark.xdist_group(f"battery-{family}"))
        else:
            item.add_marker(pytest.mark.xdist_group(module))
