"""What a stage's edge does with a composed config, for tests that build one part of a stage from `compose(...)`:
the config groups turned into typed settings (`qie.config.typed`, `qie.stages.settings`), then the part built from
those, as the stages build it. Each takes the config once, as a stage's `run` does; the library below never does."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from omegaconf import DictConfig

from qie.cache.keys import FileHasher
from qie.checks import read_groups
from qie.config import typed
from qie.data.keys import KeyContext
from qie.data.samples import Dataset
from qie.embedding.encode import Encoder, ImageSizes
from qie.embedding.sources import EmbeddingSource
from qie.models import ModelSpec, model_spec
from qie.stages.datasets import read_data
from qie.stages.edge import Edge
from qie.stages.infer import Predictor, build_predictor
from qie.stages.settings import (
    SourceSettings,
    data_source,
    encoder_devices,
    file_hasher,
    image_sizes,
)
from qie.stages.sources import build_encoder, model_key_context


def spec_of(cfg: DictConfig) -> ModelSpec:
    return model_spec(typed(cfg.model))


def state_dir_of(cfg: DictConfig) -> str | None:
    return typed(cfg.cache).state_folder() if "cache" in cfg else None


def sizes_for(cfg: DictConfig, spec: ModelSpec | None = None) -> ImageSizes:
    return image_sizes(typed(cfg.data), spec or spec_of(cfg))


def hasher_for(cfg: DictConfig) -> FileHasher:
    return file_hasher(state_dir_of(cfg))


def key_context_for(cfg: DictConfig, spec: ModelSpec | None = None) -> KeyContext:
    spec = spec or spec_of(cfg)
    return model_key_context(typed(cfg.model), spec, sizes_for(cfg, spec))


def encoder_for(cfg: DictConfig, spec: ModelSpec | None = None) -> Encoder:
    return build_encoder(typed(cfg.model), spec or spec_of(cfg), encoder_devices(typed(cfg.cache)))


def source_settings_for(cfg: DictConfig, spec: ModelSpec | None = None, mode: str | None = None) -> SourceSettings:
    """The embedding source's settings a stage makes of `cfg` (loss masks from `train.mask` where it has one)."""
    return Edge.of(read_groups(cfg), spec or spec_of(cfg)).source_settings(mode)


def source_for(
    cfg: DictConfig,
    mode: str | None = None,
    encoder: Encoder | None = None,
    spec: ModelSpec | None = None,
    backend: Any = None,
) -> EmbeddingSource:
    """The EmbeddingSource `cache.mode` (or `mode`) names for `cfg`, over `backend` (built from `cfg.cache` when None
    and the source reads a cache)."""
    edge = Edge.of(read_groups(cfg), spec or spec_of(cfg))
    return edge.source(edge.source_settings(mode), backend, encoder)


def data_for(cfg: DictConfig, require_target: bool = True, path: str | None = None, require_prompt: bool = True,
             captions: Any = None) -> Dataset:  # fmt: skip
    """The samples of `cfg`'s `data.path` (or of `path`, read with the same settings)."""
    source = data_source(typed(cfg.data), state_dir_of(cfg), path)
    return read_data(source, require_target, require_prompt, captions)


def predictor_for(cfg: DictConfig, spec: ModelSpec | None = None, **predict: Any) -> Predictor:
    """The Predictor `cfg`'s `model` and `predict` groups build (`predict`: fields replaced); the model is prepared
    (`prepare_model`: its checkpoint built or checked) when `spec` is not given, as the infer stage prepares it."""
    from qie.components import prepare_model

    model = typed(cfg.model)
    settings = replace(typed(cfg.predict), **predict) if predict else typed(cfg.predict)
    return build_predictor(model, settings, spec or prepare_model(model))


def parts_of(
    model: Any,
    names: list[str],
    devices: dict[str, str] | None = None,
    spec: ModelSpec | None = None,
    fuse: Any = None,
) -> Any:
    """The named parts of a `model` group, built as a stage builds them (its spec and load settings read first)."""
    from qie.components import LoadSettings, load_parts

    model = typed(model) if isinstance(model, DictConfig) else model
    return load_parts(LoadSettings.of(model), spec or model_spec(model), names, devices, fuse=fuse)
