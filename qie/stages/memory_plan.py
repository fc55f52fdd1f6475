"""Memory of a LoRA training step, estimated without a GPU, and the cheapest set of memory levers that fits one.

Weights are counted on the meta device from the transformer's config. The step's own memory (activations
kept for the backward pass, their gradients, temporaries, the LoRA's gradients) is measured by running qie's
real training step (the family's loss + backward) on fake tensors, which have shapes but no storage:
a dispatch mode adds up the bytes of every tensor an operation creates and subtracts them when the tensor is
freed, and keeps the peak. The fake tensors are CPU tensors, so attention takes the fused (flash) kernel
that saves only its output and log-sum-exp, as the GPU kernels do; autocast is on for bf16 models, as
accelerate's mixed precision is on a GPU.

What it leaves out: the CUDA context and the caching allocator's slack (`reserve_gb`), and kernels'
workspaces. `python -m qie.plan` prints the table; docs/guide.md ("Memory") explains it.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

GIB = 2**30
# Bytes of optimizer state per trained parameter (fp32 LoRA weights), by `_target_`.
OPTIMIZER_STATE_BYTES = {
    "torch.optim.AdamW": 8,
    "torch.optim.Adam": 8,
    "bitsandbytes.optim.AdamW8bit": 2,
    "torch.optim.SGD": 4,
    "transformers.optimization.Adafactor": 0,
}


@dataclass(frozen=True)
class Workload:
    """One training step's inputs: batch size and token counts (transformer tokens: the family's patches of latents)."""

    batch: int = 1
    target_tokens: int = 4096
    control_tokens: tuple[int, ...] = (4096,)
    prompt_tokens: int = 1300
    dtype: torch.dtype = torch.bfloat16


@dataclass(frozen=True)
class Levers:
    quantize: str = "none"
    gradient_checkpointing: bool = False
    activation_offload: bool = False
    blocks_to_swap: int = 0


@dataclass
class Estimate:
    """Bytes on the GPU by part (and in pinned host memory) for one combination of levers."""

    levers: Levers
    parts: dict[str, int] = field(default_factory=dict)
    host: int = 0

    @property
    def total(self) -> int:
        return sum(self.parts.values())


class LiveBytes(TorchDispatchMode):
    """Bytes of the tensors created while active and still alive; `peak` is their largest sum."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self.seen: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        returns = func._schema.returns
        for i, t in enumerate(tree_flatten(out)[0]):
            aliases = i < len(returns) and returns[i].alias_info is not None  # a view or an in-place result
            if isinstance(t, torch.Tensor) and not aliases:
                self._track(t.untyped_storage())
        return out

    def _track(self, storage) -> None:
        key = id(storage)
        if key in self.seen:
            return
        size = storage.nbytes()
        self.seen.add(key)
        self.live += size
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, key, size)

    def _free(self, key: int, size: int) -> None:
        self.seen.discard(key)
        self.live -= size


class _OffloadedPlaceholder(torch.autograd.graph.saved_tensors_hooks):
    """Activation offload as the tracker sees it: a saved tensor leaves the device and comes back when needed."""

    def __init__(self) -> None:
        from qie.runtime.offload import _is_weight

        self.bytes = 0

        def pack(t):
            if _is_weight(t):
                return t
            self.bytes += t.numel() * t.element_size()
            return t.shape, t.dtype

        super().__init__(pack, lambda p: p if isinstance(p, torch.Tensor) else torch.empty(p[0], dtype=p[1]))


class RealWhereKnown(TorchDispatchMode):
    """Runs an operation on real tensors when every tensor it takes is real (not fake), below the fake mode.

    A family's step may index with a mask whose values decide shapes (Qwen-Image-2.1 spreads the prompt's image
    slots with `repeat_interleave`); fake tensors have no values, so those masks stay real: what is computed
    from them alone stays real, the rest is fake as usual.
    """

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch._subclasses.fake_tensor import FakeTensor
        from torch.utils._python_dispatch import _disable_current_modes

        kwargs = kwargs or {}
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        # A Python number taken by an operation (`torch.where(mask, 4, 1)`) is known too.
        known = not any(isinstance(t, FakeTensor) for t in tensors)
        if (tensors and known) or func is torch.ops.aten.scalar_tensor.default:
            with _disable_current_modes():
                return func(*args, **kwargs)
        return func(*args, **kwargs)


