"""Tiny, randomly initialised checkpoints made of the real classes, for tests, the demo and dry runs.

Each model family's tiny presets are flavours of it (`ModelFamily.flavours`, `qie.models.flavour`: the sizes, and
`Tiny`, what is written besides), read through `qie.models.tiny_presets()`. One builder writes them all:
`build_tiny(path, family, flavour, seed)` writes a normal diffusers folder (model_index.json, transformer/, vae/,
text_encoder/, scheduler/, and tokenizer/ and processor/ as the pipeline takes them) that the preset's pipeline loads
with `from_pretrained` (with `processor=load_processor(path)` where it has a processor). `build_tiny_model(path,
preset)` builds a preset by name and `ensure_tiny_model` builds one in place once, atomically. The same seed gives
bitwise identical weights. `python -m qie.tiny PRESET DIR` writes one.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import diffusers
import torch

from qie.components.tiny_presets import load_shipped_vae
from qie.errors import ModelLoadError
from qie.models import ModelFamily, pipeline_parts, tiny_presets
from qie.models.family import import_named
from qie.models.flavour import Flavour
from qie.models.tiny_tokenizer import system_prefix

TINY_VERSION = "v1"
VISION_TOKENS = {
    "image_token_id": "<|image_pad|>",
    "video_token_id": "<|video_pad|>",
    "vision_start_token_id": "<|vision_start|>",
    "vision_end_token_id": "<|vision_end|>",
}


def preset(variant: str) -> tuple[ModelFamily, Flavour]:
    """(family, flavour) of the tiny preset named `variant`. Raises ValueError naming the presets for an unknown one."""
    presets = tiny_presets()
    if variant not in presets:
        raise ValueError(f"unknown tiny model variant {variant!r}; expected one of {sorted(presets)}")
    return presets[variant]


@contextmanager
def _seeded(seed: int) -> Iterator[None]:
    """Seed torch's CPU RNG for one component without disturbing the caller's RNG state."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def build_tiny_model(path: str | os.PathLike, variant: str = "edit", seed: int = 0) -> Path:
    """Build the tiny random checkpoint of preset `variant` into `path` and return it."""
    return build_tiny(path, *preset(variant), seed)


def _text_encoder_config(family: ModelFamily, flavour: Flavour, tokenizer: Any) -> Any:
    """The text encoder's config: the flavour's sizes, the tokenizer's vocabulary size and token ids."""
    te, tiny = dict(flavour.text_encoder), flavour.tiny
    text = {
        **te.pop("text_config"),
        "vocab_size": len(tokenizer),
        **{key: getattr(tokenizer, attr) for key, attr in tiny.text_tokens.items()},
    }
    ids = {key: tokenizer.convert_tokens_to_ids(token) for key, token in VISION_TOKENS.items()}
    return family.part_class("text_encoder").config_class(text_config=text, **te, **ids)


def build_tiny(path: str | os.PathLike, family: ModelFamily, flavour: Flavour, seed: int = 0) -> Path:
    """Write the tiny checkpoint of `flavour` (one of `family`'s tiny presets) into `path`: the transformer seeded
    with `seed`, the VAE with `seed + 1` (or shipped weights), the text encoder with `seed + 2`."""
    tiny = flavour.tiny
    parts = pipeline_parts(tiny.pipeline)
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = import_named(tiny.tokenizer)(*(getattr(diffusers, name) for name in tiny.tokenizer_pipelines))
    with _seeded(seed):
        transformer = family.part_class("transformer")(**flavour.transformer)
    with _seeded(seed + 1):
        if tiny.vae_weights:
            vae = load_shipped_vae(dict(flavour.vae), tiny.vae_weights)
        else:
            vae = family.part_class("vae")(**flavour.vae)
    with _seeded(seed + 2):
        text_encoder = family.part_class("text_encoder")(_text_encoder_config(family, flavour, tokenizer)).eval()
    transformer.save_pretrained(out / "transformer")
    vae.save_pretrained(out / "vae")
    text_encoder.save_pretrained(out / "text_encoder")
    family.part_class("scheduler")(**tiny.scheduler).save_pretrained(out / "scheduler")
    if "tokenizer" in parts:
        tokenizer.save_pretrained(out / "tokenizer")
    if "processor" in parts:
        tokenizer.save_pretrained(out / "processor")
        _write_json(out / "processor" / "preprocessor_config.json", dict(tiny.processor))
        if tiny.video_processor:
            video = {k: v for k, v in tiny.processor.items() if k != "image_processor_type"}
            _write_json(
                out / "processor" / "video_preprocessor_config.json",
                {**video, "video_processor_type": "Qwen2VLVideoProcessor"},
            )
    index = {"_class_name": tiny.pipeline, "_diffusers_version": diffusers.__version__, **tiny.index_extra}
    _write_json(out / "model_index.json", {**index, **{name: list(tiny.model_index[name]) for name in parts}})
    return out


