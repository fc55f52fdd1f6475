"""Weight memory of the real-size model parts, counted from their configs on the meta device.

    python scripts/model_memory.py [--model qwen_image_edit|qwen_image_21] [--rank 16]

Counts parameters without allocating them, then multiplies by bytes per parameter for each precision.
Activations come on top and depend on resolution, batch and gradient checkpointing.
"""

from __future__ import annotations

import argparse

import torch
from peft import LoraConfig

from qie.models import families, real_size

GIB = 2**30
MODELS = ("qwen_image_edit", "qwen_image_21")


def lora_targets(model: str) -> list[str]:
    """`model.lora_target_modules` of the model yaml (the schema's default where the yaml sets none)."""
    from importlib.resources import files

    from omegaconf import OmegaConf

    from qie.config.model import ModelConfig

    node = OmegaConf.load(str(files("qie.conf").joinpath("model", f"{model}.yaml")))
    return list(node.get("lora_target_modules") or ModelConfig().lora_target_modules)


def build(model: str) -> tuple[torch.nn.Module, torch.nn.Module, torch.nn.Module | None]:
    """(transformer, VAE, text encoder or None) of `model` at real size, on the meta device."""
    with torch.device("meta"):
        if model == "qwen_image_21":
            from diffusers import AutoencoderKLQwenImage21, QwenImage21Transformer2DModel
            from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

            return (
                QwenImage21Transformer2DModel(**real_size.TRANSFORMER_21),
                AutoencoderKLQwenImage21(**real_size.VAE_21),
                Qwen3VLForConditionalGeneration(Qwen3VLConfig(**real_size.TEXT_ENCODER_21)),
            )
        from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel

        return QwenImageTransformer2DModel(**real_size.TRANSFORMER), AutoencoderKLQwenImage(**real_size.VAE), None


def count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=MODELS, default="qwen_image_edit")
    parser.add_argument("--rank", type=int, default=16)
    args = parser.parse_args()
    transformer, vae, text_encoder = build(args.model)
    total = count(transformer)
    family = families()["qwen_image_21" if args.model == "qwen_image_21" else "qwen_image"]
    kept = [n.rstrip("*") for n in family.keep_full_precision]
    quantizable = sum(
        m.weight.numel()
        for name, m in transformer.named_modules()
        if isinstance(m, torch.nn.Linear) and not any(name.startswith(k) for k in kept)
    )
    targets = lora_targets(args.model)
    transformer.add_adapter(LoraConfig(r=args.rank, lora_alpha=args.rank, target_modules=targets))
    lora = sum(p.numel() for n, p in transformer.named_parameters() if "lora_" in n)
    enc, dec = count(vae.encoder), count(vae.decoder)
    rows = [
        ("transformer parameters", f"{total / 1e9:.2f} B"),
        ("transformer weights, bf16", f"{total * 2 / GIB:.1f} GiB"),
        (
            "transformer weights, fp8/int8 (linear layers quantized)",
            f"{((total - quantizable) * 2 + quantizable) / GIB:.1f} GiB",
        ),
        (f"LoRA r={args.rank} parameters ({len(targets)} target names)", f"{lora / 1e6:.1f} M"),
        ("LoRA weights + grads + AdamW states, fp32", f"{lora * 4 * 4 / GIB:.2f} GiB"),
        ("VAE encoder / decoder parameters", f"{enc / 1e6:.0f} M / {dec / 1e6:.0f} M"),
        ("VAE encoder / decoder weights, bf16", f"{enc * 2 / GIB:.2f} GiB / {dec * 2 / GIB:.2f} GiB"),
    ]
    if text_encoder is not None:
        te, head = count(text_encoder), count(text_encoder.lm_head)
        rows += [
            ("text encoder parameters (of which lm_head)", f"{te / 1e9:.2f} B ({head / 1e9:.2f} B)"),
            ("text encoder weights, bf16", f"{te * 2 / GIB:.1f} GiB"),
        ]
    width = max(len(r[0]) for r in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")


if __name__ == "__main__":
    main()
