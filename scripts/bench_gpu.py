"""The GPU table of docs/benchmarks.md in one command: the LoRA training step of a real-size model, timed through
qie's own code paths, written as markdown.

    python scripts/bench_gpu.py --model qwen_image_edit_2511 --out gpu_2511.md
    python scripts/bench_gpu.py --model qwen_image_21 --sections step,swap,compile
    python scripts/bench_gpu.py --model qwen_image_edit_2511 --tiny      # CPU smoke run at tiny size (seconds)

Sections (`--sections`, all by default):
  step         bf16 and fp8 weights (`model.quantize`, `--weights`) x gradient checkpointing off/on: s/it, peak
               allocated and reserved CUDA memory, MFU = model FLOPs per step / s per step / the device's dense
               bf16 peak (`--peak-tflops` overrides the table). Model FLOPs are counted once on fake tensors
               (`qie.stages.memory_plan.step_flops`: forward + backward, no recomputation, so every row uses the same
               count).
  swap         `train.blocks_to_swap` 0/16/30/45 (clamped to the model's blocks) with checkpointing, per weights.
  cached_live  the train stage on a synthetic data set, with embeddings read from the cache (`cache.mode=cached`)
               vs encoded every step (`cache.mode=live`, the text encoder and VAE run per step).
  precompute   the precompute stage on the same data set, `precompute.batch_size` 1 vs 8: samples/s.
  compile      `train.compile=true` vs eager: step ratio and compile time (first compiled step less the eager one).

A short GPU lease: `--num-layers 4,8` builds 4- and 8-block transformers and extrapolates each step row to the
model's own depth (table (f), marked extrapolated); `--swap-fractions 0.5,0.75` swaps shares of the blocks;
`--deadline S` starts no row after S seconds; `--results FILE` keeps each row as it ends, and `--reuse FILE,...`
takes rows already measured from such files (finish a table over several runs, or print it anywhere).

The step, swap and compile rows build the transformer from the family's published sizes with random weights
(`qie.models.real_size.random_model`: no checkpoint, no download), quantize it with qie's `quantize_transformer`,
and hand it to the train stage's `build_train_state` (LoRA, gradient checkpointing, block swap, compile,
accelerate) and its loop (`qie.training.loop.fit`) on one synthetic batch of `--resolution` target and control
latents and the prompt length the planner counts. The cached_live and precompute rows run the train and
precompute stages themselves, so they need the model's checkpoint (a local folder: `--checkpoint DIR`; the tiny
models build themselves); without it their rows say so. Every row is timed by the same recorder (the loop's
per-step hook): median s/it after `--warmup` steps. A row that runs out of memory says OOM. On a GPU each row
runs in its own process (clean peak memory, and an OOM cannot spoil the next row); `--tiny` runs in-process.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import itertools
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_common import child_env  # noqa: E402

SCRIPT = os.path.abspath(__file__)
SECTIONS = ("step", "swap", "cached_live", "precompute", "compile")
TITLES = {
    "step": "(a) Training step: weights x gradient checkpointing",
    "swap": "(b) Block swap (gradient checkpointing on)",
    "cached_live": "(c) Cached vs live embeddings (the train stage)",
    "precompute": "(d) Precompute throughput (the precompute stage)",
    "compile": "(e) Compiled vs eager (`train.compile`)",
}
# Dense bf16 tensor-core peaks (TFLOP/s, no sparsity), matched in this order against torch.cuda.get_device_name().
PEAK_TFLOPS = (("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H200", 989.0), ("H100", 989.0), ("H800", 989.0),
               ("GH200", 989.0), ("B200", 2250.0), ("A100", 312.0), ("A800", 312.0), ("L40S", 362.0),
               ("L4", 121.0))  # fmt: skip
FITS_24GB_GIB = 23.0  # peak reserved memory that leaves a 24 GB card's CUDA context its share
RESULT_PREFIX = "BENCH_RESULT "
RUN_ORDER = ("step", "swap", "precompute", "cached_live", "compile")
# Weights of a row -> its model overrides. fp8: torchao's fp8 products (model.fp8_compute=always, eager or
# compiled); fp8q: optimum-quanto's fp8 weights, computed in bf16.
WEIGHTS = {
    "bf16": ("model.quantize=none",),
    "fp8": ("model.quantize=fp8", "model.fp8_compute=always"),
    "fp8q": ("model.quantize=fp8", "model.fp8_compute=never"),
    "int8": ("model.quantize=int8",),
    "int4": ("model.quantize=int4",),
    "nf4": ("model.quantize=nf4",),
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen_image_edit_2511", help="a model yaml of conf/model (any variant)")
    p.add_argument(
        "--tiny", action="store_true", help="the family's tiny model (a smoke run where no GPU is, not a benchmark)"
    )
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, of {', '.join(SECTIONS)}")
    p.add_argument("--out", default=None, help="also write the markdown here (it is always printed)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per row (default 10; --tiny 2)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 3; --tiny 1)")
    p.add_argument("--resolution", type=int, default=None, help="target and control side in pixels (default 1024; "
                   "--tiny: the tiny model's condition size)")  # fmt: skip
    p.add_argument("--controls", type=int, default=None, help="control images per sample (default: 1, or 0 for a "
                   "model without control images)")  # fmt: skip
    p.add_argument("--prompt-tokens", type=int, default=None, help="prompt length (default: the planner's count)")
    p.add_argument("--weights", default="bf16,fp8", help="weights of the step rows: bf16 (model.quantize=none), "
                   "fp8 (torchao's fp8 products, model.fp8_compute=always), fp8q "
                   "(optimum-quanto's fp8 weights, model.fp8_compute=never), int8, int4, nf4")  # fmt: skip
    p.add_argument("--swap-weights", default=None, help="weights of the swap rows (default: --weights)")
    p.add_argument("--swaps", default="0,16,30,45", help="train.blocks_to_swap values (clamped to the blocks)")
    p.add_argument("--swap-fractions", default=None, help="swap rows by share of the blocks instead (e.g. 0.5,0.75), "
                   "at the deepest --num-layers; the no-swap reference is the step row with checkpointing")  # fmt: skip
    p.add_argument("--num-layers", default=None, help="transformer blocks built (fewer than the model's, to fit a "
                   "short run): one number, or two (e.g. 4,8) to extrapolate each step row to the model's full "
                   "depth, linearly in the block count, marked as extrapolated")  # fmt: skip
    p.add_argument("--deadline", type=float, default=None, help="seconds after which no further row starts (its row "
                   "says so); for a run inside a fixed time budget")  # fmt: skip
    p.add_argument("--results", default=None, help="append each row's result here as it ends (JSON lines)")
    p.add_argument("--reuse", default=None, help="a --results file of an earlier run: its rows of this model that "
                   "ran are taken from it, not run again (finish a table over several short runs)")  # fmt: skip
    p.add_argument("--compile-weights", default="bf16", help="weights of the compile rows (eager and compiled each)")
    p.add_argument("--samples", type=int, default=None, help="data set size of cached_live/precompute (default 32; "
                   "--tiny 16)")  # fmt: skip
    p.add_argument("--precompute-batches", default="1,8", help="precompute.batch_size values of the precompute rows")
    p.add_argument(
        "--checkpoint", default=None, help="local folder of the model's checkpoint (cached_live, precompute)"
    )
    p.add_argument("--peak-tflops", type=float, default=None, help="the device's dense bf16 peak, for MFU")
    p.add_argument("--in-process", action="store_true", help="run every row in this process (default on the CPU)")
    p.add_argument("--work", default=None, help="work folder (default: a temporary one, removed at the end)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*", help="extra train overrides for every training row (key=value)")
    args = p.parse_args(argv)
    args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    if unknown := [s for s in args.sections if s not in SECTIONS]:
        p.error(f"--sections: unknown {unknown}; choose from {', '.join(SECTIONS)}")
    args.weights = [w.strip() for w in args.weights.split(",") if w.strip()]
    args.swap_weights = [w.strip() for w in (args.swap_weights or ",".join(args.weights)).split(",") if w.strip()]
    args.compile_weights = [w.strip() for w in args.compile_weights.split(",") if w.strip()]
    if unknown := [w for w in args.weights + args.swap_weights + args.compile_weights if w not in WEIGHTS]:
        p.error(f"--weights: unknown {unknown}; choose from {', '.join(WEIGHTS)}")
    args.swaps = sorted({int(s) for s in args.swaps.split(",") if s.strip()})
    args.swap_fractions = [float(f) for f in (args.swap_fractions or "").split(",") if f.strip()]
    if any(not 0 < f <= 1 for f in args.swap_fractions):
        p.error("--swap-fractions: shares of the blocks, in (0, 1]")
    args.depths = sorted({int(n) for n in (args.num_layers or "").split(",") if n.strip()}) or [None]
    if len(args.depths) > 2 or any(n < 1 for n in args.depths if n):
        p.error("--num-layers: one block count, or two to extrapolate from")
    args.precompute_batches = [int(b) for b in args.precompute_batches.split(",") if b.strip()]
    tiny = args.tiny
    args.steps = args.steps if args.steps is not None else (2 if tiny else 10)
    args.warmup = args.warmup if args.warmup is not None else (1 if tiny else 3)
    args.samples = args.samples if args.samples is not None else (16 if tiny else 32)
    if args.steps < 1 or args.warmup < 0:
        p.error("--steps must be >= 1 and --warmup >= 0")
    return args


# --- the model -------------------------------------------------------------------------------------------------


def model_yaml(name: str):
    from omegaconf import OmegaConf

    from qie.config.tree import conf_dir

    path = conf_dir().joinpath("model", f"{name}.yaml")
    if not path.is_file():
        known = sorted(p.name[:-5] for p in conf_dir().joinpath("model").iterdir() if p.name.endswith(".yaml"))
        raise SystemExit(f"bench_gpu: --model {name}: no conf/model/{name}.yaml; choose from {', '.join(known)}")
    return OmegaConf.load(str(path))


def tiny_model(name: str) -> str:
    """The tiny model yaml standing in for `name` (itself if it is tiny): the same variant, the same
    `zero_cond_t`, as the tiny presets pair them."""
    from qie.config.tree import conf_dir

    node = model_yaml(name)
    if node.get("tiny"):
        return name
    candidates = []
    for p in sorted(conf_dir().joinpath("model").iterdir()):
        if p.name.endswith(".yaml"):
            other = model_yaml(p.name[:-5])
            if other.get("tiny") and other.variant == node.variant and other.name != "tiny_demo":
                same = bool(other.get("zero_cond_t", False)) == bool(node.get("zero_cond_t", False))
                candidates.append((not same, other.name))
    if not candidates:
        raise SystemExit(f"bench_gpu: no tiny model of variant {node.variant!r} (for --model {name} --tiny)")
    return min(candidates)[1]


@dataclass
class Setup:
    """What every row shares: the model, the device, the step's token counts."""

    model: str  # the model yaml the rows run
    real: bool  # random real-size transformer (else the tiny checkpoint's)
    device: str
    resolution: int
    controls: int
    prompt_tokens: int | None
    work: Path
    base: list[str] = field(default_factory=list)  # overrides every stage's rows share
    train: list[str] = field(default_factory=list)  # and the train stage's


