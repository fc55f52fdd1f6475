"""Sizes as data: a family's flavours (`ModelFamily.flavours`), its published size and its tiny presets side by side.

A `Flavour` is the configs of one size of the family's transformer, VAE and text encoder. The published one (no
`tiny`) is what the memory planner and the benchmarks build with random weights; a tiny one carries `Tiny`, what
the one generic builder (`qie.components.tiny.build_tiny`) needs besides the sizes to write it as a diffusers folder
(its name is the preset: a model yaml's `tiny`, `python -m qie.tiny PRESET`). A tiny flavour of another size is
`Flavour.but(...)` of the family's first tiny one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any


@dataclass(frozen=True)
class Tiny:
    """How the generic tiny builder writes a tiny flavour (the parts' classes are the family's `part_classes`).

    Args:
        pipeline: the pipeline class (model_index.json's `_class_name`); its parts are what is written.
        tokenizer: "module:function" that trains the tokenizer, called with the classes `tokenizer_pipelines`
            names (diffusers pipeline class names), whose templates it learns.
        tokenizer_pipelines: see `tokenizer`.
        text_tokens: text-config entry -> the tokenizer attribute that gives it (the vocabulary size and the
            vision token ids are always filled in).
        scheduler: the scheduler's config.
        model_index: part -> (library, class) as model_index.json names it.
        processor: processor/preprocessor_config.json.
        video_processor: also write a video_preprocessor_config.json beside it, as the real repositories do
            (`load_processor` must ignore it).
        index_extra: further model_index.json entries (2.1's `sample_sigmas`).
        vae_weights: a VAE's weights shipped in `qie.components` (`load_shipped_vae`), trained for the flavour's
            VAE config; None: a random VAE.
    """

    pipeline: str
    tokenizer: str
    tokenizer_pipelines: tuple[str, ...]
    text_tokens: Mapping[str, str]
    scheduler: Mapping[str, Any]
    model_index: Mapping[str, tuple[str, str]]
    processor: Mapping[str, Any]
    video_processor: bool = False
    index_extra: Mapping[str, Any] = field(default_factory=dict)
    vae_weights: str | None = None


@dataclass(frozen=True)
class Flavour:
    """One size of a family's model.

    Args:
        transformer: kwargs of the transformer class.
        vae: kwargs of the VAE class (a shipped VAE's: without its latent statistics, which its file carries).
        text_encoder: kwargs of the text encoder's config class (a tiny one's without the vocabulary size and
            token ids, which its tokenizer gives).
        tiny: how a tiny preset is written; None for the published size.
    """

    transformer: Mapping[str, Any]
    vae: Mapping[str, Any]
    text_encoder: Mapping[str, Any]
    tiny: Tiny | None = None

    def but(
        self, *, transformer: Mapping[str, Any] | None = None, vae: Mapping[str, Any] | None = None, **tiny: Any
    ) -> Flavour:
        """This tiny flavour with transformer config entries changed, another VAE config, and `Tiny` fields."""
        assert self.tiny is not None, "only a tiny flavour is varied"
        return replace(
            self,
            transformer={**self.transformer, **(transformer or {})},
            vae=dict(self.vae) if vae is None else vae,
            tiny=replace(self.tiny, **tiny),
        )


__all__ = ["Flavour", "Tiny"]
