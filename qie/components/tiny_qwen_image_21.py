"""A tiny, randomly initialised Qwen-Image-2.1 checkpoint made of the real classes, for tests and dry runs.

`build_tiny_qwen_image_21` writes a diffusers folder (model_index.json, transformer/, vae/, text_encoder/,
processor/, scheduler/) that `QwenImage21Pipeline.from_pretrained(path, processor=load_processor(path,
processor_class=Qwen3VLProcessorNoVideo))` loads. Qwen3-VL reads 16 px patches merged 2x2, so one vision
token covers 32x32 pixels: the 2x2 latent tokens of the 16x VAE that the transformer's image slot stands
for. The tokenizer is a byte-level BPE trained offline on the pipeline's templates, with Qwen's special
tokens and a Qwen-VL chat template (the pipeline derives its drop index from that template).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import diffusers
from diffusers import (
    AutoencoderKLQwenImage21,
    FlowMatchEulerDiscreteScheduler,
    QwenImage21Pipeline,
    QwenImage21Transformer2DModel,
)
from transformers import Qwen2Tokenizer, Qwen3VLConfig, Qwen3VLForConditionalGeneration

from qie.components.tiny import SCHEDULER_CONFIG, _seeded, _write_json
from qie.components.tiny_tokenizer import EDIT_INSTRUCTIONS, train_bpe, without_special_tokens

# Qwen-VL's chat template, reduced to what a prompt of text and images needs.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TEXT_HIDDEN = 16  # == transformer context_in_dim
TRANSFORMER_CONFIG: dict[str, Any] = {
    "patch_size": 1, "in_channels": 64, "out_channels": 64, "num_layers": 2, "attention_head_dim": 16,
    "num_attention_heads": 2, "context_in_dim": TEXT_HIDDEN, "mlp_ratio": 3, "axes_dims_rope": (8, 4, 4),
    "causal_condition": True,
}  # fmt: skip
# 16x down (five levels, four downsamples) as the pipeline assumes; z_dim 64 keeps the real latent statistics.
VAE_CONFIG: dict[str, Any] = {
    "base_dim": 8, "decoder_base_dim": 12, "z_dim": 64, "dim_mult": [1, 2, 2, 2, 2], "num_res_blocks": 1,
    "temperal_downsample": [False, True, True, True], "in_channels": 4, "out_channels": 4,
}  # fmt: skip
# Qwen3-VL's image processor: 16 px patches, 2x2 merge, [-1, 1] normalisation. The pipeline resizes first,
# so the processor must not resize again: max_pixels above any condition area.
IMAGE_PROCESSOR_CONFIG: dict[str, Any] = {
    "do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True,
    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen3VLProcessor",
    "min_pixels": 32 * 32, "max_pixels": 4096 * 4096, "merge_size": 2, "patch_size": 16,
    "resample": 3, "rescale_factor": 1 / 255, "temporal_patch_size": 2,
}  # fmt: skip
# Four steps of the pipeline's default-sigma path (`sample_sigmas` in model_index.json).
SAMPLE_SIGMAS = [1.0, 0.8, 0.55, 0.3]
MAX_REFERENCES = 10


def _templates() -> list[str]:
    """The text of the pipeline's prompt templates (training text for the tokenizer, not read by the pipeline)."""
    system = "Comprehend and analyze the provided prompt."
    images = "".join(f" <image{i}><|vision_start|><|image_pad|><|vision_end|>" for i in range(1, MAX_REFERENCES + 1))
    return [
        f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{{}}<|im_end|>\n<|im_start|>assistant\n",
        f"<|im_start|>user\n{images}<|im_end|>\n",
    ]


def build_tokenizer() -> Qwen2Tokenizer:
    """A byte-level BPE (Qwen2 pre-tokenizer, Qwen special tokens) trained on 2.1's templates and some prompts."""
    tokenizer = train_bpe(without_special_tokens(_templates() + EDIT_INSTRUCTIONS), vocab_size=768)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def text_encoder_config(tokenizer: Qwen2Tokenizer) -> Qwen3VLConfig:
    """A two-layer Qwen3-VL: text head_dim 8 (mrope sections sum to 4), vision patch 16 with a 2x2 merge."""
    ids = dict(zip(("image", "video", "start", "end"), tokenizer.convert_tokens_to_ids(
        ["<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"])))  # fmt: skip
    text_config = {
        "vocab_size": len(tokenizer), "hidden_size": TEXT_HIDDEN, "intermediate_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8, "max_position_embeddings": 4096,
        "pad_token_id": tokenizer.pad_token_id,
        "rope_parameters": {
            "rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 1, 1], "mrope_interleaved": True,
        },
    }  # fmt: skip
    vision_config = {
        "depth": 2, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "out_hidden_size": TEXT_HIDDEN,
        "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2, "num_position_embeddings": 64,
        "deepstack_visual_indexes": [0],
    }  # fmt: skip
    return Qwen3VLConfig(
        text_config=text_config,
        vision_config=vision_config,
        image_token_id=ids["image"],
        video_token_id=ids["video"],
        vision_start_token_id=ids["start"],
        vision_end_token_id=ids["end"],
    )


def build_tiny_qwen_image_21(path: str | Path, preset: str = "qwen_image_21", seed: int = 0) -> Path:
    """Build the tiny Qwen-Image-2.1 checkpoint into `path` (same seed, bitwise the same weights)."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    with _seeded(seed):
        transformer = QwenImage21Transformer2DModel(**TRANSFORMER_CONFIG)
    with _seeded(seed + 1):
        vae = AutoencoderKLQwenImage21(**VAE_CONFIG)
    with _seeded(seed + 2):
        text_encoder = Qwen3VLForConditionalGeneration(text_encoder_config(tokenizer)).eval()
    transformer.save_pretrained(out / "transformer")
    vae.save_pretrained(out / "vae")
    text_encoder.save_pretrained(out / "text_encoder")
    FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG).save_pretrained(out / "scheduler")
    tokenizer.save_pretrained(out / "processor")
    _write_json(out / "processor" / "preprocessor_config.json", IMAGE_PROCESSOR_CONFIG)
    _write_json(
        out / "model_index.json",
        {
            "_class_name": QwenImage21Pipeline.__name__,
            "_diffusers_version": diffusers.__version__,
            "processor": ["transformers", "Qwen3VLProcessor"],
            "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
            "text_encoder": ["transformers", "Qwen3VLForConditionalGeneration"],
            "transformer": ["diffusers", "QwenImage21Transformer2DModel"],
            "vae": ["diffusers", "AutoencoderKLQwenImage21"],
            "sample_sigmas": SAMPLE_SIGMAS,
        },
    )
    return out