def make_setup(args: argparse.Namespace, work: Path) -> Setup:
    import torch

    from qie.errors import QieError

    model = tiny_model(args.model) if args.tiny else args.model
    node = model_yaml(model)
    real = not node.get("tiny")
    device = "cuda" if torch.cuda.is_available() else "cpu"  # where the train stage puts the model
    if real and device == "cpu" and not args.child and not args.reuse:
        raise SystemExit("bench_gpu: no CUDA device here; run it on a GPU machine, or add --tiny for a CPU smoke run")
    side = args.resolution or (1024 if real else round(int(node.vae_image_pixels) ** 0.5))
    controls = args.controls if args.controls is not None else max(int(node.min_control_images),
                                                                    min(1, int(node.max_control_images)))  # fmt: skip
    base = [f"model={model}", f"data.target_pixels={side * side}", f"model.vae_image_pixels={side * side}"]
    if node.vl_image_pixels == node.vae_image_pixels:  # a model that sizes references once for both keeps them equal
        base.append(f"model.vl_image_pixels={side * side}")
    if args.checkpoint:
        base.append(f"model.pretrained_model_name_or_path={args.checkpoint}")
    train = ["logging.report_to=none", "train.checkpoint_every=0", f"train.max_steps={args.warmup + args.steps}"]
    train += args.overrides
    setup = Setup(model, real, device, side, controls, args.prompt_tokens, work, base, base + train)
    try:  # a bad size or override stops here, in one line, before any row runs
        stage_config("train", setup.train)
    except QieError as e:
        raise SystemExit(f"bench_gpu: {e}") from None
    return setup


