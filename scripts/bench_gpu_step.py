"""Real-size LoRA training step of the Qwen-Image(-Edit) transformer on a GPU: s/step, peak memory, MFU.

The transformer is built from its public config with random weights (no download):
QwenImageTransformer2DModel(patch_size=2, in_channels=64, out_channels=16, num_layers=60,
attention_head_dim=128, num_attention_heads=24, joint_attention_dim=3584, axes_dims_rope=(16,56,56)),
~20B parameters. It is built on the meta device, cast to bf16 there, then materialised with `to_empty`
on the GPU and initialised in place (N(0, 0.02) weights, zero biases, unit norm scales), so host memory
stays small and the GPU holds one bf16 copy (~41 GB). `--num-layers` makes a smaller model for GPUs that
cannot hold it.

Each configuration (bf16, or fp8 / int4 weights via optimum-quanto, as `model.quantize=fp8|int4`; gradient
checkpointing off or on) trains the LoRA qie trains (rank 16 on the attention projections) with qie's
own flow-matching loss (`qie.models.qwen_image.flow_matching_loss`) on one 1024x1024 Edit sample: target and
control latents 16x128x128 (4,096 packed tokens each) and ~1,300 prompt tokens, under bf16 autocast as
accelerate's mixed_precision=bf16 does. Reported: median s/step after warm-up, peak allocated GPU memory,
and MFU = model FLOPs per step / s per step / the GPU's dense bf16 peak. Model FLOPs are counted once with
torch.utils.flop_counter on the bf16 configuration without checkpointing (recomputation is not useful work,
so the same count is used for every configuration); `--peak-tflops` overrides the peak table.

    python scripts/bench_gpu_step.py                                  # all six configurations
    python scripts/bench_gpu_step.py --num-layers 20 --configs bf16 bf16+gc
    python scripts/bench_gpu_step.py --device cpu --num-layers 1 --resolution 256 --prompt-tokens 64 \\
        --steps 1 --warmup 0 --configs bf16      # a CPU smoke run of the code path (not a benchmark)
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

from qie.models import real_size

REAL_CONFIG = real_size.TRANSFORMER
# Dense bf16 tensor-core peaks (TFLOP/s, no sparsity), matched against torch.cuda.get_device_name().
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "H800": 989.0, "A100": 312.0, "A800": 312.0, "L40S": 362.0, "L4": 121.0}
CONFIGS = ("bf16", "bf16+gc", "fp8", "fp8+gc", "int4", "int4+gc")
# The weights of each configuration: its name before "+"; all but bf16 are `model.quantize` values.
WEIGHTS = ("bf16", "fp8", "int4")
LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS, help="what to measure")
    p.add_argument("--num-layers", type=int, default=60, help="transformer blocks (real: 60)")
    p.add_argument("--resolution", type=int, default=1024, help="target and control side in pixels")
    p.add_argument("--prompt-tokens", type=int, default=1300, help="prompt embedding length")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--steps", type=int, default=10, help="timed steps per configuration")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--device", default="cuda")
    p.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 peak of the device (for MFU)")
    p.add_argument("--no-flop-count", action="store_true", help="skip the FLOP count (MFU then from a formula)")
    p.add_argument("--json", default=None, help="also write the results to this file")
    return p.parse_args(argv)


def build(args: argparse.Namespace, weights: str):
    """The transformer, materialised on the device in bf16 with random weights, quantized (fp8, int4), + LoRA."""
    import torch
    from diffusers import QwenImageTransformer2DModel

    from qie.components.quantize import quantize_transformer
    from qie.models import families
    from qie.training.lora import add_lora

    config = {**REAL_CONFIG, "num_layers": args.num_layers}
    with torch.device("meta"):
        model = QwenImageTransformer2DModel(**config)
    model = model.to(torch.bfloat16).to_empty(device=args.device)
    g = torch.Generator(device=args.device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2:
                p.normal_(0.0, 0.02, generator=g)
            elif name.endswith("weight") and "norm" in name:
                p.fill_(1.0)
            else:
                p.zero_()
        for _, b in model.named_buffers():
            b.zero_()
    # The rotary tables are plain tensor attributes (not buffers): made on the meta device, rebuild them.
    pos = model.pos_embed
    model.pos_embed = type(pos)(theta=pos.theta, axes_dim=list(pos.axes_dim), scale_rope=pos.scale_rope)
    model.requires_grad_(False)
    model.train()
    if weights != "bf16":
        quantize_transformer(model, weights, families()["qwen_image"].keep_full_precision)
    params = add_lora(model, args.lora_rank, args.lora_rank, LORA_TARGETS)
    for p in params:
        p.data = p.data.to(args.device)
    return model, params


def make_batch(args: argparse.Namespace):
    import torch

    from qie.types import Batch

    side = args.resolution // 8  # VAE: 8x down
    b, dev = args.batch_size, args.device
    g = torch.Generator(device=dev).manual_seed(1)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, device=dev, dtype=torch.bfloat16)

    batch = Batch(
        ids=[str(i) for i in range(b)],
        latents=rnd(b, 16, 1, side, side),
        control_latents=[rnd(b, 16, 1, side, side)],
        prompt_embeds=rnd(b, args.prompt_tokens, 3584),
        prompt_embeds_mask=None,
    )
    noise = rnd(b, 16, 1, side, side)
    sigmas = torch.rand(b, generator=g, device=dev).clamp(0.05, 0.95)
    return batch, noise, sigmas


def train_step(model, params, optimizer, batch, noise, sigmas, device_type: str) -> float:
    import torch

    from qie.models.qwen_image import flow_matching_loss

    with torch.autocast(device_type, dtype=torch.bfloat16):
        loss = flow_matching_loss(model, batch, noise, sigmas)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.detach())


def sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def formula_flops(args: argparse.Namespace) -> float:
    """Forward+backward matmul FLOPs of a LoRA step (frozen base: backward computes input gradients only,
    as much as the forward; attention backward ~2x its forward), LoRA's own FLOPs left out."""
    d = REAL_CONFIG["num_attention_heads"] * REAL_CONFIG["attention_head_dim"]
    img = 2 * (args.resolution // 16) ** 2  # target + control packed tokens
    seq = img + args.prompt_tokens
    per_layer_linear = 2 * 12 * d * d * seq  # qkv + out (4 d^2) + MLP (8 d^2), each stream on its own tokens
    per_layer_attn = 4 * seq * seq * d
    return args.batch_size * args.num_layers * (2 * per_layer_linear + 3 * per_layer_attn)


def count_flops(model, params, batch, noise, sigmas, device_type: str) -> float:
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    optimizer = torch.optim.SGD(params, lr=0.0)
    with FlopCounterMode(display=False) as counter:
        train_step(model, params, optimizer, batch, noise, sigmas, device_type)
    return float(counter.get_total_flops())


def peak_tflops(args: argparse.Namespace) -> float | None:
    import torch

    if args.peak_tflops:
        return args.peak_tflops
    if not args.device.startswith("cuda"):
        return None
    name = torch.cuda.get_device_name()
    for key, value in PEAK_TFLOPS.items():
        if key in name:
            return value
    return None


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _bench_common import header, table

    header(
        "real-size LoRA training step on a GPU",
        ["scripts/bench_gpu_step.py", *(sys.argv[1:] if argv is None else argv)],
    )
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(
            "bench_gpu_step: no CUDA device here; run it on a GPU machine (or --device cpu for a smoke run)"
        )
    device_type = "cuda" if args.device.startswith("cuda") else "cpu"
    if device_type == "cuda":
        total = torch.cuda.get_device_properties(0).total_memory / 2**30
        print(f"device: {torch.cuda.get_device_name()}, {total:.0f} GiB")
    peak = peak_tflops(args)
    tokens = 2 * (args.resolution // 16) ** 2 + args.prompt_tokens
    print(
        f"model: {args.num_layers} layers, {args.resolution}^2 target + control, {args.prompt_tokens} prompt tokens "
        f"({tokens} tokens in the joint attention), batch {args.batch_size}, LoRA rank {args.lora_rank}"
    )

    results: dict[str, dict] = {}
    model_flops = None
    for weights in WEIGHTS:
        wanted = [c for c in args.configs if c.split("+")[0] == weights]
        if not wanted:
            continue
        model = params = None
        try:
            t0 = time.perf_counter()
            model, params = build(args, weights)
            sync(args.device)
            n_params = sum(p.numel() for p in model.parameters())
            took = time.perf_counter() - t0
            print(f"built {weights} model: {n_params / 1e9:.2f}B parameters in {took:.0f} s")
            batch, noise, sigmas = make_batch(args)
            if model_flops is None and weights == "bf16" and not args.no_flop_count:
                try:
                    model.disable_gradient_checkpointing()
                    model_flops = count_flops(model, params, batch, noise, sigmas, device_type)
                except Exception as e:  # e.g. out of memory: fall back to the formula
                    print(f"FLOP count failed ({e.__class__.__name__}: {e}); using the formula")
                    if device_type == "cuda":
                        torch.cuda.empty_cache()
            for name in wanted:
                results[name] = run_config(name, model, params, batch, noise, sigmas, args, device_type)
        except torch.cuda.OutOfMemoryError as e:
            for name in wanted:
                results.setdefault(name, {"error": f"out of memory building the model: {str(e)[:120]}"})
        finally:
            del model, params
            gc.collect()
            if device_type == "cuda":
                torch.cuda.empty_cache()

    flops = model_flops if model_flops is not None else formula_flops(args)
    source = "counted (torch.utils.flop_counter)" if model_flops is not None else "formula"
    rows = []
    for name in args.configs:
        r = results.get(name, {"error": "not run"})
        if "error" in r:
            rows.append([name, "-", "-", "-", "-", r["error"]])
            continue
        mfu = flops / r["s_per_step"] / (peak * 1e12) if peak else math.nan
        r["mfu"] = mfu
        rows.append(
            [
                name,
                f"{r['s_per_step']:.3f}",
                f"{r['peak_gib']:.1f}",
                f"{flops / r['s_per_step'] / 1e12:.0f}",
                f"{100 * mfu:.1f}%" if peak else "n/a",
                f"loss {r['loss']:.3f}",
            ]
        )
    print(f"\nmodel FLOPs per step: {flops / 1e12:.1f} TFLOP ({source}); peak {peak or 'unknown'} TFLOP/s dense bf16")
    print(table(["config", "s/step (median)", "peak GiB", "TFLOP/s", "MFU", "note"], rows))
    out = {"args": vars(args), "model_tflop_per_step": flops / 1e12, "flops_source": source, "peak_tflops": peak}
    out["results"] = results
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2, default=str))
    return out


def run_config(name, model, params, batch, noise, sigmas, args, device_type) -> dict:
    import torch

    if name.endswith("+gc"):
        model.enable_gradient_checkpointing()
    else:
        model.disable_gradient_checkpointing()
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    if device_type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    times, loss = [], math.nan
    try:
        for i in range(args.warmup + args.steps):
            sync(args.device)
            t0 = time.perf_counter()
            loss = train_step(model, params, optimizer, batch, noise, sigmas, device_type)  # .item() syncs
            sync(args.device)
            if i >= args.warmup:
                times.append(time.perf_counter() - t0)
    except torch.cuda.OutOfMemoryError as e:
        optimizer.zero_grad(set_to_none=True)
        return {"error": f"out of memory: {str(e)[:120]}"}
    peak = torch.cuda.max_memory_allocated() / 2**30 if device_type == "cuda" else math.nan
    s = statistics.median(times) if times else math.nan
    print(f"{name}: {s:.3f} s/step, peak {peak:.1f} GiB, loss {loss:.4f}")
    return {"s_per_step": s, "times": times, "peak_gib": peak, "loss": loss}


if __name__ == "__main__":
    main()
