"""`data.auto_caption`: a caption for each sample that has none, from the model's own VL text encoder, cached.

A training sample without a caption (no `<stem>.txt`, an empty one, a manifest or Hugging Face row without
text) is refused by the data scan unless `data.auto_caption=true`. Then its caption is what the model's own text
encoder answers to the caption prompt that fits its pipeline (`Variant.caption`: a preset of `conf/caption/`,
or `data.auto_caption_prompt`), written by the `Captioner` that `python -m qie.caption` uses, with the preset's
generation settings (greedy: deterministic).

The caption is an entry of the cache (type `caption`: its UTF-8 bytes as a uint8 tensor) keyed by the bytes of
the images shown (in order), the caption prompt, the generation settings, the image area the VL model sees and
the text encoder (fingerprint, processor, dtype, quantization): it is generated once, later runs read it, and a
changed image or prompt captions again. The sample then carries the caption as its prompt, so its prompt
embedding is keyed by that text as any prompt is. A source that only reads the cache (`cache.mode=cached`)
never builds the text encoder: a caption it lacks is a cache miss.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from qie.cache.base import CacheStore
from qie.cache.keys import FileHasher, entry_key
from qie.config.caption import CaptionConfig
from qie.config.model import ModelConfig
from qie.config.tree import conf_dir
from qie.data.keys import KeyContext
from qie.data.samples import DataProblem, Sample
from qie.errors import ConfigError, DataError
from qie.models import ModelSpec
from qie.models.captioning import Captioner, CaptionPrompt, GenerationSettings
from qie.stages import caption as caption_stage
from qie.stages.caption import prompt_settings, shown_images
from qie.stages.settings import SourceSettings, file_hasher
from qie.stages.sources import model_key_context

CAPTION_TYPE = "caption"


@dataclass(frozen=True)
class CaptionSettings:
    """What the VL model is asked for a missing caption and how it generates (a caption preset's)."""

    prompt: CaptionPrompt
    generation: GenerationSettings
    batch_size: int


def presets() -> list[str]:
    """The caption presets: the files of `conf/caption/`."""
    return sorted(p.stem for p in preset_folder().glob("*.yaml"))


def preset_folder() -> Path:
    return conf_dir() / "caption"


def caption_settings(prompt: str | None, spec: ModelSpec) -> CaptionSettings:
    """The preset `prompt` (`data.auto_caption_prompt`) names (or the yaml file it names, with the fields of the
    `caption` group), else the model's own (`Variant.caption`).

    Raises:
        ConfigError: a name that is no preset, a file that is missing or has fields the group does not.
    """
    name = str(prompt or spec.pipe.caption)
    is_file = name.endswith((".yaml", ".yml"))
    path = Path(name).expanduser() if is_file else preset_folder() / f"{name}.yaml"
    if not path.is_file():
        what = "is not a file" if is_file else f"is no caption preset: choose one of {', '.join(presets())}"
        raise ConfigError(f"data.auto_caption_prompt={name!r} {what} (or give a .yaml file of caption fields)")
    try:
        node = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(CaptionConfig), OmegaConf.load(path)))
    except Exception as e:  # OmegaConf's errors for an unknown field or a wrong type
        raise ConfigError(f"data.auto_caption_prompt={name!r}: {' '.join(str(e).split())}") from None
    prompt, generation = prompt_settings(node)
    return CaptionSettings(prompt, generation, int(node.batch_size))


def caption_key(sample: Sample, settings: CaptionSettings, ctx: KeyContext, hasher: FileHasher) -> str:
    """The key of `sample`'s caption: the bytes of the images shown (in order), the caption prompt, the
    generation settings, the VL image area and the text encoder.

    Raises:
        DataError: a sample without a target (captions describe the target). OSError: an unreadable image.
    """
    if sample.target is None:
        raise DataError(f"sample {sample.id!r} has no target image: captions describe the target")
    fields = {
        "images": [hasher.hash(p) for p in settings.prompt.shown(sample.controls, sample.target)],
        "prompt": settings.prompt.identity(len(sample.controls)),
        "generation": settings.generation.to_dict(),
        "area": ctx.vl_image_pixels,
        "text_encoder": ctx.text_encoder_fingerprint,
        "processor": ctx.processor_fingerprint,
        "dtype": ctx.dtype,
        "text_encoder_quantize": ctx.text_encoder_quantize,
    }
    return entry_key(CAPTION_TYPE, fields)


def caption_tensor(text: str) -> torch.Tensor:
    """A caption as its stored tensor: the UTF-8 bytes, uint8."""
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.uint8)


def caption_text(tensor: torch.Tensor) -> str:
    return bytes(tensor.tolist()).decode("utf-8")


@dataclass
class CaptionCounts:
    """What `AutoCaptions.fill` did: captions generated (and bytes written), read from the cache, failed."""

    new: int = 0
    cached: int = 0
    failed: int = 0
    bytes_written: int = 0
    keys: set[str] = field(default_factory=set)  # every caption key a filled sample uses