@functools.cache
def _composed(stage: str, base: tuple[str, ...]):
    from qie.checks import compose

    return compose(stage, list(base))


def stage_config(stage: str, base: list[str], overrides: list[str] = ()):
    """`compose(stage, base + overrides)` for dotted-key `overrides`: the base composed once (Hydra takes a second
    or more per composition on a busy machine), the row's keys merged in and checked as `compose` checks them."""
    from omegaconf import OmegaConf

    from qie.checks import validate

    cfg = _composed(stage, tuple(base))
    if overrides:
        cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(list(overrides)))
        validate(cfg)
    return cfg


def workload(cfg, spec, setup: Setup):
    """The planner's token counts (`qie.stages.plan.workload`) for `setup.controls` control images."""
    import dataclasses

    from qie.config import typed
    from qie.stages.plan import workload as plan_workload

    model = dataclasses.replace(typed(cfg.model), max_control_images=setup.controls)
    work = plan_workload(model, typed(cfg.data), spec)
    return dataclasses.replace(work, prompt_tokens=setup.prompt_tokens) if setup.prompt_tokens else work


def transformer_config(cfg, spec, setup: Setup, num_layers: int | None) -> dict:
    from qie.config import typed
    from qie.stages.plan import transformer_config as plan_config

    if setup.real:
        config = dict(spec.family.published.transformer)
        if spec.zero_cond_t:  # the variant's transformer gives control tokens timestep 0 (Edit-2511)
            config["zero_cond_t"] = True
    else:
        config = plan_config(typed(cfg.model), spec)[0]
    return {**config, "num_layers": num_layers} if num_layers else config


def build_parts(cfg, plan, setup: Setup, accelerator, num_layers: int | None):
    """The transformer and the noise scheduler, where the train stage builds them: the tiny checkpoint through the
    stage's `load_model`; a real-size transformer with random weights (quantized as `model.quantize` says, fp8
    computed as `model.fp8_compute` decides for the build device; nf4 through a saved folder, as bitsandbytes
    quantizes while loading)."""
    from qie.components import Parts, resolve_dtype
    from qie.components.quantize import quantize_transformer
    from qie.models.real_size import random_model
    from qie.runtime.memory import MemorySettings
    from qie.stages.train_model import load_model

    if not setup.real:
        return load_model(plan, accelerator)
    spec = plan.spec
    family = spec.family
    quantize = str(cfg.model.quantize)
    device = MemorySettings.of(cfg.train, family).build_device(accelerator.device)
    config = transformer_config(cfg, spec, setup, num_layers)
    cls, dtype = family.part_class("transformer"), resolve_dtype(str(cfg.model.dtype))
    if quantize == "nf4":
        model = nf4_model(cls, config, device, dtype, family.keep_full_precision, setup.work)
    else:
        # Host-memory models (swap) are drawn on the GPU where there is one: a CPU draws gigabytes slowly.
        model = random_model(cls, config, accelerator.device, dtype).to(device)
        if quantize != "none":
            fp8_compute, compiled = str(cfg.model.fp8_compute), bool(cfg.train.compile)
            quantize_transformer(model, quantize, family.keep_full_precision, fp8_compute, device, compiled)
    return Parts(transformer=model, scheduler=family.part_class("scheduler")())


def nf4_model(cls: type, config: dict, device: str, dtype, keep, work: Path):
    """A random real-size transformer in nf4: built on the CPU, saved, and loaded as the train stage loads nf4
    (diffusers with bitsandbytes' config, straight onto the GPU)."""
    from qie.components.quantize import nf4_config
    from qie.models.real_size import random_model

    folder = work / f"nf4_{cls.__name__}_{config['num_layers']}"
    if not (folder / "config.json").is_file():
        random_model(cls, config, "cpu", dtype).save_pretrained(folder)
    return cls.from_pretrained(folder, quantization_config=nf4_config(dtype, keep), device_map={"": str(device)},
                               torch_dtype=dtype).eval().requires_grad_(False)  # fmt: skip


# --- one timing loop for every row ------------------------------------------------------------------------------


class StepRecorder:
    """The loop's per-step hook: every step's wall time and loss; the peak CUDA memory since it was made."""

    def __init__(self, device: str) -> None:
        import torch

        self.cuda = device.startswith("cuda")
        self.seconds: list[float] = []
        self.losses: list[float] = []
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()

    def __call__(self, info) -> None:  # a qie.training.loop.StepInfo
        self.seconds.append(info.seconds)
        self.losses.append(info.loss)

    def result(self, warmup: int) -> dict:
        import torch

        timed = self.seconds[warmup:] or self.seconds[-1:]
        gib = 2**30
        return {
            "s_per_it": statistics.median(timed) if timed else math.nan,
            "first_step_s": self.seconds[0] if self.seconds else math.nan,
            "steps": len(self.seconds),
            "loss": self.losses[-1] if self.losses else math.nan,
            "first_loss": self.losses[0] if self.losses else math.nan,
            "peak_alloc_gib": torch.cuda.max_memory_allocated() / gib if self.cuda else None,
            "peak_reserved_gib": torch.cuda.max_memory_reserved() / gib if self.cuda else None,
        }


