"""Config-to-object glue the stages share: sizes, cache backend, key context, encoder, embedding source."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from qie.cache import build_backend
from qie.cache.keys import FileHasher
from qie.components import load_parts, model_source
from qie.data.keys import KeyContext
from qie.embeddings import DEFAULT_PRECOMPUTE_COMMAND, CachedSource, EmbeddingSource, LiveSource, key_context
from qie.encode import Encoder, ImageSizes
from qie.models import model_spec
from qie.sampling import SamplingOptions


def value(x: Any) -> Any:
    """The plain value of a config enum."""
    return getattr(x, "value", x)


def image_sizes(cfg: DictConfig) -> ImageSizes:
    return ImageSizes(
        target_pixels=int(cfg.data.target_pixels),
        vae_image_pixels=int(cfg.model.vae_image_pixels),
        vl_image_pixels=int(cfg.model.vl_image_pixels),
        resize_mode=str(value(cfg.data.resize_mode)),
        multiple_of=int(cfg.data.multiple_of),
    )


def file_hasher(cfg: DictConfig) -> FileHasher:
    """The image-hash index, kept in the cache folder when there is one."""
    index = Path(cfg.cache.dir) / "file_hashes.json" if cfg.cache.get("dir") else None
    return FileHasher(index)


def build_encoder(cfg: DictConfig) -> Encoder:
    """Encoder with the VAE on cache.vae_encoder_device and Qwen2.5-VL on cache.text_encoder_device; it
    builds the encoder parts of the model's spec (no processor for text-to-image)."""
    devices = {"vae": cfg.cache.vae_encoder_device, "text_encoder": cfg.cache.text_encoder_device}
    spec = model_spec(cfg.model)
    return Encoder(load_parts(cfg.model, spec.encoder_parts, devices), spec)


def model_key_context(cfg: DictConfig) -> KeyContext:
    """The cache-key context of `cfg`'s model (fingerprints, template, dtype) and image sizes."""
    m = cfg.model
    return key_context(model_source(m), m.revision, model_spec(m), image_sizes(cfg), str(value(m.dtype)))


def build_source(
    cfg: DictConfig, mode: str | None = None, encoder: Encoder | None = None, precompute_command: str | None = None
) -> EmbeddingSource:
    """The EmbeddingSource that `cache.mode` (or `mode`) names; `cache=none` is always live.

    A lazy source builds its encoders on its first miss; a cached one never builds them, but can hand out
    a lazy variant (`with_encoding()`) that does.
    """
    mode = mode or str(value(cfg.cache.mode))
    sizes = image_sizes(cfg)
    if mode == "live" or cfg.cache.name == "none":
        return LiveSource(encoder or build_encoder(cfg), sizes)
    backend = build_backend(cfg.cache._target_, cfg.cache.get("dir"))
    factory = (lambda: encoder) if encoder is not None else (lambda: build_encoder(cfg))
    cached = CachedSource(
        backend,
        model_key_context(cfg),
        file_hasher(cfg),
        factory,
        sizes,
        precompute_command or DEFAULT_PRECOMPUTE_COMMAND,
    )
    return cached if mode == "cached" else cached.with_encoding()


def sampling_options(predict: DictConfig, **overrides: Any) -> SamplingOptions:
    """SamplingOptions from the `predict` group; `overrides` whose value is None keep predict's value."""
    base = {
        "negative_prompt": predict.negative_prompt,
        "true_cfg_scale": float(predict.true_cfg_scale),
        "num_inference_steps": int(predict.num_inference_steps),
        "seed": int(predict.seed),
        "height": predict.height,
        "width": predict.width,
        "num_images": int(predict.num_images),
    }
    base.update({k: v for k, v in overrides.items() if v is not None})
    return SamplingOptions(**base)


def precompute_command(cfg: DictConfig) -> str:
    """The precompute command that fills the cache this run reads: the CLI's model/data/cache overrides."""
    try:
        from hydra.core.hydra_config import HydraConfig

        given = list(HydraConfig.get().overrides.task)
    except ValueError:  # not under the Hydra CLI: rebuild the essentials from the config
        given = [f"model={cfg.model.name}", f"data.path={cfg.data.path}", f"cache={cfg.cache.name}"]
        given.append(f"cache.dir={cfg.cache.dir}")
    groups = ("model", "data", "cache", "experiment")
    keep = [o for o in given if o.lstrip("+~").split("=")[0].split(".")[0] in groups and "cache.mode" not in o]
    return " ".join(["python -m qie.precompute", *(shlex.quote(o) for o in keep)])
