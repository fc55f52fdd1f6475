"""fp8 *compute* for the frozen transformer (`model.quantize=fp8` on a GPU with fp8 tensor cores): torchao's
float8 linear layers, each holding its weight once as float8 e4m3 with one scale per tensor, so the forward
and the input-gradient matrix products run on the fp8 tensor cores and the weights take half of bf16's memory.

optimum-quanto's fp8 weights (the other `model.quantize=fp8`) save the same memory but are widened to bf16
before every product, so they compute at bf16 speed or slower. The LoRA layers around these stay in their own
dtype; only the frozen base products are fp8.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Sequence
from fnmatch import fnmatch

import torch

from qie.errors import ConfigError

log = logging.getLogger(__name__)

SETTINGS = ("auto", "always", "never")
# fp8 tensor cores: Ada (8.9) and Hopper (9.0) onwards.
MIN_CAPABILITY = (8, 9)


def fp8_compute_wanted(setting: str, device: torch.device | str, compiled: bool = False) -> bool:
    """Whether `model.fp8_compute=setting` runs the fp8 weights through float8 products on `device`.

    auto: where they pay, on a CUDA device with fp8 tensor cores, torchao installed and the blocks compiled
    (`compiled`; eager, the separate cast kernels made the step slower than bf16: docs/benchmarks.md §7);
    always: everywhere (emulated on the CPU, for tests; slow); never: optimum-quanto's fp8 weights.

    Raises:
        ConfigError: `always` where it cannot run: no torchao, or a GPU without fp8 tensor cores.
    """
    if setting not in SETTINGS:
        raise ConfigError(f"model.fp8_compute={setting!r}: choose auto, always or never")
    if setting == "never":
        return False
    device = torch.device(device)
    installed = importlib.util.find_spec("torchao") is not None
    capable = device.type == "cpu" or (
        device.type == "cuda" and torch.cuda.get_device_capability(device) >= MIN_CAPABILITY
    )
    if setting == "auto":
        return installed and device.type == "cuda" and capable and compiled
    if not installed:
        raise ConfigError(
            'model.fp8_compute=always needs torchao: pip install "qie[fp8]", or set model.fp8_compute=auto'
        )
    if not capable:
        raise ConfigError(
            f"model.fp8_compute=always needs fp8 tensor cores (compute capability 8.9 or newer); {device} has "
            f"{'.'.join(map(str, torch.cuda.get_device_capability(device)))}: set model.fp8_compute=auto"
        )
    return True


def float8_compute(model: torch.nn.Module, keep: Sequence[str], device: torch.device | str) -> torch.nn.Module:
    """Replace `model`'s linear layers (but those matching a `keep` pattern, and layers whose sizes the fp8
    products cannot take) by torchao float8 linear layers on `device`, each weight cast once to e4m3 with a
    per-tensor scale there and its bf16 original dropped; freeze them. Layer by layer, so the device never holds
    more than one full-precision weight beyond the model it already has. On the CPU the products are emulated.

    Returns:
        `model`, changed in place.
    """
    from torchao.float8 import Float8LinearConfig
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import GemmInputRole

    device = torch.device(device)
    # Padded inner sizes: token counts (a prompt's, say) need not divide by 16, as the fp8 products require.
    config = Float8LinearConfig(emulate=device.type != "cuda", pad_inner_dim=True)
    targets = [
        (name, module)
        for name, module in model.named_modules()
        if type(module) is torch.nn.Linear and not any(fnmatch(name, k) for k in keep) and _fits(module)
    ]
    for name, module in targets:
        new = Float8Linear.from_float(module, config)
        weight = module.weight.detach().to(device)
        fp8 = hp_tensor_to_float8_dynamic(
            weight, torch.float8_e4m3fn, new.linear_mm_config, gemm_input_role=GemmInputRole.WEIGHT
        )
        new.weight = torch.nn.Parameter(fp8, requires_grad=False)
        if module.bias is not None:
            new.bias = torch.nn.Parameter(module.bias.detach().to(device), requires_grad=False)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, new)
    log.info("fp8 compute: %d linear layers run float8 products (torchao) on %s", len(targets), device)
    return model


def _fits(module: torch.nn.Linear) -> bool:
    # torch._scaled_mm needs both matrix sizes divisible by 16.
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


def is_float8_compute(module: torch.nn.Module) -> bool:
    """Whether `module` is one of torchao's float8 linear layers (without importing torchao when it is not)."""
    return type(module).__name__ == "Float8Linear" and type(module).__module__.startswith("torchao.")
