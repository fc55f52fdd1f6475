"""Weight quantization of frozen parts (the transformer, the text encoder) with optimum-quanto."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from qie.errors import ConfigError

KINDS = ("fp8", "int8")


def quantize_weights(
    model: torch.nn.Module, kind: str, exclude: list[str] | None = None, key: str = ""
) -> torch.nn.Module:
    """Quantize the weights of `model`'s linear layers in place ("fp8" or "int8") and freeze them.

    Args:
        exclude: module name patterns left in full precision.
        key: the config key that asked for it, for the error message.

    Raises:
        ConfigError: for a kind other than fp8 or int8.
    """
    from optimum.quanto import freeze, qfloat8, qint8, quantize

    weights = {"fp8": qfloat8, "int8": qint8}.get(kind)
    if weights is None:
        raise ConfigError(f"{key or 'quantize'}={kind!r}: choose none, fp8 or int8")
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
    from optimum.quanto import QModuleMixin

    return any(isinstance(m, QModuleMixin) for m in model.modules())
