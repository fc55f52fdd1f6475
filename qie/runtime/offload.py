"""Keeping parts of a training step in CPU memory: transformer blocks (block swap) and saved activations.

Block swap: the frozen weights of the first N transformer blocks live in pinned CPU memory. Each is copied to
the GPU on a side CUDA stream while the block before it runs, and dropped from the GPU after it ran; in the
backward pass, gradient checkpointing recomputes a block from its inputs, so the block is copied in again
just before its gradient is computed (the backward of an identity placed on its outputs), the block after it
is dropped, and the one before it is prefetched. Trainable (LoRA) weights stay on the GPU. At most two
swapped blocks are on the GPU at a time. Weights may be quantized (optimum-quanto's tensors are moved through
their inner tensors, the way diffusers' group offloading moves torchao's).

The weights are switched in place (`param.data`), so the autograd graph sees whichever copy is current. On a
device that is the CPU there is nothing to copy: a dropped block then holds empty tensors, so a step that
used a block the schedule had not brought in fails loudly instead of silently reading stale weights.

Activation offload: the tensors autograd saves for the backward pass, outside the weights, go to (pinned) CPU
memory during the forward pass and come back when the backward pass needs them. With gradient checkpointing
these are the checkpointed blocks' inputs (checkpointing keeps only those); without it, every activation.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten, tree_unflatten

from qie.errors import ConfigError


def in_backward() -> bool:
    """Whether autograd is running a backward pass (e.g. recomputing a checkpointed block) on this thread."""
    return torch._C._current_graph_task_id() != -1


class _OnBackward(torch.autograd.Function):
    """Identity on a block's outputs whose backward runs `hook` before any gradient of the block is computed."""

    @staticmethod
    def forward(ctx, hook: Callable[[], None], *tensors: torch.Tensor):
        ctx.hook = hook
        ctx.set_materialize_grads(False)
        return tensors

    @staticmethod
    def backward(ctx, *grads):
        ctx.hook()
        return (None, *grads)


class _Weight:
    """One frozen tensor of a swapped block: its CPU home and how to point the model at a copy."""

    def __init__(self, owner: torch.Tensor, inner: list[str] | None, home: list[torch.Tensor], empty: bool) -> None:
        self.owner, self.inner, self.home = owner, inner, home
        # What the model holds while the block is away: the CPU copy, or (CPU runs) empty tensors.
        self.parked = [h.new_empty(0) for h in home] if empty else home

    def install(self, tensors: list[torch.Tensor]) -> None:
        if self.inner is None:
            self.owner.data = tensors[0]
        else:  # a tensor subclass (optimum-quanto): its outer tensor stays, its inner tensors move
            for name, t in zip(self.inner, tensors):
                setattr(self.owner, name, t)


