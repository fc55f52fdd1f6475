"""Memory of a LoRA training step, estimated without a GPU, and the cheapest set of memory levers that fits one.

Weights are counted on the meta device from the transformer's config. The step's own memory (activations
kept for the backward pass, their gradients, temporaries, the LoRA's gradients) is measured by running qie's
real training step (`flow_matching_loss` + backward) on fake tensors, which have shapes but no storage:
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

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

GIB = 2**30
# Bytes of optimizer state per trained parameter (fp32 LoRA weights), by `_target_`.
OPTIMIZER_STATE_BYTES = {"torch.optim.AdamW": 8, "torch.optim.Adam": 8, "bitsandbytes.optim.AdamW8bit": 2,
                         "torch.optim.SGD": 4, "transformers.optimization.Adafactor": 0}  # fmt: skip


@dataclass(frozen=True)
class Workload:
    """One training step's inputs: batch size and token counts (packed latents: 2x2 patches of 8x latents)."""

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
        from qie.training.offload import _is_weight

        self.bytes = 0

        def pack(t):
            if _is_weight(t):
                return t
            self.bytes += t.numel() * t.element_size()
            return t.shape, t.dtype

        super().__init__(pack, lambda p: p if isinstance(p, torch.Tensor) else torch.empty(p[0], dtype=p[1]))


def build_fake(config: dict, dtype: torch.dtype, rank: int, targets: Sequence[str], checkpointing: bool):
    """The transformer (+ LoRA) with fake CPU weights, and the fake mode it lives in."""
    from diffusers import QwenImageTransformer2DModel
    from torch._subclasses.fake_tensor import FakeTensorMode

    from qie.training.lora import add_lora

    with torch.device("meta"):
        model = QwenImageTransformer2DModel(**config)
    model.to(dtype).requires_grad_(False)
    add_lora(model, rank, rank, list(targets))
    if checkpointing:
        model.enable_gradient_checkpointing()
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    with fake:
        model.to_empty(device="cpu")
        pos = model.pos_embed  # its rotary tables are plain attributes, made on the meta device: rebuild them
        model.pos_embed = type(pos)(theta=pos.theta, axes_dim=list(pos.axes_dim), scale_rope=pos.scale_rope)
    model.train()
    return model, fake


def step_inputs(config: dict, work: Workload, make=torch.empty):
    """(batch, noise, sigmas) of `work` for a transformer of `config`; `make(*shape, dtype=)` makes each tensor.
    Latents are squares of the token counts: the step's memory depends on the counts only."""
    from qie.types import Batch

    def latents(tokens: int) -> torch.Tensor:
        side = round(tokens**0.5)
        return make(work.batch, config["out_channels"], 1, 2 * side, 2 * side, dtype=work.dtype)

    batch = Batch(
        ids=["x"] * work.batch,
        latents=latents(work.target_tokens),
        control_latents=[latents(t) for t in work.control_tokens],
        prompt_embeds=make(work.batch, work.prompt_tokens, config["joint_attention_dim"], dtype=work.dtype),
        prompt_embeds_mask=None,
    )
    return batch, latents(work.target_tokens), torch.full((work.batch,), 0.5)


def simulate_step(model, fake, work: Workload, offload: bool = False) -> tuple[int, int]:
    """Peak bytes the training step creates (forward + backward), and the bytes activation offload moves out."""
    from qie.training.step import flow_matching_loss

    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=work.dtype == torch.bfloat16)
    hooks = _OffloadedPlaceholder()
    with fake, autocast:
        batch, noise, sigmas = step_inputs(dict(model.config), work)
        with LiveBytes() as tracker:
            with hooks if offload else contextlib.nullcontext():
                loss = flow_matching_loss(model, batch, noise, sigmas)
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


def weight_bytes(config: dict, dtype: torch.dtype, quantize: str, rank: int, targets: Sequence[str]) -> WeightBytes:
    """Counted on the meta device; fp8/int8 store the linear layers quantized (1 byte + a scale per row)."""
    from diffusers import QwenImageTransformer2DModel
    from peft import LoraConfig

    from qie.components.quantize import KEEP_FULL_PRECISION

    with torch.device("meta"):
        model = QwenImageTransformer2DModel(**config)
    kept = tuple(n.rstrip("*") for n in KEEP_FULL_PRECISION)
    size = torch.tensor([], dtype=dtype).element_size()

    def nbytes(module: torch.nn.Module, prefix: str) -> int:
        total = 0
        for name, p in module.named_parameters(prefix=prefix):
            owner = name.rsplit(".", 1)[0]
            linear = name.endswith(".weight") and p.ndim == 2 and not owner.startswith(kept)
            total += p.numel() + p.shape[0] * size if quantize != "none" and linear else p.numel() * size
        return total

    blocks = model.transformer_blocks
    block = nbytes(blocks[0], "transformer_blocks.0")
    other = sum(nbytes(m, n) for n, m in model.named_children() if n != "transformer_blocks")
    model.add_adapter(LoraConfig(r=rank, lora_alpha=rank, target_modules=list(targets)))
    lora = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    return WeightBytes(other, block, len(blocks), lora)


def step_memory(config: dict, work: Workload, rank: int, targets: Sequence[str], checkpointing: bool, offload: bool):
    """(peak bytes of the step, bytes offloaded) for the whole transformer: simulated with up to 4 blocks and
    extrapolated linearly in the block count beyond (each block adds the same activations)."""
    layers = int(config["num_layers"])

    def simulate(n: int) -> tuple[int, int]:
        model, fake = build_fake({**config, "num_layers": n}, work.dtype, rank, targets, checkpointing)
        return simulate_step(model, fake, work, offload)

    if layers <= 4:
        return simulate(layers)
    (p2, o2), (p4, o4) = simulate(2), simulate(4)
    return p4 + (layers - 4) * (p4 - p2) // 2, o4 + (layers - 4) * (o4 - o2) // 2


def text_encoder_bytes(config: dict, quantize: str) -> int:
    """Weight bytes of Qwen2.5-VL built from `config` on the meta device, in bf16 or with 8-bit linear layers."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    with torch.device("meta"):
        model = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(**config))
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
            swaps = range(w.blocks + 1) if checkpointing else [0]
            for n in swaps:
                candidate = estimate(w, step, replace(levers, blocks_to_swap=n), optimizer_state, reserve)
                if candidate.total <= budget:
                    best = candidate
                    break
            rows.append(best)
    return rows
