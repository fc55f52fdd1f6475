"""Real-size LoRA step with qie's memory levers on a GPU: peak memory and s/step for bf16 and fp8 weights,
without and with gradient checkpointing, and with 0/16/30/45 of the 60 blocks swapped to pinned CPU memory.

The transformer is built from its public config with random weights (no download), on the CPU: swapped blocks
must never be on the GPU whole. Each weight kind is built once (meta device, `to_empty` on the CPU, initialised
in place as scripts/bench_gpu_step.py does, quantized with qie's `quantize_transformer` for fp8), gets qie's LoRA
(rank 16, attention projections) and is then set up per configuration with qie's own `BlockSwapper` (the
`train.blocks_to_swap` path); configurations without swap move the whole model to the GPU. The step is qie's
`flow_matching_loss` + backward + AdamW under bf16 autocast on one 1024x1024 Edit sample (4,096 target + 4,096
control tokens, ~1,300 prompt tokens). Reported per configuration: median s/step after warm-up, peak allocated
and peak reserved GPU memory, the ratio to the same weights' unswapped checkpointed step, and whether the
reserved peak fits a 24 GB card (<= 23 GiB, leaving the CUDA context its share). Needs ~45 GiB of host memory
for bf16 (the weights, pinned for swapping).

    python scripts/bench_swap.py                                   # the table for docs/benchmarks.md
    python scripts/bench_swap.py --weights fp8 --swaps 16 30
    python scripts/bench_swap.py --device cpu --num-layers 4 --heads 2 --joint-dim 64 --swaps 2 \\
        --resolution 128 --prompt-tokens 32 --steps 1 --warmup 0   # a CPU smoke run of the code path
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

FITS_24GB_GIB = 23.0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--weights", nargs="+", default=["bf16", "fp8"], choices=["bf16", "fp8"])
    p.add_argument("--swaps", nargs="+", type=int, default=[16, 30, 45], help="blocks to swap (with checkpointing)")
    p.add_argument("--no-plain", action="store_true", help="skip the configurations without checkpointing")
    p.add_argument("--num-layers", type=int, default=60)
    p.add_argument("--heads", type=int, default=24, help="attention heads of 128 channels (real: 24)")
    p.add_argument("--joint-dim", type=int, default=3584, help="prompt embedding width (real: 3584)")
    p.add_argument("--resolution", type=int, default=1024)
    p.add_argument("--prompt-tokens", type=int, default=1300)
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--device", default="cuda")
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def model_config(args: argparse.Namespace) -> dict:
    from bench_gpu_step import REAL_CONFIG

    return {**REAL_CONFIG, "num_layers": args.num_layers, "num_attention_heads": args.heads,
            "joint_attention_dim": args.joint_dim}  # fmt: skip


def make_batch(args: argparse.Namespace):
    """One Edit sample at `--resolution` (target and control) with `--prompt-tokens`, random, on the device."""
    import torch

    from qie.memory_plan import Workload
    from qie.models.qwen_image import step_inputs

    tokens = (args.resolution // 16) ** 2
    work = Workload(1, tokens, (tokens,), args.prompt_tokens, torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    batch, noise, sigmas = step_inputs(
        model_config(args), work, lambda *s, dtype: torch.randn(*s, generator=g, dtype=dtype)
    )
    return batch.to(args.device, torch.bfloat16), noise.to(args.device), sigmas.to(args.device)


def build_on_cpu(args: argparse.Namespace, fp8: bool):
    """The transformer in host memory with random weights (bf16), quantized for fp8, with qie's LoRA."""
    import torch
    from bench_gpu_step import LORA_TARGETS
    from diffusers import QwenImageTransformer2DModel

    from qie.components.quantize import quantize_transformer
    from qie.models import families
    from qie.training.lora import add_lora

    with torch.device("meta"):
        model = QwenImageTransformer2DModel(**model_config(args))
    model = model.to(torch.bfloat16).to_empty(device="cpu")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2:
                p.normal_(0.0, 0.02, generator=g)
            else:
                p.fill_(1.0 if name.endswith("weight") and "norm" in name else 0.0)
    pos = model.pos_embed  # plain tensor attributes made on the meta device: rebuild them
    model.pos_embed = type(pos)(theta=pos.theta, axes_dim=list(pos.axes_dim), scale_rope=pos.scale_rope)
    model.requires_grad_(False).train()
    if fp8:
        quantize_transformer(model, "fp8", families()["qwen_image"].keep_full_precision)
    params = add_lora(model, args.lora_rank, args.lora_rank, LORA_TARGETS)
    return model, params