def timed(run: Callable[[StepRecorder], dict | None], setup: Setup, warmup: int) -> dict:
    """Run one row with a fresh recorder; an out-of-memory error is the row's result, not a crash."""
    import torch

    recorder = StepRecorder(setup.device)
    try:
        extra = run(recorder) or {}
    except torch.cuda.OutOfMemoryError as e:
        return {"error": "OOM", "detail": first_line(e)[:200]}
    except Exception as e:  # the row's failure, in its row; the other rows still run
        return {"error": "failed", "detail": f"{type(e).__name__}: {first_line(e)}"[:300]}
    finally:
        gc.collect()
        if setup.device.startswith("cuda"):
            torch.cuda.empty_cache()
    return {**recorder.result(warmup), **extra}


def fit_rows(overrides: list[str], setup: Setup, depth: int | None, recorder: StepRecorder) -> dict:
    """The train stage's state (`build_train_state`) and loop (`fit`) on one synthetic batch, repeated."""
    import torch

    from qie.components import prepare_model
    from qie.config import typed
    from qie.models import model_spec
    from qie.runtime.memory import MemorySettings
    from qie.stages.accelerator import make_accelerator
    from qie.stages.settings import fused_base
    from qie.stages.train_model import ModelPlan, build_train_state, loop_settings, make_objective, objective_context
    from qie.stages.train_setup import train_mode
    from qie.training.logging import MetricsLogger
    from qie.training.loop import fit

    cfg = stage_config("train", setup.train, overrides)
    model, train = typed(cfg.model), typed(cfg.train)
    spec = model_spec(model) if setup.real else prepare_model(model)
    run_dir = Path(tempfile.mkdtemp(prefix="run_", dir=setup.work))
    memory = MemorySettings.of(train, spec.family)
    accelerator = make_accelerator(train, memory, str(model.dtype), run_dir)
    fused = fused_base(model, spec)
    plan = ModelPlan(model, train, memory, train_mode(train, spec, fused), spec, fused)
    parts = build_parts(cfg, plan, setup, accelerator, depth)
    block_params = sum(p.numel() for p in getattr(parts.transformer, spec.family.blocks)[0].parameters())
    objective_of = make_objective(plan, objective_context(plan, parts))
    state, objective = build_train_state(plan, accelerator, parts, objective_of)
    del parts
    work = workload(cfg, spec, setup)
    g = torch.Generator().manual_seed(0)
    config = dict(accelerator.unwrap_model(state.model).config)
    batch, _, _ = spec.family.planner.step_inputs(
        config, work, lambda *shape, dtype: torch.randn(*shape, generator=g, dtype=torch.float32).to(dtype)
    )
    logger = MetricsLogger(run_dir, "none", False)
    settings = loop_settings(train, typed(cfg.logging), objective)
    try:
        fit(state, ((i, batch) for i in itertools.count()), settings, logger, on_step_end=recorder)
    finally:
        logger.close()
        state.model = state.optimizer = None
        accelerator.free_memory()
        accelerator.end_training()
    return {"block_params": block_params}


# --- the rows of each section -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    section: str
    name: str  # the row's name in its table; "@N" ends it where the model is built with N blocks
    overrides: tuple[str, ...] = ()
    info: tuple[tuple[str, object], ...] = ()
    depth: int | None = None  # transformer blocks built (None: the model's own count)

    @property
    def key(self) -> str:
        return f"{self.section}/{self.name}"


def num_blocks(setup: Setup, depth: int | None) -> int:
    from qie.components import prepare_model
    from qie.models import model_spec

    cfg = stage_config("train", setup.train)
    from qie.config import typed

    spec = model_spec(typed(cfg.model)) if setup.real else prepare_model(typed(cfg.model))
    return int(transformer_config(cfg, spec, setup, depth)["num_layers"])


def at(name: str, depth: int | None) -> str:
    return f"{name}@{depth}" if depth else name


def weights_label(w: str, setup: Setup) -> str:
    """How a row's weights are stored: "bf16" means unquantized, in the model's dtype (float32 for tiny models)."""
    return w if w != "bf16" or setup.real else "fp32"


def plan_rows(args: argparse.Namespace, setup: Setup) -> list[Row]:
    gc_on = "train.gradient_checkpointing=true"
    deepest = args.depths[-1]
    rows: list[Row] = []
    if "step" in args.sections:
        for w, depth in itertools.product(args.weights, args.depths):
            label = weights_label(w, setup)
            for ckpt in (False, True) if w != "nf4" else (True,):  # nf4 is for small cards: checkpointing on
                levers = (*WEIGHTS[w], f"train.gradient_checkpointing={str(ckpt).lower()}")
                info = (("weights", label), ("checkpointing", "on" if ckpt else "off"), ("depth", depth))
                rows.append(Row("step", at(f"{label}{'+gc' if ckpt else ''}", depth), levers, info, depth))
    if "swap" in args.sections:
        blocks = num_blocks(setup, deepest)
        asked_for = {round(f * blocks): [f"{f:.0%}"] for f in args.swap_fractions} or {
            n: [s for s in args.swaps if min(s, blocks) == n] for n in {min(s, blocks) for s in args.swaps}
        }
        for w in args.swap_weights:
            label = weights_label(w, setup)
            for n in sorted(asked_for):
                levers = (*WEIGHTS[w], gc_on, f"train.blocks_to_swap={n}")
                info = (("weights", label), ("swapped", n), ("asked", asked_for[n]), ("blocks", blocks),
                        ("depth", deepest))  # fmt: skip
                rows.append(Row("swap", at(f"{label}+gc+swap{n}", deepest), levers, info, deepest))
    levers = (gc_on,) if setup.real else ()  # the real model's step without checkpointing may not fit
    if "cached_live" in args.sections:
        rows += [Row("cached_live", m, (f"cache.mode={m}", *levers)) for m in ("cached", "live")]
    if "precompute" in args.sections:
        for b in args.precompute_batches:
            rows.append(Row("precompute", f"batch{b}", (f"precompute.batch_size={b}",), (("batch", b),)))
    if "compile" in args.sections:
        for w, name in itertools.product(args.compile_weights, ("eager", "compiled")):
            label = "" if args.compile_weights == ["bf16"] else f"{weights_label(w, setup)}+"
            overrides = (*WEIGHTS[w], f"train.compile={str(name == 'compiled').lower()}", *levers)
            rows.append(Row("compile", at(label + name, deepest), overrides, (("weights", w),), deepest))
    return rows


