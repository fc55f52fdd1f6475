"""Config-to-object glue the stages share: sizes, cache backend, key context, encoder, embedding source."""

from __future__ import annotations

import json
import os
import shlex
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any, Protocol

from omegaconf import DictConfig

from qie.cache.base import CacheBackend
from qie.cache.keys import FileHasher
from qie.components import load_parts, model_source
from qie.config.backend import build_backend
from qie.data.formats import Columns, DataSource, read_dataset
from qie.data.keys import KeyContext
from qie.data.masks import MaskSettings
from qie.data.samples import DataProblem, Dataset, Sample
from qie.embeddings import DEFAULT_PRECOMPUTE_COMMAND, CachedSource, EmbeddingSource, LiveSource, key_context
from qie.encode import Encoder, ImageSizes
from qie.errors import ConfigError, DataError
from qie.masked_source import MaskedSource
from qie.models import ModelSpec, model_spec
from qie.sampling import SamplingOptions
from qie.training.fused_base import FusedBase
from qie.types import value


class CaptionFiller(Protocol):
    """What gives samples without a caption theirs (`qie.stages.auto_caption.AutoCaptions`)."""

    def fill(self, samples: list[Sample]) -> tuple[list[Sample], list[DataProblem]]: ...


def image_sizes(cfg: DictConfig, spec: ModelSpec | None = None) -> ImageSizes:
    return ImageSizes(
        alpha=(spec or model_spec(cfg.model)).alpha,
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


def data_source(cfg: DictConfig, path: str | None = None) -> DataSource:
    """Where `cfg.data` (or `path`, read with the same settings) takes its samples from. Images stored
    inside a Hugging Face data set are written under `cache.dir/images` (or `$QIE_HOME/images`)."""
    from qie.config import qie_home

    d = cfg.data
    c = d.columns
    columns = Columns(c.target, tuple(c.controls), c.prompt, c.id, c.get("mask"), c.get("layers"), c.get("rejected"))
    cache_dir = Path(cfg.cache.dir) if cfg.get("cache") is not None and cfg.cache.get("dir") else None
    return DataSource(str(path or d.path), str(value(d.format)) if path is None else "auto", str(d.split), columns,
                      (cache_dir or qie_home()) / "images", bool(d.get("allow_outside_paths", False)),
                      cache_dir / "manifests" if cache_dir is not None else None)  # fmt: skip


def read_data(
    cfg: DictConfig,
    require_target: bool = True,
    path: str | None = None,
    require_prompt: bool = True,
    captions: CaptionFiller | None = None,
) -> Dataset:
    """The samples of `data.path` (or of `path`): a folder, a manifest or a Hugging Face data set; without
    `require_prompt`, samples without a caption have the prompt "" (the caption stage). With `captions`
    (`data.auto_caption`, see `qie.stages.auto_caption.auto_captions`), samples without a caption get one, and
    those that cannot are problems."""
    fill = require_prompt and captions is not None
    data = read_dataset(data_source(cfg, path), require_target, require_prompt and not fill)
    if fill:
        samples, problems = captions.fill(data.samples)  # type: ignore[union-attr]
        data = Dataset(samples, sorted([*data.problems, *problems], key=lambda p: p.id))
    return data


def sample_range(
    cfg: DictConfig, start: int, end: int | None, raise_errors: bool, on_error_key: str, data: Dataset | None = None
) -> list[Sample | DataProblem]:
    """The samples and scan problems of `start`..`end` of `data` (else of `read_data(cfg)`), in id order
    (broken samples included, so fixing one shifts nothing).

    Raises:
        DataError: the first problem when `raise_errors` (naming `on_error_key`, the setting that goes on).
    """
    data = read_data(cfg) if data is None else data
    items = sorted([*data.samples, *data.problems], key=lambda x: x.id)[start:end]
    problems = [x for x in items if isinstance(x, DataProblem)]
    if raise_errors and problems:
        p = problems[0]
        raise DataError(f"sample {p.id!r}: {p.path}: {p.reason} ({on_error_key}=skip goes on)")
    return items


def write_failures(run_dir: Path, problems: list[DataProblem]) -> Path:
    """Write `failures.jsonl` (one DataProblem a line) in `run_dir`; returns its path."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "failures.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for p in problems:
            f.write(json.dumps(asdict(p)) + "\n")
    return path


def build_encoder(cfg: DictConfig, spec: ModelSpec | None = None) -> Encoder:
    """Encoder with the VAE on cache.vae_encoder_device and the VL model on cache.text_encoder_device; it
    builds the encoder parts of the model's spec (no processor for text-to-image)."""
    devices = {"vae": cfg.cache.vae_encoder_device, "text_encoder": cfg.cache.text_encoder_device}
    spec = spec or model_spec(cfg.model)
    return Encoder(load_parts(cfg.model, spec.encoder_parts, devices, spec), spec)


def model_key_context(cfg: DictConfig, spec: ModelSpec | None = None) -> KeyContext:
    """The cache-key context of `cfg`'s model (fingerprints, template, dtype, quantization) and image sizes.
    Reads the checkpoint's configs and weight headers; builds and writes nothing."""
    m, spec = cfg.model, spec or model_spec(cfg.model)
    quantize = str(value(m.get("text_encoder_quantize", "none")))
    return key_context(model_source(m), m.revision, spec, image_sizes(cfg, spec), str(value(m.dtype)), quantize)


def build_source(
    cfg: DictConfig,
    mode: str | None = None,
    encoder: Encoder | None = None,
    precompute_command: str | None = None,
    spec: ModelSpec | None = None,
    backend: CacheBackend | None = None,
) -> EmbeddingSource:
    """The EmbeddingSource that `cache.mode` (or `mode`) names over `backend` (None: built from `cfg.cache`); a
    backend that stores nothing (`cache=none`) is always live.

    A lazy source builds its encoders on its first miss; a cached one never builds them, but can hand out
    a lazy variant (`with_encoding()`) that does.
    """
    mode = mode or str(value(cfg.cache.mode))
    spec = spec or model_spec(cfg.model)
    sizes = image_sizes(cfg, spec)
    if backend is None and mode != "live":
        backend = build_backend(cfg.cache)
    return with_masks(cfg, *_unmasked_source(cfg, spec, mode, sizes, encoder, precompute_command, backend))


def _unmasked_source(cfg, spec, mode, sizes, encoder, precompute_command, backend) -> tuple[EmbeddingSource, Any]:
    """The source `mode` names, and the backend its masks are stored in (None for a live source)."""
    if mode == "live" or not backend.stores:
        return LiveSource(encoder or build_encoder(cfg, spec), sizes), None
    factory = (lambda: encoder) if encoder is not None else (lambda: build_encoder(cfg, spec))
    cached = CachedSource(
        backend,
        model_key_context(cfg, spec),
        file_hasher(cfg),
        factory,
        sizes,
        precompute_command or DEFAULT_PRECOMPUTE_COMMAND,
        str(Path(cfg.cache.dir) / "sample_keys") if cfg.cache.get("dir") else None,
    )
    return (cached if mode == "cached" else cached.with_encoding()), backend


def fused_base(model: DictConfig, spec: ModelSpec) -> FusedBase:
    """The LoRAs `model.fuse_loras` fuses into the transformer, read and fingerprinted (before anything is built)."""
    files = [str(f) for f in model.get("fuse_loras") or []]
    return FusedBase.of(files, [float(s) for s in model.get("fuse_lora_scales") or []], spec.family.lora_loader_class())


def sampling_options(predict: DictConfig, **overrides: Any) -> SamplingOptions:
    """SamplingOptions from the `predict` group; `overrides` whose value is None keep predict's value."""
    base = {
        "negative_prompt": predict.negative_prompt,
        "true_cfg_scale": None if predict.true_cfg_scale is None else float(predict.true_cfg_scale),
        "num_inference_steps": None if predict.num_inference_steps is None else int(predict.num_inference_steps),
        "seed": int(predict.seed),
        "height": predict.height,
        "width": predict.width,
        "num_images": int(predict.num_images),
        "layers": None if predict.get("layers") is None else int(predict.layers),
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


def launch_problem(num_processes: int, env: Mapping[str, str] | None = None) -> str | None:
    """Why this run has fewer processes than its launcher was asked for, or None.

    `accelerate launch --num_processes N` on a machine without GPUs runs the script once, as one process
    (its simple launcher sets MASTER_ADDR for N > 1, but starts no others and sets no WORLD_SIZE).
    """
    env = os.environ if env is None else env
    world = int(env.get("WORLD_SIZE") or 0)
    if world > num_processes:
        return f"the launcher started {world} processes, but this run joined {num_processes}"
    if num_processes == 1 and "MASTER_ADDR" in env and "ACCELERATE_MIXED_PRECISION" in env and not world:
        return "accelerate launch was asked for several processes but started one (it does so without GPUs)"
    return None


def leave_process_group(state: Any) -> None:
    """Leave the process group of a several-process run (torchrun) once every process is done: gloo's threads
    torn down during interpreter exit can abort a process ("terminate called without an active exception")
    after its work is complete, and the launcher then reports the run as failed."""
    import torch.distributed as dist

    if state.num_processes > 1 and dist.is_available() and dist.is_initialized():
        state.wait_for_everyone()
        dist.destroy_process_group()


def warn_single_process(num_processes: int, module: str) -> None:
    """Print how to run several CPU processes when the launcher silently started fewer (see `launch_problem`)."""
    problem = launch_problem(num_processes)
    if problem:
        print(
            f"qie: warning: {problem}. For N processes on CPUs use\n"
            f"  torchrun --standalone --nproc_per_node N -m {module} ...\n"
            "or  accelerate launch --multi_gpu --num_processes N --num_machines 1 --mixed_precision no "
            f"--dynamo_backend no -m {module} ...",
            file=sys.stderr,
            flush=True,
        )


def mask_settings(cfg: DictConfig) -> tuple[MaskSettings, float] | None:
    """`train.mask`'s settings and outside weight, or None when masks are off (or the config has no `train`).

    Raises:
        ConfigError: a value out of range, or `source=edit` for a model without control images.
    """
    mask = cfg.get("train", {}).get("mask") if cfg.get("train") is not None else None
    if mask is None or str(value(mask.source)) == "none":
        return None
    source, outside = str(value(mask.source)), float(mask.outside_weight)
    for name, v, low, high in (("outside_weight", outside, 0, 1), ("threshold", float(mask.threshold), 0, 1),
                               ("dilation", int(mask.dilation), 0, 10**6)):  # fmt: skip
        if not low <= v <= high:
            raise ConfigError(f"train.mask.{name}={v} is out of range: give a value from {low} to {high}")
    if source == "edit" and model_spec(cfg.model).max_control_images == 0:
        raise ConfigError(f"train.mask.source=edit compares each target with its control image, and "
                          f"model={cfg.model.name} takes none: use train.mask.source=file")  # fmt: skip
    d = cfg.data
    settings = MaskSettings(source, float(mask.threshold), int(mask.dilation), int(d.target_pixels),
                            str(value(d.resize_mode)), int(d.multiple_of))  # fmt: skip
    return settings, outside


def with_masks(cfg: DictConfig, source: EmbeddingSource, backend: Any = None) -> EmbeddingSource:
    """`source`, adding loss masks to its samples when `train.mask.source` is set (stored in `backend`)."""
    found = mask_settings(cfg)
    if found is None:
        return source
    return MaskedSource(source, found[0], file_hasher(cfg), backend, found[1])


def check_masks(source: EmbeddingSource, samples: list[Sample], report: bool) -> list[Sample]:
    """The samples whose loss masks (`train.mask`) can train, each mask read at start; the others are skipped
    with a warning, as unreadable images are.

    Raises:
        DataError: no sample left.
    """
    if not isinstance(source, MaskedSource):
        return samples
    kept, problems = source.check_masks(samples)
    for p in problems[:5] if report else []:
        print(f"qie: skipping sample {p.id!r}: {p.path}: {p.reason}")
    if len(problems) > 5 and report:
        print(f"qie: ... and {len(problems) - 5} more samples whose masks cannot train")
    if not kept:
        first = problems[0]
        raise DataError(f"no sample has a loss mask that can train; the first, {first.id!r}: {first.reason}")
    return kept


def control_dropout(cfg: DictConfig) -> float:
    """`data.control_dropout_rate`, checked against the model.

    Raises:
        ConfigError: out of 0..1, or a model that cannot train without control images.
    """
    rate = float(cfg.data.get("control_dropout_rate", 0.0))
    if not 0.0 <= rate <= 1.0:
        raise ConfigError(f"data.control_dropout_rate={rate} is out of range: give a value from 0 to 1")
    spec = model_spec(cfg.model)
    if rate and (spec.max_control_images == 0 or spec.min_control_images > 0):
        why = "takes no control images" if spec.max_control_images == 0 else "needs a control image in every sample"
        raise ConfigError(f"data.control_dropout_rate: model={cfg.model.name} {why}; reference dropout is for the "
                          "models that also edit from text alone (Edit-Plus, 2511, Qwen-Image-2.1)")  # fmt: skip
    return rate


class Background:
    """A call running in a thread; `result()` waits for it and returns its value or raises its error."""

    def __init__(self, fn: Callable[..., Any], *args: Any) -> None:
        self._value: Any = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn, args), name="qie-background", daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[..., Any], args: tuple) -> None:
        try:
            self._value = fn(*args)
        except BaseException as e:  # raised again in the caller's thread
            self._error = e

    def wait(self) -> None:
        """Wait for the call to end, whatever its outcome."""
        self._thread.join()

    def result(self) -> Any:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value


def in_background(fn: Callable[..., Any], *args: Any) -> Background:
    """Start `fn(*args)` in a thread (see `Background`)."""
    return Background(fn, *args)
