"""Weight quantization of the frozen transformer with optimum-quanto."""

from __future__ import annotations

import torch

from qie.errors import ConfigError

# Input and output projections stay in full precision: they are small and quantizing them costs quality.
KEEP_FULL_PRECISION = ["img_in", "txt_in*", "proj_out", "norm_out*", "time_text_embed*"]


def quantize_transformer(model: torch.nn.Module, kind: str) -> torch.nn.Module:
    """Quantize the weights of `model`'s linear layers in place ("fp8" or "int8") and freeze them.

    Raises:
        ConfigError: for a kind other than fp8 or int8.
    """
    from optimum.quanto import freeze, qfloat8, qint8, quantize

    weights = {"fp8": qfloat8, "int8": qint8}.get(kind)
    if weights is None:
        raise ConfigError(f"model.quantize={kind!r}: choose none, fp8 or int8")
    quantize(model, weights=weights, exclude=KEEP_FULL_PRECISION)
    freeze(model)
    return model


def is_quantized(model: torch.nn.Module) -> bool:
    from optimum.quanto import QModuleMixin

    return any(isinstance(m, QModuleMixin) for m in model.modules())