def run_row(row: Row, setup: Setup, args: argparse.Namespace) -> dict:
    """One row, in this process."""
    if row.section in ("step", "swap", "compile"):
        return timed(lambda rec: fit_rows(list(row.overrides), setup, row.depth, rec), setup, args.warmup)
    data = dataset(setup, args)
    if isinstance(data, dict):  # why the data set or its cache could not be made
        return data
    if row.section == "cached_live":
        cache = training_cache(setup, data)
        if isinstance(cache, dict):
            return cache
        return timed(lambda rec: train_stage(list(row.overrides), setup, data, cache, rec), setup, args.warmup)
    return timed(lambda rec: precompute_stage(list(row.overrides), setup, data, args.samples), setup, 0)


def dataset(setup: Setup, args: argparse.Namespace) -> Path | dict:
    """A synthetic data set at `--resolution` (made once per work folder), or why the stages cannot run here."""
    from qie.demo.synthetic import make_dataset
    from qie.models import model_spec

    cfg = stage_config("precompute", setup.base)
    from qie.config import typed

    spec = model_spec(typed(cfg.model))
    if spec.family.outputs.layers:
        return {"error": "skipped", "detail": "the synthetic data set has no layers (a layered model trains on them)"}
    if setup.real and (why := no_checkpoint(cfg.model)):
        return {"error": "skipped", "detail": why}
    root = setup.work / "data"
    if not (root / "ready").is_file():
        shutil.rmtree(root, ignore_errors=True)
        make_dataset(root, args.samples, 0, size=setup.resolution, controls=setup.controls > 0)
        (root / "ready").write_text("")
    return root / "train"


def training_cache(setup: Setup, data: Path) -> Path | dict:
    """The cache the cached training row reads: one a precompute row filled (they run first), else filled here."""
    from qie.errors import QieError
    from qie.stages import precompute

    cache = setup.work / "cache"
    if not (setup.work / "cache.ready").is_file():
        shutil.rmtree(cache, ignore_errors=True)
        try:
            fill = [f"data.path={data}", f"cache.dir={cache}", "precompute.batch_size=8"]
            precompute.run(stage_config("precompute", setup.base, fill), setup.work / "precompute_fill")
        except (QieError, OSError) as e:
            return {"error": "failed", "detail": f"filling the cache: {type(e).__name__}: {first_line(e)}"[:300]}
        (setup.work / "cache.ready").write_text("")
    return cache


def no_checkpoint(model) -> str | None:
    """Why the stages cannot load the model here: its checkpoint is neither a folder nor in the Hugging Face cache
    (nothing is downloaded); None when it can."""
    from huggingface_hub import try_to_load_from_cache

    source = str(model.pretrained_model_name_or_path)
    if Path(source).expanduser().is_dir():
        return None
    with contextlib.suppress(Exception):
        if isinstance(try_to_load_from_cache(source, "model_index.json", revision=model.revision), str):
            return None
    return f"no local checkpoint of {source} (not a folder, not in the Hugging Face cache): give --checkpoint DIR"


def first_line(e: BaseException) -> str:
    return (str(e).splitlines() or [""])[0]


def train_stage(overrides: list[str], setup: Setup, data: Path, cache: Path, recorder: StepRecorder) -> None:
    from qie.stages import train

    where = [f"data.path={data}", f"cache.dir={cache}", "data.prefetch=0"]
    cfg = stage_config("train", setup.train, [*where, *overrides])
    train.run(cfg, Path(tempfile.mkdtemp(prefix="train_", dir=setup.work)), on_step_end=recorder)


def precompute_stage(overrides: list[str], setup: Setup, data: Path, samples: int) -> dict:
    """Samples per second of the precompute stage into an empty cache: over the stage's wall time (model load
    included), and over its steady phase (first entry file written to the last, the first batch left out)."""
    from qie.stages import precompute

    cache = Path(tempfile.mkdtemp(prefix="cache_", dir=setup.work))
    cfg = stage_config("precompute", setup.base, [f"data.path={data}", f"cache.dir={cache}", *overrides])
    t0 = time.perf_counter()
    precompute.run(cfg, Path(tempfile.mkdtemp(prefix="pre_", dir=setup.work)))
    wall = time.perf_counter() - t0
    written = sorted(
        p.stat().st_mtime for p in cache.rglob("*.safetensors") if "state" not in p.relative_to(cache).parts
    )
    batch = int(cfg.precompute.batch_size)
    steady = written[-1] - written[0] if written else 0.0
    steady_rate = (samples - min(batch, samples)) / steady if steady > 0 and samples > batch else math.nan
    if not (setup.work / "cache.ready").is_file():  # a complete cache: the cached training row reads it
        shutil.rmtree(setup.work / "cache", ignore_errors=True)
        cache.rename(setup.work / "cache")
        (setup.work / "cache.ready").write_text("")
    return {"samples": samples, "wall_s": wall, "rate_wall": samples / wall, "rate_steady": steady_rate}


def run_in_child(row: Row, argv: list[str], work: Path) -> dict:
    """One row in a fresh process: its peak memory is its own, and a crash is its row's."""
    cmd = [sys.executable, SCRIPT, *argv, "--child", row.key, "--work", str(work)]
    proc = subprocess.run(cmd, env=child_env(), capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX) :])
    tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    oom = "out of memory" in proc.stderr.lower()
    return {"error": "OOM" if oom else f"failed (exit {proc.returncode})", "detail": tail[:300]}


# --- markdown ------------------------------------------------------------------------------------------------


