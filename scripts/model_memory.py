"""Weight memory of the real-size Qwen-Image-Edit parts, counted from their configs on the meta device.

    python scripts/model_memory.py [--rank 16]

Counts parameters without allocating them, then multiplies by bytes per parameter for each precision.
Activations come on top and depend on resolution, batch and gradient checkpointing.
"""

from __future__ import annotations

import argparse

import torch
from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel
from peft import LoraConfig

from qie.components import real_size
from qie.components.quantize import KEEP_FULL_PRECISION
from qie.config.train import LoraConfig as QieLora

GIB = 2**30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, default=16)
    args = parser.parse_args()
    with torch.device("meta"):
        transformer = QwenImageTransformer2DModel(**real_size.TRANSFORMER)
        vae = AutoencoderKLQwenImage(**real_size.VAE)
    total = sum(p.numel() for p in transformer.parameters())
    kept = [n.rstrip("*") for n in KEEP_FULL_PRECISION]
    quantizable = sum(
        m.weight.numel()
        for name, m in transformer.named_modules()
        if isinstance(m, torch.nn.Linear) and not any(name.startswith(k) for k in kept)
    )
    transformer.add_adapter(LoraConfig(r=args.rank, lora_alpha=args.rank, target_modules=QieLora().target_modules))
    lora = sum(p.numel() for n, p in transformer.named_parameters() if "lora_" in n)
    enc = sum(p.numel() for p in vae.encoder.parameters())
    dec = sum(p.numel() for p in vae.decoder.parameters())
    rows = [
        ("transformer parameters", f"{total / 1e9:.2f} B"),
        ("transformer weights, bf16", f"{total * 2 / GIB:.1f} GiB"),
        (
            "transformer weights, fp8/int8 (linear layers quantized)",
            f"{((total - quantizable) * 2 + quantizable) / GIB:.1f} GiB",
        ),
        (f"LoRA r={args.rank} parameters (default targets)", f"{lora / 1e6:.1f} M"),
        ("LoRA weights + grads + AdamW states, fp32", f"{lora * 4 * 4 / GIB:.2f} GiB"),
        ("VAE encoder / decoder parameters", f"{enc / 1e6:.0f} M / {dec / 1e6:.0f} M"),
    ]
    width = max(len(r[0]) for r in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")


if __name__ == "__main__":
    main()
