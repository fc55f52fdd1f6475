"""Tiny, randomly initialised checkpoints made of the real classes, for tests, the demo and dry runs.

Each model family names its tiny presets and their builders (`ModelFamily.tiny_presets`, read through
`qie.models.tiny_presets()`); `build_tiny_model(path, preset)` runs the preset's builder and `ensure_tiny_model`
builds one in place once, atomically. The same seed gives bitwise identical weights. `python -m qie.tiny
PRESET DIR` writes one.

This module also holds the Qwen-Image family's builder (`build_qwen_image_tiny`): a normal diffusers folder
(model_index.json, transformer/, vae/, text_encoder/, tokenizer/, scheduler/, and processor/ for the Edit
pipelines) that the preset's pipeline loads with `from_pretrained` (Edit pipelines with
`processor=load_processor(path)`). One generic builder takes the sizes; its presets (`PRESETS`: edit, edit_plus,
edit_2511, t2i, demo) fill in the pipeline and the numbers that differ.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import diffusers
import torch
from diffusers import (
    AutoencoderKLQwenImage,
    FlowMatchEulerDiscreteScheduler,
    QwenImageEditPipeline,
    QwenImageEditPlusPipeline,
    QwenImagePipeline,
    QwenImageTransformer2DModel,
)
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2Tokenizer

from qie.components.tiny_presets import DEMO_TRANSFORMER, DEMO_VAE_CONFIG, DEMO_VAE_FILE, load_shipped_vae
from qie.components.tiny_tokenizer import build_tokenizer, system_prefix
from qie.errors import ModelLoadError
from qie.models import pipeline_parts, tiny_presets
from qie.models.family import import_named

TINY_VERSION = "v1"
EDIT_PIPELINES = (QwenImageEditPipeline, QwenImageEditPlusPipeline)


@dataclass(frozen=True)
class TinyPreset:
    """What one tiny Qwen-Image model is: its pipeline, the pipelines whose templates its tokenizer learns, and
    the transformer config entries that differ from `TRANSFORMER_CONFIG`."""

    pipeline: type
    tokenizer_pipelines: tuple[type, ...]
    transformer: tuple[tuple[str, Any], ...] = ()
    # A VAE config and weights shipped with qie (`qie.components.tiny_presets`) instead of a random VAE.
    vae: tuple[tuple[str, Any], ...] = ()
    vae_weights: str | None = None


PRESETS: dict[str, TinyPreset] = {
    "edit": TinyPreset(QwenImageEditPipeline, EDIT_PIPELINES),
    "edit_plus": TinyPreset(QwenImageEditPlusPipeline, EDIT_PIPELINES),
    # The Edit-Plus weights (same seed), with control tokens at timestep 0 as in Qwen-Image-Edit-2511.
    "edit_2511": TinyPreset(QwenImageEditPlusPipeline, EDIT_PIPELINES, (("zero_cond_t", True),)),
    "t2i": TinyPreset(QwenImagePipeline, (QwenImagePipeline,)),
    # The demo's Edit model: a larger transformer and a VAE trained on the demo's shapes.
    "demo": TinyPreset(
        QwenImageEditPipeline, EDIT_PIPELINES, tuple(DEMO_TRANSFORMER.items()), tuple(DEMO_VAE_CONFIG.items()),
        DEMO_VAE_FILE,
    ),  # fmt: skip
}
# Where each part comes from, as model_index.json names it; a pipeline lists the parts it takes.
MODEL_INDEX: dict[str, list[str]] = {
    "processor": ["transformers", "Qwen2VLProcessor"],
    "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
    "text_encoder": ["transformers", "Qwen2_5_VLForConditionalGeneration"],
    "tokenizer": ["transformers", "Qwen2Tokenizer"],
    "transformer": ["diffusers", "QwenImageTransformer2DModel"],
    "vae": ["diffusers", "AutoencoderKLQwenImage"],
}

# Qwen-Image's scheduler/scheduler_config.json.
SCHEDULER_CONFIG: dict[str, Any] = {
    "base_image_seq_len": 256, "base_shift": 0.5, "invert_sigmas": False, "max_image_seq_len": 8192,
    "max_shift": 0.9, "num_train_timesteps": 1000, "shift": 1.0, "shift_terminal": 0.02,
    "stochastic_sampling": False, "time_shift_type": "exponential", "use_beta_sigmas": False,
    "use_dynamic_shifting": True, "use_exponential_sigmas": False, "use_karras_sigmas": False,
}  # fmt: skip
TRANSFORMER_CONFIG: dict[str, Any] = {
    "patch_size": 2, "in_channels": 16, "out_channels": 4, "num_layers": 2, "attention_head_dim": 16,
    "num_attention_heads": 3, "joint_attention_dim": 16, "guidance_embeds": False,
    "axes_dims_rope": (8, 4, 4),
}  # fmt: skip
Z_DIM = 4
# Fixed, deliberately non-trivial latent statistics so normalisation bugs change results.
LATENTS_MEAN = [-0.35, 0.2, 0.45, -0.1]
LATENTS_STD = [0.6, 1.35, 0.85, 1.2]
VAE_CONFIG: dict[str, Any] = {
    "base_dim": 24, "z_dim": Z_DIM, "dim_mult": [1, 2, 4], "num_res_blocks": 1,
    "temperal_downsample": [False, True], "latents_mean": LATENTS_MEAN, "latents_std": LATENTS_STD,
}  # fmt: skip
TEXT_HIDDEN = 16  # == transformer joint_attention_dim
# Qwen's CLIP normalisation; pixel bounds sized for 64 px test images (56x56 -> 4 image tokens).
IMAGE_PROCESSOR_CONFIG: dict[str, Any] = {
    "do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True,
    "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
    "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2VLProcessor",
    "min_pixels": 56 * 56, "max_pixels": 128 * 128, "merge_size": 2, "patch_size": 14,
    "resample": 3, "rescale_factor": 1 / 255, "temporal_patch_size": 2,
}  # fmt: skip


def preset(variant: str) -> tuple[Any, str]:
    """(family, builder) of the tiny preset named `variant`. Raises ValueError naming the presets for an unknown one."""
    presets = tiny_presets()
    if variant not in presets:
        raise ValueError(f"unknown tiny model variant {variant!r}; expected one of {sorted(presets)}")
    return presets[variant]


def _text_encoder_config(tokenizer: Qwen2Tokenizer) -> Qwen2_5_VLConfig:
    ids = {name: tokenizer.convert_tokens_to_ids(f"<|{name}|>") for name in ("image_pad", "video_pad")}
    start, end = tokenizer.convert_tokens_to_ids(["<|vision_start|>", "<|vision_end|>"])
    text_config = {
        "vocab_size": len(tokenizer), "hidden_size": TEXT_HIDDEN, "intermediate_size": 32,
        "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
        "max_position_embeddings": 4096, "bos_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id,
        # head_dim 8 -> 4 rotary frequencies, split over (temporal, height, width)
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [1, 1, 2]},
    }  # fmt: skip
    vision_config = {
        "depth": 2, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2,
        "out_hidden_size": TEXT_HIDDEN, "patch_size": 14, "spatial_merge_size": 2,
        "temporal_patch_size": 2, "window_size": 112, "fullatt_block_indexes": [1],
    }  # fmt: skip
    return Qwen2_5_VLConfig(
        text_config=text_config,
        vision_config=vision_config,
        image_token_id=ids["image_pad"],
        video_token_id=ids["video_pad"],
        vision_start_token_id=start,
        vision_end_token_id=end,
    )


@contextmanager
def _seeded(seed: int) -> Iterator[None]:
    """Seed torch's CPU RNG for one component without disturbing the caller's RNG state."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def build_tiny_model(path: str | os.PathLike, variant: str = "edit", seed: int = 0) -> Path:
    """Build the tiny random checkpoint of preset `variant` into `path` and return it (the builder its family
    names: "module:function" taking (path, preset, seed))."""
    return import_named(preset(variant)[1])(path, variant, seed)


