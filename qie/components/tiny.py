"""Tiny Qwen-Image-Edit checkpoints made of the real classes, for tests and the demo.

`build_tiny_model` writes a normal diffusers folder (model_index.json, transformer/, vae/,
text_encoder/, tokenizer/, processor/, scheduler/) that `QwenImageEditPipeline.from_pretrained`
(or `QwenImageEditPlusPipeline`) loads with `processor=load_processor(path)`. The same seed gives
bitwise identical weights. The tokenizer is a byte-level BPE trained here, offline, so that the
pipelines' system-prompt prefix is exactly `prompt_template_encode_start_idx` tokens long.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import diffusers
import torch
from diffusers import (
    FlowMatchEulerDiscreteScheduler,
    QwenImageEditPipeline,
    QwenImageEditPlusPipeline,
    QwenImageTransformer2DModel,
)
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2Tokenizer
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

from qie.components.tiny_presets import build_vae, get_preset
from qie.errors import ModelLoadError

PIPELINES: dict[str, type] = {"edit": QwenImageEditPipeline, "edit_plus": QwenImageEditPlusPipeline}
TINY_VERSION = "v1"

# Qwen2.5-VL's special tokens, in Qwen's order; here they take ids 0..13.
SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
]  # fmt: skip
TOKENIZER_VOCAB_CAP = 1024
EDIT_INSTRUCTIONS = [
    "Make the sky blue.", "Remove the red car from the street.", "Add a small hat to the dog.",
    "Change the color of the dress to green.", "Turn the photo into a pencil sketch.",
    "Replace the background with a sandy beach at sunset.", "Put a pair of glasses on the man.",
    "Make it look like winter, with snow on the ground.", "Change the text on the sign to 'OPEN'.",
    "Remove the people in the background.", "Make the cat orange and fluffy.",
    "Rotate the cup so the handle faces left.", "Add soft light from the window on the right.",
    "Make the image brighter and more colorful.", "Turn the house into a wooden cabin.",
    "Give the woman long black hair.", "Replace the apple with a pear.", "Make the water calm and clear.",
    "Put the object from picture 2 on the table in picture 1.", "Keep the face, change the clothes.",
]  # fmt: skip

# Qwen-Image's scheduler/scheduler_config.json.
SCHEDULER_CONFIG: dict[str, Any] = {
    "base_image_seq_len": 256, "base_shift": 0.5, "invert_sigmas": False, "max_image_seq_len": 8192,
    "max_shift": 0.9, "num_train_timesteps": 1000, "shift": 1.0, "shift_terminal": 0.02,
    "stochastic_sampling": False, "time_shift_type": "exponential", "use_beta_sigmas": False,
    "use_dynamic_shifting": True, "use_exponential_sigmas": False, "use_karras_sigmas": False,
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


def _check_variant(variant: str) -> type:
    if variant not in PIPELINES:
        raise ValueError(f"unknown tiny model variant {variant!r}; expected one of {sorted(PIPELINES)}")
    return PIPELINES[variant]


def _template(pipeline_cls: type) -> tuple[str, int]:
    """The pipeline's prompt template and its drop index, read off a component-less instance."""
    pipe = pipeline_cls(None, None, None, None, None, None)
    return pipe.prompt_template_encode, int(pipe.prompt_template_encode_start_idx)


def system_prefix(pipeline_cls: type) -> tuple[str, int]:
    """The template's system-prompt prefix (through "<|im_start|>user\\n") and the drop index."""
    template, drop_idx = _template(pipeline_cls)
    user_start = "<|im_start|>user\n"
    cut = template.rindex(user_start, 0, template.index("{}")) + len(user_start)
    return template[:cut], drop_idx


def _training_corpus() -> list[str]:
    """Both templates and some edit instructions, cut at the special tokens (those are not learned)."""
    special = re.compile("|".join(re.escape(t) for t in SPECIAL_TOKENS))
    texts = [_template(pipeline_cls)[0] for pipeline_cls in PIPELINES.values()]
    texts += [f"Picture {i}: " for i in range(1, 4)] + EDIT_INSTRUCTIONS
    return [part for text in texts for part in special.split(text) if part]


