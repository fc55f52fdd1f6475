"""Weight memory of the real-size model parts, counted from their configs on the meta device.

    python scripts/model_memory.py [--model qwen_image_edit|qwen_image_21] [--rank 16] [--caption-tokens 5000]

Counts parameters without allocating them, then multiplies by bytes per parameter for each precision.
Activations come on top and depend on resolution, batch and gradient checkpointing.
"""

from __future__ import annotations

import argparse

import torch
from peft import LoraConfig

from qie.models import ModelFamily, variants

GIB = 2**30
MODELS = ("qwen_image_edit", "qwen_image_21")


def model_yaml(model: str):
    """The model yaml `conf/model/<model>.yaml`, as written."""
    from omegaconf import OmegaConf

    from qie.config.tree import conf_dir

    return OmegaConf.load(str(conf_dir().joinpath("model", f"{model}.yaml")))


def lora_targets(model: str) -> list[str]:
    """`model.lora_target_modules` of the model yaml (the schema's default where the yaml sets none)."""
    from qie.config.model import ModelConfig

    return list(model_yaml(model).get("lora_target_modules") or ModelConfig().lora_target_modules)


def family(model: str) -> ModelFamily:
    """The family of the model yaml's variant."""
    return variants()[str(model_yaml(model).variant)][0]


def build(model: str) -> tuple[torch.nn.Module, torch.nn.Module, torch.nn.Module]:
    """(transformer, VAE, text encoder) of `model` at its family's published size, on the meta device."""
    of = family(model)
    sizes, text_encoder = of.published, of.part_class("text_encoder")
    with torch.device("meta"):
        return (
            of.part_class("transformer")(**sizes.transformer),
            of.part_class("vae")(**sizes.vae),
            text_encoder(text_encoder.config_class(**sizes.text_encoder)),
        )


def count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def linear_weights(module: torch.nn.Module) -> int:
    """Parameters in the weights of linear layers: what `model.text_encoder_quantize` stores in 8 bits."""
    return sum(m.weight.numel() for m in module.modules() if isinstance(m, torch.nn.Linear))


def kv_cache_bytes(text_encoder: torch.nn.Module, tokens: int) -> int:
    """Bytes of the bf16 key/value cache generation keeps for `tokens` tokens (prompt, images and answer)."""
    c = text_encoder.config.get_text_config()
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * 2 * tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=MODELS, default="qwen_image_edit")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument(
        "--caption-tokens", type=int, default=5000,
        help="tokens per generate call for the caption row (images + prompt + answer, times caption.batch_size)",
    )  # fmt: skip
    args = parser.parse_args()
    transformer, vae, text_encoder = build(args.model)
    total = count(transformer)
    kept = [n.rstrip("*") for n in family(args.model).keep_full_precision]
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
    te, head, linear = count(text_encoder), count(text_encoder.lm_head), linear_weights(text_encoder)
    kv = kv_cache_bytes(text_encoder, args.caption_tokens)
    rows += [
        ("text encoder parameters (of which lm_head)", f"{te / 1e9:.2f} B ({head / 1e9:.2f} B)"),
        ("text encoder weights, bf16", f"{te * 2 / GIB:.1f} GiB"),
        ("text encoder weights, fp8/int8 (linear layers quantized)", f"{((te - linear) * 2 + linear) / GIB:.1f} GiB"),
        (f"caption: KV cache of {args.caption_tokens} tokens, bf16", f"{kv / GIB:.2f} GiB"),
        ("caption: weights + KV cache, bf16 / int8", f"{(te * 2 + kv) / GIB:.1f} GiB / "
                                                    f"{((te - linear) * 2 + linear + kv) / GIB:.1f} GiB"),
    ]  # fmt: skip
    width = max(len(r[0]) for r in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")


if __name__ == "__main__":
    main()