class AutoCaptions:
    """Fills in the captions of samples that have none.

    Args:
        settings: the caption prompt and generation settings.
        context: the model's cache-key context (text encoder fingerprint, processor, dtype, VL area).
        hasher: the image-hash index.
        backend: where captions are cached; None: generated on every run (`cache=none`).
        make_captioner: builds the captioner on the first caption to generate; None: read the cache only (a
            caption it lacks is a miss, named with `miss_hint`).
        spec: the model (which control counts it takes).
    """

    def __init__(
        self,
        settings: CaptionSettings,
        context: KeyContext,
        hasher: FileHasher,
        backend: CacheStore | None,
        make_captioner: Callable[[CaptionSettings], Captioner] | None,
        spec: ModelSpec,
        miss_hint: str = "run python -m qie.precompute with data.auto_caption=true",
    ) -> None:
        self.settings, self.context, self.hasher, self.backend = settings, context, hasher, backend
        self.make_captioner, self.spec, self.miss_hint = make_captioner, spec, miss_hint
        self.counts = CaptionCounts()
        self.misses: list[DataProblem] = []  # samples whose caption a cache-only run did not find

    @property
    def generates(self) -> bool:
        return self.make_captioner is not None

    def fill(self, samples: Sequence[Sample]) -> tuple[list[Sample], list[DataProblem]]:
        """`samples`, each without a prompt given its caption (read, else generated and stored), and the
        samples that could not be captioned (an unreadable image, an empty answer, a caption not cached)."""
        out: list[Sample | None] = list(samples)
        problems: list[DataProblem] = []
        todo: list[tuple[int, str]] = []
        for i, sample in enumerate(samples):
            if sample.prompt:
                continue
            out[i] = None
            try:
                key = caption_key(sample, self.settings, self.context, self.hasher)
            except (DataError, OSError) as e:
                problems.append(
                    self._problem(
                        sample, str(e) if isinstance(e, DataError) else f"cannot read {e.filename!r} ({e.strerror})"
                    )
                )
                continue
            self.counts.keys.add(key)
            text = self._read(key)
            if text is not None:
                self.counts.cached += 1
                out[i] = replace(sample, prompt=text)
            elif not self.generates:
                if unreadable := _unreadable(sample):  # no caption can be made of it: a broken sample, skipped
                    problems.append(unreadable)
                    continue
                self.misses.append(
                    self._problem(
                        sample, f"sample {sample.id!r} has no cached caption (data.auto_caption): {self.miss_hint}"
                    )
                )
                problems.append(self.misses[-1])
            else:
                todo.append((i, key))
        if todo:
            self._generate(samples, todo, out, problems)
        self.counts.failed += len(problems)
        return [s for s in out if s is not None], problems

    def _read(self, key: str) -> str | None:
        entry = self.backend.get(CAPTION_TYPE, key) if self.backend is not None else None
        return caption_text(entry["text"]) if entry is not None and "text" in entry else None

    def _generate(self, samples: Sequence[Sample], todo: list[tuple[int, str]], out: list, problems: list) -> None:
        captioner = self.make_captioner(self.settings)  # type: ignore[misc]
        vl_pixels = self.context.vl_image_pixels
        size = 1 if self.settings.generation.do_sample else self.settings.batch_size
        for start in range(0, len(todo), size):
            batch, images = [], []
            for i, key in todo[start : start + size]:
                try:
                    images.append(shown_images(samples[i], captioner, self.spec, vl_pixels))
                    batch.append((i, key))
                except DataError as e:
                    problems.append(self._problem(samples[i], str(e)))
            for (i, key), text in zip(batch, captioner.caption(images) if batch else []):
                if not text:
                    problems.append(
                        self._problem(
                            samples[i], f"sample {samples[i].id!r}: the model wrote an empty caption: write one"
                        )
                    )
                    continue
                if self.backend is not None:
                    meta = {"prompt_name": self.settings.prompt.name}
                    self.counts.bytes_written += self.backend.put(
                        CAPTION_TYPE, key, {"text": caption_tensor(text)}, meta
                    )
                self.counts.new += 1
                out[i] = replace(samples[i], prompt=text)

    @staticmethod
    def _problem(sample: Sample, reason: str) -> DataProblem:
        return DataProblem(sample.id, str(sample.target or (sample.controls[0] if sample.controls else "")), reason)


def _unreadable(sample: Sample) -> DataProblem | None:
    """The problem of a sample with an image that cannot be read (named as reading it names it), else None."""
    from qie.data.images import open_image

    for path in (*sample.controls, *([sample.target] if sample.target is not None else [])):
        try:
            open_image(path)
        except DataError as e:
            return DataProblem(sample.id, str(getattr(e, "path", None) or path), str(e))
    return None


def build_captioner(model: ModelConfig, spec: ModelSpec, device: str) -> Callable[[CaptionSettings], Captioner]:
    """A function building the caption stage's captioner (the text encoder and its processor, on `device`) for
    `model`."""

    def make(settings: CaptionSettings) -> Any:
        return caption_stage.build_captioner(model, spec, device, settings)  # reads settings.prompt and .generation

    return make


def auto_captions(
    settings: CaptionSettings | None,
    source: SourceSettings,
    spec: ModelSpec,
    generate: bool,
    backend: CacheStore,
    hasher: FileHasher | None = None,
) -> AutoCaptions | None:
    """What fills in missing captions when `data.auto_caption` is set (`settings`, else None: None): captions are
    read from the cache (`backend`, where it stores anything) and, when `generate`, the missing ones are written by
    the model's own text encoder (built on the first one, where `source` builds its encoders) and stored; without
    `generate`, a caption not cached is a miss (naming `source.precompute_command`)."""
    if settings is None:
        return None
    hint = f"fill the cache with {source.precompute_command} or train with cache.mode=lazy"
    make = build_captioner(source.model, spec, source.devices["text_encoder"]) if generate else None
    return AutoCaptions(
        settings,
        context=model_key_context(source.model, spec, source.sizes),
        hasher=hasher or file_hasher(source.state_dir),
        backend=backend if backend.stores else None,
        make_captioner=make,
        spec=spec,
        miss_hint=hint,
    )