def build_qwen_image_tiny(path: str | os.PathLike, variant: str = "edit", seed: int = 0) -> Path:
    """The Qwen-Image family's builder: the tiny checkpoint of `PRESETS[variant]` in `path`."""
    spec = PRESETS[variant]
    parts = pipeline_parts(spec.pipeline.__name__)
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(spec.tokenizer_pipelines)
    with _seeded(seed):
        transformer = QwenImageTransformer2DModel(**{**TRANSFORMER_CONFIG, **dict(spec.transformer)})
    with _seeded(seed + 1):
        if spec.vae_weights:
            vae = load_shipped_vae(dict(spec.vae), spec.vae_weights)
        else:
            vae = AutoencoderKLQwenImage(**VAE_CONFIG)
    with _seeded(seed + 2):
        text_encoder = Qwen2_5_VLForConditionalGeneration(_text_encoder_config(tokenizer)).eval()
    transformer.save_pretrained(out / "transformer")
    vae.save_pretrained(out / "vae")
    text_encoder.save_pretrained(out / "text_encoder")
    FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG).save_pretrained(out / "scheduler")
    tokenizer.save_pretrained(out / "tokenizer")
    if "processor" in parts:
        tokenizer.save_pretrained(out / "processor")
        _write_json(out / "processor" / "preprocessor_config.json", IMAGE_PROCESSOR_CONFIG)
        # Like the real repos, also ship a video processor config, which load_processor must ignore.
        video = {k: v for k, v in IMAGE_PROCESSOR_CONFIG.items() if k != "image_processor_type"}
        _write_json(
            out / "processor" / "video_preprocessor_config.json",
            {**video, "video_processor_type": "Qwen2VLVideoProcessor"},
        )
    index = {"_class_name": spec.pipeline.__name__, "_diffusers_version": diffusers.__version__}
    _write_json(out / "model_index.json", {**index, **{name: MODEL_INDEX[name] for name in parts}})
    return out