def build_tokenizer() -> Qwen2Tokenizer:
    """Train the tiny byte-level BPE (Qwen2 pre-tokenizer) and wrap it as a `Qwen2Tokenizer`."""
    bpe = Tokenizer(models.BPE())
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_CAP,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(_training_corpus(), trainer)
    model = json.loads(bpe.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    tokenizer = Qwen2Tokenizer(
        vocab=model["vocab"],
        merges=merges,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        extra_special_tokens=SPECIAL_TOKENS[1:],
        model_max_length=32768,
    )
    for pipeline_cls in PIPELINES.values():  # the pipelines' prefix dropping must cut exactly here
        prefix, drop_idx = system_prefix(pipeline_cls)
        if (n := len(tokenizer(prefix)["input_ids"])) != drop_idx:
            raise RuntimeError(
                f"{pipeline_cls.__name__}: system prefix is {n} tokens, pipeline drops {drop_idx}"
            )
    return tokenizer


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


def build_tiny_model(path: str | os.PathLike, variant: str = "edit", seed: int = 0, preset: str = "default") -> Path:
    """Build a tiny Qwen-Image-Edit(-Plus) checkpoint of the sizes `preset` names into `path`; returns it.

    Every preset shares the tokenizer and text encoder; presets differ in the transformer and the VAE
    (random, or trained weights shipped with qie): see `qie.components.tiny_presets`.
    """
    pipeline_cls = _check_variant(variant)
    sizes = get_preset(preset)
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    with _seeded(seed):
        transformer = QwenImageTransformer2DModel(**sizes.transformer)
    with _seeded(seed + 1):
        vae = build_vae(sizes)
    with _seeded(seed + 2):
        text_encoder = Qwen2_5_VLForConditionalGeneration(_text_encoder_config(tokenizer)).eval()
    transformer.save_pretrained(out / "transformer")
    vae.save_pretrained(out / "vae")
    text_encoder.save_pretrained(out / "text_encoder")
    FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG).save_pretrained(out / "scheduler")
    tokenizer.save_pretrained(out / "tokenizer")
    tokenizer.save_pretrained(out / "processor")
    _write_json(out / "processor" / "preprocessor_config.json", IMAGE_PROCESSOR_CONFIG)
    # Like the real repos, also ship a video processor config, which load_processor must ignore.
    video = {k: v for k, v in IMAGE_PROCESSOR_CONFIG.items() if k != "image_processor_type"}
    _write_json(
        out / "processor" / "video_preprocessor_config.json",
        {**video, "video_processor_type": "Qwen2VLVideoProcessor"},
    )
    _write_json(
        out / "model_index.json",
        {
            "_class_name": pipeline_cls.__name__,
            "_diffusers_version": diffusers.__version__,
            "processor": ["transformers", "Qwen2VLProcessor"],
            "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
            "text_encoder": ["transformers", "Qwen2_5_VLForConditionalGeneration"],
            "tokenizer": ["transformers", "Qwen2Tokenizer"],
            "transformer": ["diffusers", "QwenImageTransformer2DModel"],
            "vae": ["diffusers", "AutoencoderKLQwenImage"],
        },
    )
    return out


def _check_existing(path: Path, variant: str) -> Path:
    found = json.loads((path / "model_index.json").read_text(encoding="utf-8")).get("_class_name")
    expected = PIPELINES[variant].__name__
    if found != expected:
        raise ModelLoadError(f"{path} holds a tiny {found} model, not the {expected} one asked for")
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


def ensure_tiny_model(path: str | os.PathLike, variant: str = "edit", seed: int = 0, preset: str = "default") -> Path:
    """Return `path`, building the tiny model there first if it holds no model_index.json.

    The build goes to a temporary sibling folder that is renamed into place at the end, so a
    killed build leaves no half-written model; concurrent callers serialise on a lock file.
    """
    _check_variant(variant)
    get_preset(preset)
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
            build_tiny_model(tmp, variant=variant, seed=seed, preset=preset)
            tmp.chmod(0o755)  # mkdtemp makes it private; the model is a shared cache
            try:
                os.rename(tmp, final)
            except OSError:
                if not (final / "model_index.json").is_file():  # lost a race, but there is no winner
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return _check_existing(final, variant)


def default_tiny_path(variant: str = "edit", preset: str = "default") -> Path:
    """Where the shared tiny model lives: `$QIE_HOME/tiny/<variant>[-<preset>]-v1` (QIE_HOME: ~/.cache/qie)."""
    from qie.config import qie_home

    _check_variant(variant)
    get_preset(preset)
    name = variant if preset == "default" else f"{variant}-{preset}"
    return qie_home() / "tiny" / f"{name}-{TINY_VERSION}"