class BlockSwapper:
    """Moves `model` to `device` except the frozen weights of the first `count` of `blocks`, and swaps those in
    and out around each block's forward and backward (see the module docstring).

    Args:
        model: the module whose forward runs the blocks (the transformer).
        blocks: its ModuleList of blocks, run in order.
        count: how many blocks to swap, from the first.
        device: the device the blocks run on.

    Attributes:
        loads: how many times a swapped block was brought to the device (for tests and logs).
    """

    def __init__(self, model: torch.nn.Module, blocks: torch.nn.ModuleList, count: int, device: torch.device) -> None:
        if not 0 < count <= len(blocks):
            raise ConfigError(
                f"blocks_to_swap={count}: the transformer has {len(blocks)} blocks; choose 1..{len(blocks)}"
            )
        self.count, self.device = count, torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.loaded: dict[int, torch.cuda.Event | None] = {}  # block -> copy event (None: ready)
        self.loads = 0
        swapped = set()
        for i, block in enumerate(blocks):
            if i >= count:
                continue
            swapped |= {id(m) for m in block.modules()}
        for module in model.modules():  # everything but the swapped blocks' frozen weights goes to the device
            if id(module) in swapped:
                continue
            if next(module.children(), None) is None:
                module.to(self.device)
            else:
                _move_own(module, self.device)
        self.weights = [self._take(block) for block in list(blocks)[:count]]
        self.handles = [model.register_forward_pre_hook(lambda m, a: None if in_backward() else self.prefetch(0))]
        for i, block in enumerate(list(blocks)[: count + 1]):
            if i < count:
                self.handles.append(block.register_forward_pre_hook(functools.partial(self._before, i)))
            self.handles.append(block.register_forward_hook(functools.partial(self._after, i)))

    def _take(self, block: torch.nn.Module) -> list[_Weight]:
        """Trainable tensors of `block` to the device; frozen ones to their CPU home, parked."""
        weights = []
        for module in block.modules():
            for table in (module._parameters, module._buffers):
                for name, t in list(table.items()):
                    if t is None:
                        continue
                    if t.requires_grad:
                        t.data = t.data.to(self.device)
                        continue
                    weights.append(self._home(table, name, t, table is module._parameters))
        for w in weights:
            w.install(w.parked)
        return weights

    def _home(self, table: dict, name: str, t: torch.Tensor, is_param: bool) -> _Weight:
        pin = (lambda x: x.detach().cpu().pin_memory()) if self.cuda else (lambda x: x.detach())
        if not is_traceable_wrapper_subclass(t):
            return _Weight(t, None, [pin(t.data)], empty=not self.cuda)
        inner, spec = t.__tensor_flatten__()
        tensors = [getattr(t, n) for n in inner]
        if any(is_traceable_wrapper_subclass(x) for x in tensors):
            raise ConfigError(f"blocks_to_swap cannot move {type(t).__name__} weights (nested tensor subclasses)")
        if self.cuda:  # the outer tensor says where the weight is: make it the device's, as a moved model's is
            moved = type(t).__tensor_unflatten__(
                {n: x.to(self.device) for n, x in zip(inner, tensors)}, spec, t.size(), t.stride()
            )
            table[name] = torch.nn.Parameter(moved, requires_grad=False) if is_param else moved
            t = table[name]
        return _Weight(t, list(inner), [pin(x) for x in tensors], empty=not self.cuda)

    # -- the schedule -------------------------------------------------------------------------------------

    def prefetch(self, i: int) -> None:
        """Start bringing block `i` to the device (on the side stream on CUDA) unless it is there."""
        if i >= self.count or i in self.loaded:
            return
        self.loads += 1
        if not self.cuda:
            for w in self.weights[i]:
                w.install(w.home)
            self.loaded[i] = None
            return
        with torch.cuda.stream(self.stream):
            copies = [[h.to(self.device, non_blocking=True) for h in w.home] for w in self.weights[i]]
            event = torch.cuda.Event()
            event.record(self.stream)
        for w, tensors in zip(self.weights[i], copies):
            w.install(tensors)
        self.loaded[i] = event

    def ensure(self, i: int) -> None:
        """Make block `i`'s weights usable by the work queued next on the current stream."""
        self.prefetch(i)
        event = self.loaded[i]
        if event is not None:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(event)
            for w in self.weights[i]:  # freed later only once this stream is done with them
                for name_or_none in w.inner or [None]:
                    t = w.owner.data if name_or_none is None else getattr(w.owner, name_or_none)
                    t.record_stream(stream)
            self.loaded[i] = None

    def drop(self, i: int) -> None:
        """Point block `i` back at its CPU home (its device copy is freed when the device is done with it)."""
        if i < self.count and i in self.loaded:
            for w in self.weights[i]:
                w.install(w.parked)
            del self.loaded[i]

    def _before(self, i: int, module: torch.nn.Module, args: tuple) -> None:
        self.ensure(i)
        if not in_backward():
            self.prefetch(i + 1)

    def _after(self, i: int, module: torch.nn.Module, args: tuple, output):
        if in_backward():  # a checkpointed block recomputed: its gradient comes next
            return output
        training = torch.is_grad_enabled()
        # The last swapped block is the first one the backward pass needs: it stays.
        if i < self.count and not (training and i == self.count - 1):
            self.drop(i)
        if not training:
            return output
        leaves, spec = tree_flatten(output)
        where = [k for k, x in enumerate(leaves) if isinstance(x, torch.Tensor) and x.requires_grad]
        if not where:
            return output
        wrapped = _OnBackward.apply(functools.partial(self._backward, i), *(leaves[k] for k in where))
        for k, x in zip(where, wrapped):
            leaves[k] = x
        return tree_unflatten(leaves, spec)

    def _backward(self, i: int) -> None:
        """Block `i`'s gradient is next: bring it in, drop the block after it, prefetch the one before it."""
        if i < self.count:
            self.ensure(i)
        self.drop(i + 1)
        if i > 0:
            self.prefetch(i - 1)

    def remove(self) -> None:
        """Remove the hooks; the swapped blocks' frozen weights stay in (and point at) CPU memory."""
        for handle in self.handles:
            handle.remove()
        for weights in self.weights:
            for w in weights:
                w.install(w.home)
        self.loaded.clear()


def _move_own(module: torch.nn.Module, device: torch.device) -> None:
    """Move the parameters and buffers a module holds itself (not its children's)."""
    for table in (module._parameters, module._buffers):
        for t in table.values():
            if t is not None:
                t.data = t.data.to(device)


def _is_weight(t: torch.Tensor) -> bool:
    """A parameter or a view of one (e.g. the transposed weight a linear layer saves)."""
    while t is not None:
        if isinstance(t, torch.nn.Parameter) or getattr(t, "_is_param", False):
            return True
        t = t._base
    return False


class ActivationOffload(torch.autograd.graph.saved_tensors_hooks):
    """Saved tensors, but weights and tensor subclasses, are copied to (pinned, on CUDA) CPU memory.

    Attributes:
        offloaded_bytes: bytes copied out since the last `reset` (for tests and logs).
    """

    def __init__(self) -> None:
        self.offloaded_bytes = 0
        super().__init__(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor):
        if _is_weight(t) or is_traceable_wrapper_subclass(t) or t.layout != torch.strided:
            return t
        pin = t.device.type == "cuda"
        host = torch.empty(t.size(), dtype=t.dtype, pin_memory=pin).copy_(t, non_blocking=pin)
        self.offloaded_bytes += t.numel() * t.element_size()
        return t.device, host

    @staticmethod
    def _unpack(packed):
        if isinstance(packed, torch.Tensor):
            return packed
        device, host = packed
        return host.to(device, non_blocking=host.is_pinned())


def offload_activations(model: torch.nn.Module) -> ActivationOffload:
    """Offload what autograd saves during `model`'s forward pass (hooks on the module, nothing else changes)."""
    offload = ActivationOffload()
    model.register_forward_pre_hook(lambda m, a: None if in_backward() else offload.__enter__())
    model.register_forward_hook(lambda m, a, o: None if in_backward() else offload.__exit__(), always_call=True)
    return offload
