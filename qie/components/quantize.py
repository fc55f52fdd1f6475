"""Weight quantization of frozen parts (the transformer, the text encoder) with optimum-quanto."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from qie.errors import ConfigError

# What optimum-quanto quantizes in place after loading; nf4 is bitsandbytes', applied while loading.
KINDS = ("fp8", "int8", "int4")


def quantize_weights(
    model: torch.nn.Module, kind: str, exclude: list[str] | None = None, key: str = ""
) -> torch.nn.Module:
    """Quantize the weights of `model`'s linear layers in place ("fp8", "int8" or "int4") and freeze them.

    int4 is optimum-quanto's qint4: groups of 128 weights along a row, each with a scale and a shift.

    Args:
        exclude: module name patterns left in full precision.
        key: the config key that asked for it, for the error message.

    Raises:
        ConfigError: for a kind other than fp8, int8 or int4.
    """
    from optimum.quanto import freeze, qfloat8, qint4, qint8, quantize

    weights = {"fp8": qfloat8, "int8": qint8, "int4": qint4}.get(kind)
    if weights is None:
        raise ConfigError(f"{key or 'quantize'}={kind!r}: choose none, fp8, int8 or int4")
    quantize(model, weights=weights, exclude=exclude)
    freeze(model)
    return _inputs_in_weight_dtype(model)


def _inputs_in_weight_dtype(model: torch.nn.Module) -> torch.nn.Module:
    from optimum.quanto import QModuleMixin

    for module in model.modules():
        if isinstance(module, QModuleMixin):
            module.register_forward_pre_hook(_input_in_weight_dtype)
    return model


def _input_in_weight_dtype(module: torch.nn.Module, args: tuple) -> tuple | None:
    """Hand a quantized layer its input in the dtype its weights compute in: optimum-quanto's CUDA kernels (fp8
    through Marlin) take bf16 or fp16 only, and autocast does not reach them, so a float32 activation (a timestep
    embedding's, say) would stop the step; on the CPU a float32 input against bf16 weights fails as well."""
    x = args[0] if args else None
    dtype = module.weight.dtype
    if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
        return (x.to(dtype), *args[1:])
    return None


def quantize_transformer(
    model: torch.nn.Module,
    kind: str,
    keep: Sequence[str],
    fp8_compute: str = "never",
    device: str | torch.device = "cpu",
    compiled: bool = False,
) -> torch.nn.Module:
    """`model.quantize`: the transformer's linear layers but those `keep` names (the family's
    `keep_full_precision`: its input and output projections).

    fp8 weights also compute in fp8 where `model.fp8_compute` (`fp8_compute`) wants it on `device`, the device
    the model runs on, `compiled` or not (`qie.components.fp8_compute`); else optimum-quanto holds them.
    """
    from qie.components.fp8_compute import float8_compute, fp8_compute_wanted

    if kind == "fp8" and fp8_compute_wanted(fp8_compute, device, compiled):
        return float8_compute(model, keep, device)
    return quantize_weights(model, kind, list(keep), "model.quantize")


def quantize_text_encoder(model: torch.nn.Module, kind: str) -> torch.nn.Module:
    """`model.text_encoder_quantize`: every linear layer of Qwen2.5-VL (language model, vision tower, head).

    The embeddings qie caches are hidden states, so the vocabulary head's output is never used.
    """
    return quantize_weights(model, kind, None, "model.text_encoder_quantize")


def is_quantized(model: torch.nn.Module) -> bool:
    """Whether optimum-quanto, bitsandbytes (diffusers' `is_quantized`) or torchao's float8 layers hold some of
    `model`'s weights."""
    from optimum.quanto import QModuleMixin

    from qie.components.fp8_compute import is_float8_compute

    if getattr(model, "is_quantized", False) is True:
        return True
    return any(isinstance(m, QModuleMixin) or is_float8_compute(m) for m in model.modules())


def nf4_config(dtype: torch.dtype, keep: Sequence[str]) -> object:
    """diffusers' bitsandbytes config for `model.quantize=nf4`: 4-bit NormalFloat weights computed in `dtype`,
    the modules `keep` names (the family's `keep_full_precision`, patterns without their `*`) left alone."""
    from diffusers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_compute_dtype=dtype,
        llm_int8_skip_modules=[k.rstrip("*") for k in keep],
    )


def keep_fp8_weights(model: torch.nn.Module, weights: dict) -> torch.nn.Module:
    """Make the linear layers `weights` names hold those fp8 weights: module name -> (fp8 tensor (rows, cols),
    fp32 scale column (rows, 1)), the weight being fp8 x scale. optimum-quanto's fp8 weights of the same layout
    (per-row scales, `axis=0`) replace the modules' float weights; nothing is rounded again.

    Raises:
        ModelLoadError: a name that is not a linear layer of `model`, or a weight of another shape.
    """
    from optimum.quanto import QLinear, freeze, qfloat8_e4m3fn, qfloat8_e5m2, quantize
    from optimum.quanto.tensor.weights.qbytes import WeightQBytesTensor

    from qie.errors import ModelLoadError

    qtypes = {torch.float8_e4m3fn: qfloat8_e4m3fn, torch.float8_e5m2: qfloat8_e5m2}
    modules = dict(model.named_modules())
    for name, (data, _) in weights.items():
        module = modules.get(name)
        if not isinstance(module, torch.nn.Linear) or module.weight.shape != data.shape:
            raise ModelLoadError(f"the fp8 weight {name}.weight {tuple(data.shape)} is no linear layer's of the model")
    for dtype, qtype in qtypes.items():
        names = [n for n, (data, _) in weights.items() if data.dtype == dtype]
        if names:
            quantize(model, weights=qtype, include=names)
    freeze(model)
    modules = dict(model.named_modules())
    for name, (data, scale) in weights.items():
        module = modules[name]
        assert isinstance(module, QLinear)
        scale = scale.to(device=module.weight.device, dtype=module.weight.dtype)
        data = data.to(module.weight.device).contiguous()
        qweight = WeightQBytesTensor(
            qtypes[data.dtype],
            axis=0,
            size=data.size(),
            stride=data.stride(),
            data=data,
            scale=scale,
            activation_qtype=None,
        )
        module.weight = torch.nn.Parameter(qweight, requires_grad=False)
    return _inputs_in_weight_dtype(model)
