"""Cache keys of a sample: a hash of exactly what each cached value depends on.

- pixel_latent: target image bytes, target area / resize mode / rounding, VAE fingerprint
- control_latent: every control image's bytes, VAE condition area, VAE fingerprint
- layer_latent: every layer's bytes in order, target area / resize mode / rounding, VAE fingerprint
- <field>_latent (a sample field's image, `qie.data.fields`; rejected_latent a preference pair's rejected image):
  the image's bytes under the field's name, as pixel_latent's target
- prompt_embed (+mask): prompt text, every control image's bytes, VL condition area, text-encoder
  fingerprint, prompt template, the text encoder's weight quantization when it has one
- empty_prompt_embed (+mask): the same with the empty prompt
- caption (`data.auto_caption`, keyed in `qie.stages.auto_caption`): the bytes of the images the VL model is shown,
  the caption prompt, the generation settings, VL area, text-encoder fingerprint, processor, dtype, quantization;
  a sample's prompt is then its caption, so its prompt_embed key follows the caption's text
Image bytes are hashed once and remembered against (path, size, mtime_ns, ctime_ns, inode) by the FileHasher.
The mask types share their embedding's key: they are derived from it, never stored.
"""

from __future__ import annotations

from dataclasses import dataclass

from qie.cache.keys import FileHasher, entry_key
from qie.data.samples import Sample


@dataclass(frozen=True)
class KeyContext:
    """Everything besides the sample itself that cached values depend on."""

    vae_fingerprint: str
    text_encoder_fingerprint: str
    prompt_template: str
    target_pixels: int
    resize_mode: str
    multiple_of: int
    vae_image_pixels: int
    vl_image_pixels: int
    # Values are stored in the model dtype: a bf16 entry must not be read by a float32 run.
    dtype: str = "float32"
    # The processor's settings decide how many image tokens Qwen2.5-VL sees.
    processor_fingerprint: str = ""
    # Quantized text-encoder weights ("fp8", "int8") give other embeddings than the stored ones.
    text_encoder_quantize: str = "none"


def sample_keys(sample: Sample, ctx: KeyContext, hasher: FileHasher) -> dict[str, str]:
    """The key of each entry type `sample` has: pixel_latent only with a target, control_latent only with
    control images (a text-to-image sample, or an edit sample trained on the text-only prompt, has none)."""
    controls = [hasher.hash(p) for p in sample.controls]
    keys = {}
    if controls:
        keys["control_latent"] = entry_key(
            "control_latent",
            {"controls": controls, "area": ctx.vae_image_pixels, "vae": ctx.vae_fingerprint, "dtype": ctx.dtype},
        )
    encoded_as_target = {
        "area": ctx.target_pixels,
        "mode": ctx.resize_mode,
        "multiple": ctx.multiple_of,
        "vae": ctx.vae_fingerprint,
        "dtype": ctx.dtype,
    }
    if sample.target is not None:
        keys["pixel_latent"] = entry_key("pixel_latent", {"target": hasher.hash(sample.target), **encoded_as_target})
    for name, image in sample.field_images:
        keys[f"{name}_latent"] = entry_key(f"{name}_latent", {name: hasher.hash(image), **encoded_as_target})
    if sample.layers:
        keys["layer_latent"] = entry_key(
            "layer_latent", {"layers": [hasher.hash(p) for p in sample.layers], **encoded_as_target}
        )
    for kind, prompt in (("prompt_embed", sample.prompt), ("empty_prompt_embed", "")):
        fields = {
            "prompt": prompt,
            "controls": controls,
            "area": ctx.vl_image_pixels,
            "text_encoder": ctx.text_encoder_fingerprint,
            "template": ctx.prompt_template,
            "processor": ctx.processor_fingerprint,
            "dtype": ctx.dtype,
        }
        if ctx.text_encoder_quantize != "none":  # absent otherwise: unquantized entries keep their keys
            fields["text_encoder_quantize"] = ctx.text_encoder_quantize
        keys[kind] = entry_key(kind, fields)
        # A mask is derived from its embedding (nothing is stored for it): it shares the embedding's key.
        keys[kind.replace("embed", "embeds_mask")] = keys[kind]
    return keys