def machine_line(setup: Setup) -> str:
    import importlib.metadata as md

    import torch

    def version(pkg: str) -> str:
        try:
            return md.version(pkg)
        except md.PackageNotFoundError:
            return "missing"

    if setup.device.startswith("cuda"):
        props = torch.cuda.get_device_properties(0)
        driver = "unknown"
        query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
        with contextlib.suppress(Exception):
            driver = subprocess.run(query, capture_output=True, text=True, timeout=30).stdout.splitlines()[0].strip()
        gpu = f"GPU {props.name} ({props.total_memory / 2**30:.0f} GiB), driver {driver}, CUDA {torch.version.cuda}"
    else:
        gpu = "no GPU (CPU run)"
    try:
        load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        load = "unknown"
    return (f"{gpu}; {os.cpu_count()} CPU cores, {platform.machine()}, load avg {load}; Python "
            f"{platform.python_version()}, torch {torch.__version__}, diffusers {version('diffusers')}, "
            f"transformers {version('transformers')}, peft {version('peft')}, optimum-quanto "
            f"{version('optimum-quanto')}, accelerate {version('accelerate')}")  # fmt: skip


def machines(results: dict[str, dict], setup: Setup) -> list[str]:
    """The machine lines of the rows: this one's, or those the reused rows were measured on."""
    # one line per machine: rows of one run differ only in the load they saw
    runs = {r["machine"].split(", load avg")[0]: r["machine"] for r in results.values() if r.get("machine")}
    lines = list(runs.values())
    ran_here = any("machine" not in r and r.get("error") != "not run" for r in results.values())
    return lines + [machine_line(setup)] if ran_here or not lines else lines


def peak_tflops(args: argparse.Namespace, setup: Setup) -> float | None:
    import torch

    if args.peak_tflops:
        return args.peak_tflops
    if not setup.device.startswith("cuda"):
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_TFLOPS if k in name), None)


def model_flops(setup: Setup, depth: int | None) -> float | None:
    """Model FLOPs of one step with `depth` blocks (None: the model's own), counted on fake tensors
    (`qie.stages.memory_plan.step_flops`)."""
    import torch

    from qie.components import prepare_model
    from qie.models import model_spec
    from qie.stages.memory_plan import step_flops

    cfg = stage_config("train", setup.train)
    from qie.config import typed

    spec = model_spec(typed(cfg.model)) if setup.real else prepare_model(typed(cfg.model))
    work = workload(cfg, spec, setup)
    if setup.real:  # bf16 weights under bf16 autocast, as accelerate's mixed precision runs them
        import dataclasses

        work = dataclasses.replace(work, dtype=torch.bfloat16)
    lora = cfg.train.lora
    config = transformer_config(cfg, spec, setup, depth)
    return step_flops(spec.family, config, work, int(lora.rank), list(lora.target_modules))