def _check_existing(path: Path, variant: str) -> Path:
    """`path`, when the model there is the tiny `variant`: one of its family's pipelines (a Qwen-Image preset:
    its own pipeline class and transformer settings)."""
    family, _ = preset(variant)
    found = json.loads((path / "model_index.json").read_text(encoding="utf-8")).get("_class_name")
    if not isinstance(found, str):
        raise ModelLoadError(f"{path / 'model_index.json'}: _class_name is {found!r}, not a pipeline class name: "
                             f"remove {path} to rebuild it")  # fmt: skip
    config = json.loads((path / "transformer" / "config.json").read_text(encoding="utf-8"))
    spec = PRESETS.get(variant)
    if spec is None:
        wanted, overrides = {v.pipeline_class for v in family.variants.values()}, {}
    else:
        wanted, overrides = {spec.pipeline.__name__}, dict(spec.transformer)
    # Compared as JSON stores them (tuples come back as lists).
    differs = {k: config.get(k) for k, v in overrides.items() if config.get(k) != json.loads(json.dumps(v))}
    if found not in wanted or differs:
        raise ModelLoadError(
            f"{path} holds a tiny {found} model {differs or ''}, not the {variant} one asked for "
            f"({' or '.join(sorted(wanted))} {overrides or ''}): remove it to rebuild"
        )
    return path


@contextmanager
def _build_lock(lock_path: Path) -> Iterator[bool]:
    """An exclusive inter-process lock (fcntl); yields False, locking nothing, where fcntl is missing."""
    try:
        import fcntl
    except ImportError:  # not POSIX: rely on the atomic rename alone
        yield False
        return
    with open(lock_path, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield True
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def ensure_tiny_model(path: str | os.PathLike, variant: str = "edit", seed: int = 0) -> Path:
    """Return `path`, building the tiny model there first if it holds no model_index.json.

    The build goes to a temporary sibling folder that is renamed into place at the end, so a
    killed build leaves no half-written model; concurrent callers serialise on a lock file.
    """
    preset(variant)
    final = Path(path)
    if (final / "model_index.json").is_file():
        return _check_existing(final, variant)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp_prefix = f".{final.name}.tmp-"
    with _build_lock(final.parent / f".{final.name}.lock") as exclusive:
        if (final / "model_index.json").is_file():  # another process built it meanwhile
            return _check_existing(final, variant)
        if final.exists():
            if not final.is_dir() or any(final.iterdir()):
                raise ModelLoadError(f"{final} exists but holds no model_index.json; remove it to rebuild")
            final.rmdir()
        if exclusive:  # under the lock, temp folders left here are from killed builds
            for stale in final.parent.glob(f"{tmp_prefix}*"):
                shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=tmp_prefix, dir=final.parent))
        try:
            build_tiny_model(tmp, variant=variant, seed=seed)
            tmp.chmod(0o755)  # mkdtemp makes it private; the model is a shared cache
            try:
                os.rename(tmp, final)
            except OSError:
                if not (final / "model_index.json").is_file():  # lost a race, but there is no winner
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return _check_existing(final, variant)


def default_tiny_path(variant: str = "edit") -> Path:
    """Where the shared tiny model lives: `$QIE_HOME/tiny/<variant>-v1` (QIE_HOME: ~/.cache/qie)."""
    from qie.config import qie_home

    preset(variant)
    return qie_home() / "tiny" / f"{variant}-{TINY_VERSION}"


__all__ = [
    "PRESETS",
    "TinyPreset",
    "build_qwen_image_tiny",
    "build_tiny_model",
    "build_tokenizer",
    "default_tiny_path",
    "ensure_tiny_model",
    "preset",
    "system_prefix",
]