def build_fake(family: Any, config: dict, dtype: torch.dtype, rank: int, targets: Sequence[str], checkpointing: bool):
    """The family's transformer (+ LoRA) with fake CPU weights, and the fake mode it lives in."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from qie.adapters.lora import add_lora

    with torch.device("meta"):
        model = family.part_class("transformer")(**config)
    with _quiet_diffusers():  # it warns about modules to keep in float32 even when it names none
        model.to(dtype)
    model.requires_grad_(False)
    add_lora(model, rank, rank, list(targets))
    if checkpointing:
        model.enable_gradient_checkpointing()
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    with fake:
        model.to_empty(device="cpu")
        # Tensors kept as plain attributes (rotary tables, alone or in a list) were made on the meta device: fake
        # ones of their shape.
        for module in model.modules():
            for name, value in list(vars(module).items()):
                if _on_meta(value):
                    setattr(module, name, torch.empty_like(value, device="cpu"))
                elif isinstance(value, (list, tuple)) and value and all(_on_meta(v) for v in value):
                    setattr(module, name, type(value)(torch.empty_like(v, device="cpu") for v in value))
    model.train()
    return model, fake


@contextlib.contextmanager
def _quiet_diffusers():
    import logging

    log = logging.getLogger("diffusers")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def _on_meta(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.device.type == "meta"


def simulate_step(family: Any, model, fake, work: Workload, offload: bool = False) -> tuple[int, int]:
    """Peak bytes the family's training step creates (forward + backward), and the bytes activation offload
    moves out. The step's inputs are fake, but for the family's masks (see `RealWhereKnown`)."""

    def make(*shape: int, dtype: torch.dtype) -> torch.Tensor:
        with fake:
            return torch.empty(*shape, dtype=dtype)

    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=work.dtype == torch.bfloat16)
    hooks = _OffloadedPlaceholder()
    batch, noise, sigmas = family.planner.step_inputs(dict(model.config), work, make)
    with fake, RealWhereKnown(), autocast:
        with LiveBytes() as tracker:
            with hooks if offload else contextlib.nullcontext():
                loss = family.loss(model, batch, noise, sigmas, "none")
            loss.backward()
            del loss
    return tracker.peak, hooks.bytes


@dataclass(frozen=True)
class WeightBytes:
    """Transformer weight bytes: outside the blocks, and per block; trained LoRA parameters."""

    other: int
    block: int
    blocks: int
    lora_params: int


def weight_bytes(
    family: Any, config: dict, dtype: torch.dtype, quantize: str, rank: int, targets: Sequence[str]
) -> WeightBytes:
    """Counted on the meta device; quantization stores the linear layers but those the family keeps in full
    precision as `quantized_bytes` counts them."""
    from peft import LoraConfig

    with torch.device("meta"):
        model = family.part_class("transformer")(**config)
    kept = tuple(n.rstrip("*") for n in family.keep_full_precision)
    size = torch.tensor([], dtype=dtype).element_size()

    def nbytes(module: torch.nn.Module, prefix: str) -> int:
        total = 0
        for name, p in module.named_parameters(prefix=prefix):
            owner = name.rsplit(".", 1)[0]
            linear = name.endswith(".weight") and p.ndim == 2 and not owner.startswith(kept)
            total += quantized_bytes(quantize, p.shape, size) if quantize != "none" and linear else p.numel() * size
        return total

    blocks = getattr(model, family.blocks)
    block = nbytes(blocks[0], f"{family.blocks}.0")
    other = sum(nbytes(m, n) for n, m in model.named_children() if n != family.blocks)
    model.add_adapter(LoraConfig(r=rank, lora_alpha=rank, target_modules=list(targets)))
    lora = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    return WeightBytes(other, block, len(blocks), lora)


# Weights per group sharing a scale: optimum-quanto's qint4 (a scale and a shift per group, in the model's dtype),
# bitsandbytes' nf4 (an fp32 absmax per block; diffusers' default, no double quantization).
INT4_GROUP, NF4_BLOCK = 128, 64


def quantized_bytes(quantize: str, shape: Sequence[int], size: int) -> int:
    """Bytes of one quantized linear weight of `shape` (rows, columns); `size`: the model dtype's element size.

    fp8/int8: 1 byte per weight + a scale per row; int4: half a byte + a scale and a shift per 128 weights;
    nf4: half a byte + a 4-byte absmax per 64 weights.
    """
    rows, numel = shape[0], shape[0] * shape[1]
    if quantize == "int4":
        return numel // 2 + 2 * size * -(-numel // INT4_GROUP)
    if quantize == "nf4":
        return numel // 2 + 4 * -(-numel // NF4_BLOCK)
    return numel + rows * size


def step_memory(
    family: Any, config: dict, work: Workload, rank: int, targets: Sequence[str], checkpointing: bool, offload: bool
):
    """(peak bytes of the step, bytes offloaded) for the whole transformer: simulated with up to 4 blocks and
    extrapolated linearly in the block count beyond (each block adds the same activations)."""
    layers = int(config["num_layers"])

    def simulate(n: int) -> tuple[int, int]:
        model, fake = build_fake(family, {**config, "num_layers": n}, work.dtype, rank, targets, checkpointing)
        return simulate_step(family, model, fake, work, offload)

    if layers <= 4:
        return simulate(layers)
    (p2, o2), (p4, o4) = simulate(2), simulate(4)
    return p4 + (layers - 4) * (p4 - p2) // 2, o4 + (layers - 4) * (o4 - o2) // 2


def step_flops(family: Any, config: dict, work: Workload, rank: int, targets: Sequence[str]) -> float:
    """Model FLOPs of one training step (the family's loss, forward + backward, LoRA included; no recomputation),
    counted by torch's FlopCounterMode on fake tensors as `step_memory` runs the step: with 2 and 4 blocks,
    extrapolated linearly in the block count (every block does the same work)."""
    from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

    aten = torch.ops.aten
    # The fake tensors are CPU tensors: attention takes the CPU flash kernel, which torch's table leaves out;
    # its FLOPs are the fused attention's, counted by torch's own formulas.
    cpu_attention = {  # FlopCounterMode hands a custom formula the tensors' shapes
        aten._scaled_dot_product_flash_attention_for_cpu: lambda q, k, v, *a, out_shape=None, **kw: sdpa_flop_count(
            q, k, v
        ),
        aten._scaled_dot_product_flash_attention_for_cpu_backward: lambda g, q, k, v, *a, out_shape=None, **kw: (
            sdpa_backward_flop_count(g, q, k, v)
        ),
    }

    def count(n: int) -> float:
        model, fake = build_fake(family, {**config, "num_layers": n}, work.dtype, rank, targets, False)

        def make(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            with fake:
                return torch.empty(*shape, dtype=dtype)

        batch, noise, sigmas = family.planner.step_inputs(dict(model.config), work, make)
        autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=work.dtype == torch.bfloat16)
        with fake, RealWhereKnown(), autocast, FlopCounterMode(display=False, custom_mapping=cpu_attention) as counter:
            family.loss(model, batch, noise, sigmas, "none").backward()
        return float(counter.get_total_flops())

    layers = int(config["num_layers"])
    if layers <= 4:
        return count(layers)
    f2, f4 = count(2), count(4)
    return f4 + (layers - 4) * (f4 - f2) / 2


def text_encoder_bytes(family: Any, config: dict, quantize: str) -> int:
    """Weight bytes of the family's text encoder built from `config` on the meta device, in bf16 or with 8-bit
    linear layers."""
    cls = family.part_class("text_encoder")
    with torch.device("meta"):
        model = cls(cls.config_class(**config))
    total = sum(p.numel() for p in model.parameters()) * 2
    if quantize == "none":
        return total
    linear = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    return total - sum(w.numel() for w in linear) + sum(w.shape[0] * 2 for w in linear)


def estimate(weights: WeightBytes, step: dict, levers: Levers, optimizer_state: int, reserve: int) -> Estimate:
    """GPU bytes by part for `levers`; `step[(checkpointing, offload)]` = (step peak, offloaded bytes)."""
    swapped = levers.blocks_to_swap
    on_device = weights.blocks - swapped + min(swapped, 2)  # two swapped blocks at a time: running, next
    peak, offloaded = step[(levers.gradient_checkpointing, levers.activation_offload)]
    parts = {
        "transformer weights": weights.other + on_device * weights.block,
        "LoRA weights, gradients, optimizer": weights.lora_params * (4 + 4 + optimizer_state),
        "step: activations, gradients, temporaries": peak,
        "CUDA context and allocator reserve": reserve,
    }
    return Estimate(levers, parts, host=swapped * weights.block + offloaded)


def plan(weights: dict[str, WeightBytes], step: dict, budget: int, optimizer_state: int, reserve: int) -> list:
    """For each quantization x checkpointing x offload: the fewest swapped blocks that fit `budget` (swap needs
    checkpointing), or the unswapped estimate when nothing fits. Rows in the order tried."""
    rows = []
    for quantize, w in weights.items():
        for checkpointing, offload in ((False, False), (True, False), (True, True)):
            levers = Levers(quantize, checkpointing, offload)
            best = estimate(w, step, levers, optimizer_state, reserve)
            # Block swap needs checkpointing, and moves plain and 8-bit weights only (not packed 4-bit ones).
            swaps = range(w.blocks + 1) if checkpointing and quantize not in ("int4", "nf4") else [0]
            for n in swaps:
                candidate = estimate(w, step, replace(levers, blocks_to_swap=n), optimizer_state, reserve)
                if candidate.total <= budget:
                    best = candidate
                    break
            rows.append(best)
    return rows