def fmt(x: object, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    if isinstance(x, float):
        if abs(x) >= 1000:
            return f"{x:,.0f}"
        return f"{x:.3f}" if x == 0 or abs(x) >= 0.01 else f"{x:.{digits}g}"
    return str(x)


def md_table(headers: list[str], rows: list[list[object]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(fmt(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def failed(r: dict, width: int) -> list[object] | None:
    """The cells of a row that did not run: its error, then dashes."""
    if "error" not in r:
        return None
    return [r["error"], *["–"] * (width - 2), r.get("detail", "")]


def mem(r: dict, key: str) -> object:
    return r.get(key) if r.get(key) is not None else "n/a"


def section_markdown(section: str, rows: list[Row], results: dict[str, dict], flops: dict,
                     peak: float | None) -> str:  # fmt: skip
    mine = [(row, results[row.key]) for row in rows if row.section == section]
    out = [f"### {TITLES[section]}", ""]
    if section == "step":
        headers = ["config", "weights", "checkpointing", "s/it", "peak alloc GiB", "peak reserved GiB", "TFLOP/s",
                   "MFU", "note"]  # fmt: skip
        table = []
        for row, r in mine:
            info = dict(row.info)
            if bad := failed(r, len(headers) - 3):
                table.append([row.name, info["weights"], info["checkpointing"], *bad])
                continue
            tflops = flops[row.depth] / r["s_per_it"] / 1e12 if flops.get(row.depth) else None
            mfu = f"{100 * tflops / peak:.1f}%" if tflops and peak else "n/a"
            note = f"loss {fmt(r['first_loss'])} -> {fmt(r['loss'])}"
            table.append([row.name, info["weights"], info["checkpointing"], r["s_per_it"], mem(r, "peak_alloc_gib"),
                          mem(r, "peak_reserved_gib"), tflops, mfu, note])  # fmt: skip
        out.append(md_table(headers, table))
        out.append("")
        counts = "; ".join(f"{fmt(f / 1e12 if f else None)} TFLOP" + (f" with {d} blocks" if d else "")
                           for d, f in flops.items() if d in {row.depth for row, _ in mine})  # fmt: skip
        out.append(f"Model FLOPs per step: {counts} (forward + backward, counted on fake tensors, no recomputation); "
                   f"MFU against {fmt(peak)} TFLOP/s dense bf16. Loss: the first step's -> the last's "
                   "(the same batch every step).")  # fmt: skip
    elif section == "swap":
        headers = ["config", "weights", "blocks swapped", "s/it", "vs swap 0", "peak alloc GiB", "peak reserved GiB",
                   "fits 24 GB", "note"]  # fmt: skip
        table, notes = [], []
        base = {dict(row.info)["weights"]: r.get("s_per_it") for row, r in mine if dict(row.info)["swapped"] == 0}
        for row, _ in mine:  # no swap-0 row (--swap-fractions): the step row with checkpointing at that depth
            w = dict(row.info)["weights"]
            base.setdefault(w, results.get(f"step/{at(w + '+gc', row.depth)}", {}).get("s_per_it"))
        for row, r in mine:
            info = dict(row.info)
            if info["asked"] != [info["swapped"]]:
                what = "of" if isinstance(info["asked"][0], str) else "clamped to"
                notes.append(f"{'/'.join(map(str, info['asked']))} {what} the model's {info['blocks']} blocks")
            if bad := failed(r, len(headers) - 3):
                table.append([row.name, info["weights"], info["swapped"], *bad])
                continue
            b = base.get(info["weights"])
            ratio = f"{r['s_per_it'] / b:.2f}x" if b else "n/a"
            reserved = r.get("peak_reserved_gib")
            fits = "n/a" if reserved is None else ("yes" if reserved <= FITS_24GB_GIB else "no")
            table.append([row.name, info["weights"], info["swapped"], r["s_per_it"], ratio, mem(r, "peak_alloc_gib"),
                          mem(r, "peak_reserved_gib"), fits, f"loss {fmt(r['loss'])}"])  # fmt: skip
        out.append(md_table(headers, table))
        out.append("")
        out.append("Fits 24 GB: peak reserved <= 23 GiB. " + ("; ".join(sorted(set(notes))) + "." if notes else ""))
    elif section == "cached_live":
        headers = ["embeddings", "s/it", "vs cached", "peak alloc GiB", "peak reserved GiB", "note"]
        table = []
        cached = results.get("cached_live/cached", {}).get("s_per_it")
        for row, r in mine:
            if bad := failed(r, len(headers)):
                table.append([row.name, *bad])
                continue
            ratio = f"{r['s_per_it'] / cached:.2f}x" if cached else "n/a"
            table.append([row.name, r["s_per_it"], ratio, mem(r, "peak_alloc_gib"), mem(r, "peak_reserved_gib"),
                          f"loss {fmt(r['loss'])}"])  # fmt: skip
        out.append(md_table(headers, table))
    elif section == "precompute":
        headers = ["precompute.batch_size", "samples", "samples/s (steady)", "samples/s (wall)", "wall s",
                   "peak alloc GiB", "note"]  # fmt: skip
        table = []
        for row, r in mine:
            if bad := failed(r, len(headers)):
                table.append([dict(row.info)["batch"], *bad])
                continue
            table.append([dict(row.info)["batch"], r["samples"], r["rate_steady"], r["rate_wall"], r["wall_s"],
                          mem(r, "peak_alloc_gib"), ""])  # fmt: skip
        out.append(md_table(headers, table))
        out.append("")
        out.append("Steady: the first entry file written to the last (the first batch left out); wall: the whole "
                   "stage, model load included.")  # fmt: skip
    elif section == "compile":
        headers = ["variant", "s/it", "first step s", "vs eager", "peak alloc GiB", "note"]
        table = []

        def eager_of(row: Row) -> dict:
            return results.get(f"compile/{row.name.replace('compiled', 'eager')}", {})

        for row, r in mine:
            if bad := failed(r, len(headers)):
                table.append([row.name, *bad])
                continue
            eager = eager_of(row)
            ratio = f"{r['s_per_it'] / eager['s_per_it']:.2f}x" if eager.get("s_per_it") else "n/a"
            table.append([row.name, r["s_per_it"], r["first_step_s"], ratio, mem(r, "peak_alloc_gib"),
                          f"loss {fmt(r['loss'])}"])  # fmt: skip
        out.append(md_table(headers, table))
        for row, compiled in mine:
            eager = eager_of(row)
            if "compiled" in row.name and eager.get("s_per_it") and compiled.get("s_per_it"):
                out.append("")
                out.append(f"{row.name}: compiled/eager step = {compiled['s_per_it'] / eager['s_per_it']:.2f}x; "
                           f"compile time (first compiled step less the first eager step) = "
                           f"{compiled['first_step_s'] - eager['first_step_s']:.1f} s")  # fmt: skip
    return "\n".join(out)


BYTES_PER_WEIGHT = {"bf16": 2.0, "fp32": 4.0, "fp8": 1.0, "fp8q": 1.0, "int8": 1.0, "int4": 0.5, "nf4": 0.5}


def linear(d1: int, v1: float, d2: int, v2: float, d: int) -> tuple[float, float]:
    """(value per block, value at d blocks) of the line through (d1, v1) and (d2, v2)."""
    per_block = (v2 - v1) / (d2 - d1)
    return per_block, v2 + per_block * (d - d2)


def extrapolation_markdown(rows: list[Row], results: dict[str, dict], depths: list[int], full: int,
                           flops: dict, peak: float | None) -> str:  # fmt: skip
    """The step rows at two depths carried linearly to the model's `full` block count, and the swap rows (at the
    deeper one) carried with them: the measured ones at the deepest depth, the rest marked extrapolated."""
    d1, d2 = depths
    by_key = {row.key: (row, results[row.key]) for row in rows}
    step: dict[str, dict] = {}
    table = []
    for row, r in (by_key[k] for k in by_key if k.startswith("step/") and k.endswith(f"@{d2}")):
        name = row.name.rsplit("@", 1)[0]
        r1 = results.get(f"step/{name}@{d1}", {})
        if "error" in r or "error" in r1:
            table.append([name, *["–"] * 6, r.get("detail") or r1.get("detail", "")])
            continue
        s_block, s_full = linear(d1, r1["s_per_it"], d2, r["s_per_it"], full)
        fit = r1.get("peak_reserved_gib") is not None and r.get("peak_reserved_gib") is not None
        m_block, m_full = linear(d1, r1["peak_reserved_gib"], d2, r["peak_reserved_gib"], full) if fit else (None, None)
        fits = "n/a" if m_full is None else ("yes" if m_full <= FITS_24GB_GIB else "no")
        step[name] = {"s_full": s_full, "m_block": m_block, "s": r["s_per_it"]}
        mfu = f"{100 * flops[None] / s_full / 1e12 / peak:.1f}%" if flops.get(None) and peak else "n/a"
        bf16 = results.get(f"step/bf16{name[len(name.split('+')[0]) :]}@{d2}", {})
        loss = f"first loss {fmt(r['first_loss'])}"
        if bf16.get("first_loss") and not name.startswith("bf16"):
            loss += f" ({100 * (r['first_loss'] / bf16['first_loss'] - 1):+.2f}% vs bf16)"
        table.append([name, s_block, s_full, m_block, m_full, mfu, fits, loss])
    headers = ["config", "s per block", f"s/it at {full} blocks", "GiB per block (reserved)",
               f"peak reserved GiB at {full} blocks", "MFU", "fits 24 GB", "note"]  # fmt: skip
    out = [f"### (f) The full {full}-block model, extrapolated from {d1} and {d2} blocks", "",
           md_table(headers, table), ""]  # fmt: skip
    swap_table = []
    for row, r in (by_key[k] for k in by_key if k.startswith("swap/")):
        info = dict(row.info)
        ref = step.get(f"{info['weights']}+gc")
        if "error" in r or not ref or ref["m_block"] is None:
            why = r.get("detail", "no step row with checkpointing (and CUDA memory) to scale by")
            swap_table.append([row.name, *["–"] * 4, why])
            continue
        share = info["swapped"] / d2
        block_gib = r["block_params"] * BYTES_PER_WEIGHT.get(info["weights"], 2.0) / 2**30
        m_full = r["peak_reserved_gib"] + (full - d2) * (ref["m_block"] - share * block_gib)
        ratio = r["s_per_it"] / ref["s"]
        swap_table.append([row.name, f"{share:.0%}", f"{ratio:.2f}x", ref["s_full"] * ratio, m_full,
                           "yes" if m_full <= FITS_24GB_GIB else "no"])  # fmt: skip
    if swap_table:
        headers = ["config", "share of blocks swapped", f"vs no swap at {d2} blocks", f"s/it at {full} blocks",
                   f"peak reserved GiB at {full} blocks", "fits 24 GB"]  # fmt: skip
        out += [md_table(headers, swap_table), ""]
    out.append(f"Extrapolated, not measured: each figure at {full} blocks is the line through the {d1}- and "
               f"{d2}-block rows (every block does the same work and holds the same weights). A swap row keeps its "
               f"measured slowdown against the step row with checkpointing at {d2} blocks; its memory adds, for "
               f"each further block, that row's reserved GiB per block less the swapped share of the block's "
               f"weights. MFU uses the {full}-block model's FLOPs. Fits 24 GB: <= {FITS_24GB_GIB:.0f} GiB "
               "reserved.")  # fmt: skip
    return "\n".join(out)


def markdown(args: argparse.Namespace, argv: list[str], setup: Setup, rows: list[Row], results: dict[str, dict],
             flops: dict, peak: float | None) -> str:  # fmt: skip
    size = "real size, random weights" if setup.real else "tiny, CPU smoke run: not a benchmark"
    lines = [
        f"## GPU table: {setup.model} ({size})",
        "",
        "```",
        "python scripts/bench_gpu.py " + " ".join(argv),
        "```",
        "",
        *(f"machine: {m}" for m in machines(results, setup)),
        "",
        f"Step inputs: {setup.resolution}x{setup.resolution} target, {setup.controls} control image(s) of the same "
        f"size, the planner's prompt length; median s/it of {args.steps} steps after {args.warmup} warm-up steps.",
    ]  # fmt: skip
    for section in args.sections:
        lines += ["", section_markdown(section, rows, results, flops, peak)]
    if len(args.depths) == 2 and "step" in args.sections:
        full = num_blocks(setup, None)
        lines += ["", extrapolation_markdown(rows, results, args.depths, full, flops, peak)]
    return "\n".join(lines) + "\n"


# --- main ------------------------------------------------------------------------------------------------------


def reused(path: str | None, model: str) -> dict[str, dict]:
    """The rows of `model` that ran, from earlier runs' --results files (comma-separated; the last of each key
    wins), each with the machine line of the run that measured it."""
    rows: dict[str, dict] = {}
    for file in (path or "").split(","):
        for line in Path(file).read_text(encoding="utf-8").splitlines() if file else []:
            r = json.loads(line)
            if r.pop("model") == model and "error" not in r:
                rows[r.pop("row")] = r
    return rows


def run_rows(rows: list[Row], setup: Setup, args: argparse.Namespace, child_argv: list[str] | None,
             work: Path) -> dict[str, dict]:  # fmt: skip
    """Every row, in a child process each (`child_argv`) or in this one; rows not started by `--deadline` say so.
    Precompute runs before cached training (that row reads a cache a precompute row filled); nf4 rows run last."""
    start = time.perf_counter()
    results: dict[str, dict] = {}
    earlier = reused(args.reuse, setup.model)
    for row in sorted(rows, key=lambda r: ("model.quantize=nf4" in r.overrides, RUN_ORDER.index(r.section))):
        t0 = time.perf_counter()
        if row.key in earlier:
            results[row.key] = earlier[row.key]
            continue
        if args.deadline is not None and t0 - start > args.deadline:
            result = {"error": "not run", "detail": f"the time budget (--deadline {args.deadline:.0f} s) ran out"}
        else:
            result = run_in_child(row, child_argv, work) if child_argv is not None else run_row(row, setup, args)
        results[row.key] = result
        print(f"bench_gpu: {row.key}: {json.dumps(result)} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr,
              flush=True)  # fmt: skip
        if args.results:
            with open(args.results, "a", encoding="utf-8") as f:
                record = {"model": setup.model, "row": row.key, **result, "machine": machine_line(setup)}
                f.write(json.dumps(record) + "\n")
    return results


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    os.environ.setdefault("TQDM_DISABLE", "1")
    if not args.tiny:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no download of a checkpoint the machine lacks
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="qie_bench_gpu_"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        setup = make_setup(args, work)
        rows = plan_rows(args, setup)
        if args.child:
            (row,) = [r for r in rows if r.key == args.child]
            result = run_row(row, setup, args)
            print(RESULT_PREFIX + json.dumps(result), flush=True)
            return result
        isolate = setup.device.startswith("cuda") and not args.in_process
        child_argv = [a for a in argv if a != "--in-process"]
        if "--out" in child_argv:
            i = child_argv.index("--out")
            del child_argv[i : i + 2]
        results = run_rows(rows, setup, args, child_argv if isolate else None, work)
        depths = [*args.depths, None] if len(args.depths) == 2 else args.depths
        flops = {d: model_flops(setup, d) for d in depths} if "step" in args.sections else {}
        md = markdown(args, argv, setup, rows, results, flops, peak_tflops(args, setup))
        print(md)
        if args.out:
            Path(args.out).write_text(md, encoding="utf-8")
        return {"markdown": md, "results": results, "model": setup.model, "flops": flops.get(args.depths[-1])}
    finally:
        if not args.work and not args.child:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