def _check_existing(path: Path, variant: str) -> Path:
    """`path`, when the model there is the tiny `variant`: its pipeline class, and the transformer settings that set
    it apart from its family's first tiny preset (Edit-2511's `zero_cond_t`, the demo's sizes)."""
    family, flavour = preset(variant)
    found = json.loads((path / "model_index.json").read_text(encoding="utf-8")).get("_class_name")
    if not isinstance(found, str):
        raise ModelLoadError(
            f"{path / 'model_index.json'}: _class_name is {found!r}, not a pipeline class name: "
            f"remove {path} to rebuild it"
        )
    config = json.loads((path / "transformer" / "config.json").read_text(encoding="utf-8"))
    first = next(iter(family.tiny_flavours.values())).transformer
    overrides = {k: v for k, v in flavour.transformer.items() if k not in first or first[k] != v}
    # Compared as JSON stores them (tuples come back as lists).
    differs = {k: config.get(k) for k, v in overrides.items() if config.get(k) != json.loads(json.dumps(v))}
    if found != flavour.tiny.pipeline or differs:
        raise ModelLoadError(
            f"{path} holds a tiny {found} model {differs or ''}, not the {variant} one asked for "
            f"({flavour.tiny.pipeline} {overrides or ''}): remove it to rebuild"
        )
    return path


@contextmanager
def _build_lock(lock_path: Path) -> Iterator[bool]:
    """An exclusive inter-process lock (fcntl); yields False, locking nothing, where fcntl is missing."""
    try:
        import fcntl
    except ImportError:  # not POSIX: rely on the atomic rename alone
        yield False
        return
    with open(lock_path, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield True
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def ensure_tiny_model(path: str | os.PathLike, variant: str = "edit", seed: int = 0) -> Path:
    """Return `path`, building the tiny model there first if it holds no model_index.json.

    The build goes to a temporary sibling folder that is renamed into place at the end, so a
    killed build leaves no half-written model; concurrent callers serialise on a lock file.
    """
    preset(variant)
    final = Path(path)
    if (final / "model_index.json").is_file():
        return _check_existing(final, variant)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp_prefix = f".{final.name}.tmp-"
    with _build_lock(final.parent / f".{final.name}.lock") as exclusive:
        if (final / "model_index.json").is_file():  # another process built it meanwhile
            return _check_existing(final, variant)
        if final.exists():
            if not final.is_dir() or any(final.iterdir()):
                raise ModelLoadError(f"{final} exists but holds no model_index.json; remove it to rebuild")
            final.rmdir()
        if exclusive:  # under the lock, temp folders left here are from killed builds
            for stale in final.parent.glob(f"{tmp_prefix}*"):
                shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=tmp_prefix, dir=final.parent))
        try:
            build_tiny_model(tmp, variant=variant, seed=seed)
            tmp.chmod(0o755)  # mkdtemp makes it private; the model is a shared cache
            try:
                os.rename(tmp, final)
            except OSError:
                if not (final / "model_index.json").is_file():  # lost a race, but there is no winner
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return _check_existing(final, variant)


def default_tiny_path(variant: str = "edit") -> Path:
    """Where the shared tiny model lives: `$QIE_HOME/tiny/<variant>-v1` (QIE_HOME: ~/.cache/qie)."""
    from qie.config import qie_home

    preset(variant)
    return qie_home() / "tiny" / f"{variant}-{TINY_VERSION}"


__all__ = [
    "build_tiny",
    "build_tiny_model",
    "default_tiny_path",
    "ensure_tiny_model",
    "preset",
    "system_prefix",
]
