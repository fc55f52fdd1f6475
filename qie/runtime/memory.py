"""The memory levers of a training run, set up once around the transformer: gradient checkpointing, block swap,
activation offload and FSDP2 sharding (docs/guide.md, "Memory"; `python -m qie.plan` picks them).

None of them changes the training step: swap and offload hook the model, FSDP is accelerate's wrapping.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch

from qie.runtime.offload import BlockSwapper, offload_activations


@dataclass(frozen=True)
class MemorySettings:
    """`train.gradient_checkpointing`, `train.blocks_to_swap`, `train.activation_offload`, `train.fsdp`, and
    where the model family keeps its repeated blocks (the attribute, their class names)."""

    gradient_checkpointing: bool = False
    blocks_to_swap: int = 0
    activation_offload: bool = False
    fsdp: bool = False
    blocks: str = ""
    block_classes: tuple[str, ...] = ()

    @classmethod
    def of(cls, train: Any, family: Any) -> MemorySettings:
        """From the `train` config node (any object with the lever names as attributes) and the model family."""
        levers = {f.name: type(f.default)(getattr(train, f.name)) for f in fields(cls) if hasattr(train, f.name)}
        return cls(**levers, blocks=family.blocks, block_classes=tuple(family.block_classes()))

    def build_device(self, device: torch.device) -> str:
        """Where to build the transformer: the CPU when it must not reach the device whole (swap, FSDP)."""
        return "cpu" if self.blocks_to_swap or self.fsdp else str(device)

    def accelerator_kwargs(self) -> dict[str, Any]:
        """Extra Accelerator arguments: the FSDP2 plugin, sharding the transformer block by block."""
        if not self.fsdp:
            return {}
        from accelerate import FullyShardedDataParallelPlugin

        plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2,
            auto_wrap_policy="transformer_based_wrap",
            transformer_cls_names_to_wrap=list(self.block_classes),
            reshard_after_forward=True,
            state_dict_type="SHARDED_STATE_DICT",
            cpu_ram_efficient_loading=False,
        )
        return {"fsdp_plugin": plugin}


def enable_fsdp_on_cpu(accelerator: Any, settings: MemorySettings) -> None:
    """accelerate 1.15 turns its FSDP plugin on for GPUs only (on the CPU it silently runs DDP); torch's FSDP2
    runs on the CPU over gloo, so without CUDA qie switches accelerate's shared state to FSDP itself."""
    if not settings.fsdp:
        return
    if accelerator.num_processes < 2:
        accelerator.print("qie: warning: train.fsdp=true in one process: nothing to shard over, training unsharded")
        return
    if accelerator.device.type != "cpu":
        return
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    plugin = settings.accelerator_kwargs()["fsdp_plugin"]
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    AcceleratorState._shared_state["distributed_type"] = DistributedType.FSDP
    AcceleratorState._shared_state["fsdp_plugin"] = plugin


def apply_memory(transformer: torch.nn.Module, settings: MemorySettings, device: torch.device) -> bool:
    """Set up the levers on `transformer` (after what is trained was added, before the optimizer is made).

    Returns:
        Whether accelerate should still move the model to the device (not when blocks are swapped: it would
        move them all).
    """
    if settings.gradient_checkpointing:
        transformer.enable_gradient_checkpointing()
    place = True
    if settings.blocks_to_swap:
        blocks = getattr(transformer, settings.blocks)
        BlockSwapper(transformer, blocks, settings.blocks_to_swap, device)
        # DDP would broadcast the swapped weights from process 0 (they are on the CPU, or empty on CPU runs):
        # they are frozen and loaded alike everywhere.
        prefixes = tuple(f"{settings.blocks}.{i}." for i in range(settings.blocks_to_swap))
        frozen = [n for n, p in transformer.named_parameters() if n.startswith(prefixes) and not p.requires_grad]
        frozen += [n for n, _ in transformer.named_buffers() if n.startswith(prefixes)]
        torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(transformer, frozen)
        place = False
    if settings.activation_offload:
        offload_activations(transformer)
    return place


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of an FSDP2-sharded one (a collective: every process calls it); others as they are."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
    """The whole state dict of an FSDP2-sharded model on the CPU of process 0 (a collective; other processes get
    an empty dict); None for a model that is not sharded (its own `state_dict()` serves)."""
    from torch.distributed.tensor import DTensor

    if not any(isinstance(p, DTensor) for p in model.parameters()):
        return None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
