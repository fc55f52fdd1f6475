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
    return model


def quantize_transformer(model: torch.nn.Module, kind: str, keep: Sequence[str]) -> torch.nn.Module:
    """`model.quantize`: the transformer's linear layers but those `keep` names (the family's
    `keep_full_precision`: its input and output projections)."""
    return quantize_weights(model, kind, list(keep), "model.quantize")


def quantize_text_encoder(model: torch.nn.Module, kind: str) -> torch.nn.Module:
    """`model.text_encoder_quantize`: every linear layer of Qwen2.5-VL (language model, vision tower, head).

    The embeddings qie caches are hidden states, so the vocabulary head's output is never used.
    """
    return quantize_weights(model, kind, None, "model.text_encoder_quantize")


def is_quantized(model: torch.nn.Module) -> bool:
    """Whether optimum-quanto or bitsandbytes (diffusers' `is_quantized`) holds some of `model`'s weights."""
    from optimum.quanto import QModuleMixin

    if getattr(model, "is_quantized", False) is True:
        return True
    return any(isinstance(m, QModuleMixin) for m in model.modules())


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
        qweight = WeightQBytesTensor(qtypes[data.dtype], 0, data.size(), data.stride(), data, scale, None)
        module.weight = torch.nn.Parameter(qweight, requires_grad=False)
    return model