def place(model, swap: int, device: str, previous):
    """Put the model on the device for `swap` swapped blocks (0: all of it); returns the swapper."""
    import torch

    from qie.training.offload import BlockSwapper

    if previous is not None:
        previous.remove()
    if swap == 0:
        model.to(device)
        return None
    return BlockSwapper(model, model.transformer_blocks, swap, torch.device(device))


def run_config(model, params, swap: int, checkpointing: bool, args, batch, noise, sigmas) -> dict:
    import torch
    from bench_gpu_step import sync, train_step

    device_type = "cuda" if args.device.startswith("cuda") else "cpu"
    (model.enable_gradient_checkpointing if checkpointing else model.disable_gradient_checkpointing)()
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    if device_type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    times, loss = [], math.nan
    try:
        for i in range(args.warmup + args.steps):
            sync(args.device)
            t0 = time.perf_counter()
            loss = train_step(model, params, optimizer, batch, noise, sigmas, device_type)
            sync(args.device)
            if i >= args.warmup:
                times.append(time.perf_counter() - t0)
    except torch.cuda.OutOfMemoryError as e:
        return {"error": f"out of memory: {str(e)[:100]}"}
    finally:
        optimizer.zero_grad(set_to_none=True)
    cuda = device_type == "cuda"
    return {
        "s_per_step": statistics.median(times) if times else math.nan,
        "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else math.nan,
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if cuda else math.nan,
        "loss": loss,
    }


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    import torch
    from _bench_common import header, table

    header("real-size LoRA step with block swap", ["scripts/bench_swap.py", *(sys.argv[1:] if argv is None else argv)])
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("bench_swap: no CUDA device here; run it on a GPU machine (or --device cpu for a smoke run)")
    if args.device.startswith("cuda"):
        total = torch.cuda.get_device_properties(0).total_memory / 2**30
        print(f"device: {torch.cuda.get_device_name()}, {total:.0f} GiB")
    configs = [] if args.no_plain else [(0, False)]
    configs += [(0, True)] + [(n, True) for n in sorted(args.swaps, reverse=True) if 0 < n <= args.num_layers]
    results: dict[str, dict] = {}
    for weights in args.weights:
        model, params = build_on_cpu(args, weights == "fp8")
        batch, noise, sigmas = make_batch(args)
        swapper = None
        # Most swapped first: each configuration moves more of the model onto the GPU than the one before.
        for swap, checkpointing in sorted(configs, key=lambda c: (-c[0], not c[1])):
            name = f"{weights}{'+gc' if checkpointing else ''}+swap{swap}"
            swapper = place(model, swap, args.device, swapper)
            results[name] = run_config(model, params, swap, checkpointing, args, batch, noise, sigmas)
            print(name, results[name], flush=True)
        del model, params, swapper
        gc.collect()
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()

    rows = []
    for name, r in results.items():
        if "error" in r:
            rows.append([name, "-", "-", "-", "-", "-", r["error"]])
            continue
        base = results.get(name.split("+swap")[0] + "+swap0", {}).get("s_per_step", math.nan)
        fits = r["peak_reserved_gib"] <= FITS_24GB_GIB
        rows.append([name, f"{r['s_per_step']:.2f}", f"{r['peak_allocated_gib']:.1f}", f"{r['peak_reserved_gib']:.1f}",
                     f"{r['s_per_step'] / base:.2f}x", "yes" if fits else "no", f"loss {r['loss']:.3f}"])  # fmt: skip
    print(
        table(["config", "s/step", "peak alloc GiB", "peak reserved GiB", "vs unswapped", "fits 24 GB", "note"], rows)
    )
    out = {"args": vars(args), "results": results}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2, default=str))
    return out


if __name__ == "__main__":
    main()
