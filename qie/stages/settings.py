"""What the stages read from their config, as typed settings.

A stage's `run(cfg, run_dir)` is its edge: it turns the config groups into their schemas' dataclasses
(`qie.config.typed`) and, with the functions here, into the settings its parts take (image sizes, where the samples
come from, loss masks, the embedding source's settings, the fused base, sampling options). The rules these settings
must keep that need no model loaded were checked when the config was composed (`qie.checks.validate`, with
`qie.checks.rules`); the code below takes the settings, never a config.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from qie.adapters.fused_base import FusedBase
from qie.cache.keys import FileHasher
from qie.config.cache import CacheConfig
from qie.config.data import DataConfig
from qie.config.model import ModelConfig
from qie.config.predict import PredictConfig
from qie.config.train import TrainConfig
from qie.data.formats import Columns, DataSource
from qie.data.masks import MaskSettings
from qie.embedding.encode import ImageSizes
from qie.embedding.sources import DEFAULT_PRECOMPUTE_COMMAND
from qie.models import ModelSpec
from qie.models.sampling import SamplingOptions
from qie.sampling_fields import SamplingFields


@dataclass(frozen=True)
class LossMasks:
    """`train.mask`: how loss masks are made, and the loss weight outside them."""

    settings: MaskSettings
    outside_weight: float


@dataclass(frozen=True)
class Regularization:
    """`data.regularization`: the second data set, its loss weight and its share of the steps."""

    path: str
    weight: float
    ratio: float


@dataclass(frozen=True, kw_only=True)
class SourceSettings:
    """What an embedding source is built from (`qie.stages.sources.build_source`).

    Args:
        model: the `model` group (its encoders are built from it; its checkpoint is part of the cache keys).
        sizes: the areas images are encoded at.
        mode: `cache.mode`: cached, lazy or live.
        state_dir: the stages' rebuildable state (`CacheConfig.state_folder()`: the image-hash index, the
            remembered sample keys and image sizes), or None.
        devices: where the encoders go: `{"vae": ..., "text_encoder": ...}` (`cache.*_encoder_device`).
        masks: `train.mask`, or None when the run has no loss masks.
        precompute_command: the command a cache miss names.
    """

    model: ModelConfig
    sizes: ImageSizes
    mode: str = "cached"
    state_dir: str | None = None
    devices: Mapping[str, str] = field(default_factory=dict)
    masks: LossMasks | None = None
    precompute_command: str = DEFAULT_PRECOMPUTE_COMMAND

    def with_mode(self, mode: str) -> SourceSettings:
        return replace(self, mode=mode)


def image_sizes(data: DataConfig, spec: ModelSpec) -> ImageSizes:
    """The target area (`data`) and the condition areas (the model's) images are encoded at."""
    return ImageSizes(
        alpha=spec.family.alpha,
        target_pixels=data.target_pixels,
        vae_image_pixels=int(spec.vae_image_pixels),
        vl_image_pixels=int(spec.vl_image_pixels),
        resize_mode=str(data.resize_mode),
        multiple_of=data.multiple_of,
    )


def file_hasher(state_dir: str | None) -> FileHasher:
    """The image-hash index, kept in the state folder when there is one."""
    return FileHasher.in_folder(state_dir)


def data_source(data: DataConfig, state_dir: str | None = None, path: str | None = None) -> DataSource:
    """Where `data` (or `path`, read with the same settings) takes its samples from. Images stored inside a
    Hugging Face data set are written under `state_dir/images` (or `$QIE_HOME/images`), a folder's index under
    `state_dir/manifests`."""
    from qie.config import qie_home

    c = data.columns
    columns = Columns(
        target=c.target,
        controls=tuple(c.controls),
        prompt=c.prompt,
        id=c.id,
        mask=c.mask,
        layers=c.layers,
        rejected=c.rejected,
    )
    folder = Path(state_dir) if state_dir else None
    return DataSource(
        path=str(path or data.path),
        format=str(data.format) if path is None else "auto",
        split=data.split,
        columns=columns,
        images_dir=(folder or qie_home()) / "images",
        allow_outside=data.allow_outside_paths,
        index_dir=folder / "manifests" if folder is not None else None,
    )


def at_path(source: DataSource, path: str) -> DataSource:
    """`source`'s settings for another data set (`path`, its format found from it)."""
    return replace(source, path=str(path), format="auto")


def loss_masks(train: TrainConfig | None, data: DataConfig) -> LossMasks | None:
    """`train.mask`'s settings and outside weight, or None when masks are off (or the stage has no `train`)."""
    mask = train.mask if train is not None else None
    if mask is None or mask.source == "none":
        return None
    settings = MaskSettings(
        str(mask.source),
        float(mask.threshold),
        int(mask.dilation),
        data.target_pixels,
        str(data.resize_mode),
        data.multiple_of,
    )
    return LossMasks(settings, float(mask.outside_weight))


def regularization(data: DataConfig) -> Regularization | None:
    """`data.regularization`, or None when it has no path."""
    reg = data.regularization
    if reg is None or not reg.path:
        return None
    return Regularization(str(reg.path), float(reg.weight), float(reg.ratio))


def encoder_devices(cache: CacheConfig) -> dict[str, str]:
    """Where the encoders go: the VAE on `cache.vae_encoder_device`, the VL model on `cache.text_encoder_device`."""
    return {"vae": cache.vae_encoder_device, "text_encoder": cache.text_encoder_device}


def source_settings(
    model: ModelConfig,
    data: DataConfig,
    cache: CacheConfig,
    spec: ModelSpec,
    masks: LossMasks | None = None,
    command: str | None = None,
) -> SourceSettings:
    """The embedding source's settings of a stage's `model`, `data` and `cache` groups (`masks`: `loss_masks`'s;
    `command`: the precompute command a miss names)."""
    return SourceSettings(
        model=model,
        sizes=image_sizes(data, spec),
        mode=str(cache.mode),
        state_dir=cache.state_folder(),
        devices=encoder_devices(cache),
        masks=masks,
        precompute_command=command or DEFAULT_PRECOMPUTE_COMMAND,
    )


def fused_base(model: ModelConfig, spec: ModelSpec) -> FusedBase:
    """The LoRAs `model.fuse_loras` fuses into the transformer, read and fingerprinted (before anything is built)."""
    files = [str(f) for f in model.fuse_loras or []]
    return FusedBase.of(files, [float(s) for s in model.fuse_lora_scales or []], spec.family.lora_loader_class())


def sampling_options(predict: PredictConfig, **overrides: Any) -> SamplingOptions:
    """SamplingOptions from the `predict` group; `overrides` whose value is None keep predict's value."""
    base = {f.name: getattr(predict, f.name) for f in fields(SamplingFields)}
    for name, kind in (("true_cfg_scale", float), ("num_inference_steps", int), ("layers", int)):
        base[name] = None if base[name] is None else kind(base[name])
    base.update({k: v for k, v in overrides.items() if v is not None})
    return SamplingOptions(**base)
