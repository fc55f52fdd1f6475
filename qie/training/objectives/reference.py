"""The reference model of an objective that compares the policy with where it started (DPO, GRPO, distillation's
teacher): the trained transformer with its adapter turned off (the base model), or switched to a LoRA file's adapter
loaded beside the trained one. Asked for through the objective's context (`ObjectiveContext.reference`)."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from qie.errors import ConfigError

REFERENCE_ADAPTER = "reference"


class Reference:
    """The reference model inside the trained one: its adapter layers turned off (the base), or switched to the
    adapter of `lora` loaded beside the trained one (`prepare`)."""

    def __init__(self, lora: str | None = None) -> None:
        self.lora = lora
        self.layers: list[Any] = []
        self.trained: list[str] = []
        self.flags: list[tuple[torch.nn.Parameter, bool]] = []

    def prepare(self, transformer: torch.nn.Module) -> None:
        from peft.tuners.tuners_utils import BaseTunerLayer

        from qie.adapters.lora import load_lora

        before = [m for m in transformer.modules() if isinstance(m, BaseTunerLayer)]
        if not before:
            raise ConfigError(
                "the objective's reference model is the trained model with its adapter turned off or switched: "
                "train.mode=lora"
            )
        self.trained = list(before[0].active_adapters)
        flags = {p: p.requires_grad for p in transformer.parameters()}
        if self.lora:
            with warnings.catch_warnings():  # peft's note that the model now holds two adapters: it is meant to
                warnings.filterwarnings("ignore", message="Already found a `peft_config`")
                load_lora(transformer, self.lora, adapter_name=REFERENCE_ADAPTER)
        self.layers = [m for m in transformer.modules() if isinstance(m, BaseTunerLayer)]
        for layer in self.layers:
            layer.set_adapter(self.trained)
        for p in transformer.parameters():  # the reference's weights are frozen, the trained ones as they were
            p.requires_grad_(flags.get(p, False))
        self.flags = [(p, p.requires_grad) for layer in self.layers for p in layer.parameters()]

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """The model computes as the reference inside this block (without a gradient)."""
        try:
            for layer in self.layers:
                if self.lora:
                    layer.set_adapter(REFERENCE_ADAPTER)
                else:
                    layer.enable_adapters(False)
            yield
        finally:
            for layer in self.layers:
                if self.lora:
                    layer.set_adapter(self.trained)
                else:
                    layer.enable_adapters(True)
            for p, flag in self.flags:  # peft's switches set requires_grad; the trained set stays as it was
                p.requires_grad_(flag)


class FrozenCopy:
    """A frozen copy of the trained weights (DiffusionNFT's sampling policy): its own tensors beside the trained
    parameters, swapped in while `active()` (a swap of storage, nothing copied) and moved towards the trained ones by
    `follow(decay)` (copy <- decay * copy + (1 - decay) * trained). Its tensors are what a checkpoint keeps of it.

    Raises:
        ConfigError: the trained weights are sharded across processes (train.fsdp=true): each process would keep
            a copy of its shard alone.
    """

    def __init__(self, transformer: torch.nn.Module) -> None:
        from torch.distributed.tensor import DTensor

        self.params = {n: p for n, p in transformer.named_parameters() if p.requires_grad}
        if not self.params:
            raise ConfigError("a frozen copy of the trained weights needs trained weights: none require a gradient")
        if any(isinstance(p, DTensor) for p in self.params.values()):
            raise ConfigError(
                "train.objective keeps a frozen copy of the trained weights, which train.fsdp=true shards across "
                "processes: train without train.fsdp (several processes copy the model whole)"
            )
        self.tensors = {n: p.detach().clone() for n, p in self.params.items()}

    @torch.no_grad()
    def follow(self, decay: float) -> None:
        """Move the copy towards the trained weights: decay 0 makes it equal to them, 1 leaves it as it is."""
        for name, p in self.params.items():
            self.tensors[name].lerp_(p.detach(), 1.0 - float(decay))

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """The model computes with the copy's weights inside this block (use it without a gradient)."""
        self._swap()
        try:
            yield
        finally:
            self._swap()

    def _swap(self) -> None:
        for name, p in self.params.items():
            p.data, self.tensors[name] = self.tensors[name], p.data


__all__ = ["REFERENCE_ADAPTER", "FrozenCopy", "Reference"]
