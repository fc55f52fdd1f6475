"""How far prompt embeddings move when the text encoder's weights are quantized (`model.text_encoder_quantize`).

    python scripts/text_encoder_quantization.py [--samples 16] [--variant edit]

Encodes the prompts of a synthetic data set (with their control images) with qie's tiny model once with
full-precision text-encoder weights and once per quantization (optimum-quanto fp8 / int8, as
`model.text_encoder_quantize` does), and prints per quantization: the mean and the minimum cosine
similarity of each prompt's embedding (tokens x hidden, flattened) with the unquantized one, the largest
absolute difference of any value, and that difference relative to the largest absolute value.

The tiny model has random weights and a 16-wide hidden state: the numbers show the code path works and give
an order of magnitude; the real Qwen2.5-VL-7B (hidden 3584, trained weights with outliers) is measured on a
GPU with the same command and `--model PATH`.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

from qie.config import typed

sys.path.insert(0, str(Path(__file__).resolve().parent))


def encode_all(source: str, variant: str, quantize: str, samples: list, sizes) -> list[torch.Tensor]:
    from qie.checks import compose
    from qie.components import build_parts, resolve_device
    from qie.components.registry import Placement
    from qie.embedding.encode import Encoder, prepare_sample
    from qie.models import model_spec

    choice = {"edit": "model=tiny", "edit_plus": "model=tiny_plus"}[variant]
    spec = model_spec(typed(compose("precompute", [choice]).model))

    device = resolve_device("auto")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    parts = build_parts(
        source,
        ["text_encoder", "tokenizer", "processor", "vae"],
        spec.family.part_classes,
        {"text_encoder": Placement(device, dtype), "vae": Placement(device, dtype)},
        text_encoder_quantize=quantize,
    )
    encoder = Encoder(parts, spec)
    prepared = [prepare_sample(s, sizes) for s in samples]
    return encoder.encode_prompts([p.sample.prompt for p in prepared], [p.vl_images for p in prepared])


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=16)
    p.add_argument("--variant", default="edit", choices=["edit", "edit_plus"])
    p.add_argument("--model", default=None, help="a diffusers-format model folder (default: qie's tiny model)")
    p.add_argument("--pixels", type=int, default=64 * 64, help="condition image area for the VL")
    args = p.parse_args(argv)
    from _bench_common import header, table

    from qie.components.tiny import default_tiny_path, ensure_tiny_model
    from qie.data.scan import scan_dataset
    from qie.demo.synthetic import make_dataset
    from qie.embedding.encode import ImageSizes

    header(
        "prompt embeddings with a quantized text encoder",
        ["scripts/text_encoder_quantization.py", *(argv or sys.argv[1:])],
    )
    torch.manual_seed(0)
    source = args.model or str(ensure_tiny_model(default_tiny_path(args.variant), args.variant))
    with tempfile.TemporaryDirectory() as tmp:
        make_dataset(tmp, train=args.samples, heldout=0, size=64)
        samples = scan_dataset(Path(tmp) / "train", "folder").samples
        sizes = ImageSizes(args.pixels, args.pixels, args.pixels)
        reference = encode_all(source, args.variant, "none", samples, sizes)
        rows, out = [], {}
        for kind in ("fp8", "int8"):
            quantized = encode_all(source, args.variant, kind, samples, sizes)
            cos = [torch.nn.functional.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0).item()
                   for a, b in zip(reference, quantized)]  # fmt: skip
            diff = max((a.double() - b.double()).abs().max().item() for a, b in zip(reference, quantized))
            scale = max(a.double().abs().max().item() for a in reference)
            out[kind] = {"mean_cosine": sum(cos) / len(cos), "min_cosine": min(cos), "max_abs": diff, "max_ref": scale}
            rows.append(
                [kind, f"{out[kind]['mean_cosine']:.6f}", f"{min(cos):.6f}", f"{diff:.4g}", f"{diff / scale:.2%}"]
            )
    print(f"{len(samples)} prompts, model {source}")
    print(table(["weights", "mean cosine", "min cosine", "max |diff|", "max |diff| / max |value|"], rows))
    return out


if __name__ == "__main__":
    main()
