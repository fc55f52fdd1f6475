"""Helpers the tests share: a shrunk real config, images on disk, counting model constructions, the tiny
diffusers pipelines. Fixtures built on them live in conftest.py."""

from __future__ import annotations

import contextlib
import functools
import sys
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from omegaconf import DictConfig
from PIL import Image

# What makes the real config small and quick, per section of a stage's root: the tiny model (its files
# follow QIE_HOME, which conftest points at the session's folder), no loader worker processes, no
# TensorBoard, two training steps, two denoising steps. Tests add what they need after these.
SHRINK = {
    "model": ["model=tiny"],
    "data": ["data.num_workers=0"],
    "train": ["train.max_steps=2", "train.checkpoint_every=0"],
    "logging": ["logging.report_to=none"],
    "predict": ["predict.num_inference_steps=2"],
}
ROOT_SECTIONS = {
    "precompute": ("model", "data"),
    "train": ("model", "data", "train", "logging", "predict"),
    "demo": ("model", "data", "train", "logging", "predict"),
    "infer": ("model", "data", "predict"),
    "cache": (),
    "caption": ("model", "data"),
    "eval": ("model", "data", "predict"),
}


def small_overrides(stage: str, *overrides: str) -> list[str]:
    """The overrides that shrink `stage`'s real config, then `overrides` (which win where they overlap)."""
    return [o for section in ROOT_SECTIONS[stage] for o in SHRINK[section]] + list(overrides)


def small_config(stage: str, *overrides: str) -> DictConfig:
    """`stage`'s real composed config (as the CLI composes it), shrunk for tests, with `overrides`."""
    from qie.checks import compose

    return compose(stage, small_overrides(stage, *overrides))


@dataclass(frozen=True)
class CachedData:
    """A synthetic data set and a cache the precompute stage filled for it (conftest's `cached_data`)."""

    root: Path  # holds train/ (the samples), cache/ and precompute_run/
    data: Path
    cache: Path

    @property
    def overrides(self) -> list[str]:
        """data.path and cache.dir pointing here."""
        return [f"data.path={self.data}", f"cache.dir={self.cache}"]


# --- images ---------------------------------------------------------------------------------------------


def noise_image(seed: int, size: tuple[int, int] = (64, 64)) -> Image.Image:
    """An RGB image of uniform noise, `size` = (width, height), a function of `seed`."""
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def write_noise_image(path: Path, seed: int, size: tuple[int, int] = (64, 64)) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    noise_image(seed, size).save(path)
    return path


def write_solid_image(path: Path, color: tuple[int, int, int] = (10, 20, 30), size: tuple[int, int] = (8, 8)) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, color).save(path)
    return path


# --- models ---------------------------------------------------------------------------------------------


def count_constructions(mp: pytest.MonkeyPatch, classes: Mapping[str, type] | Iterable[type]) -> Counter:
    """Count constructions of each class (not of its subclasses) while `mp` is active.

    Args:
        classes: {label: class}, or classes counted under their own names.

    Returns:
        A Counter, label -> constructions so far (labels never built are absent).
    """
    labelled = dict(classes) if isinstance(classes, Mapping) else {cls.__name__: cls for cls in classes}
    counts: Counter = Counter()
    for label, cls in labelled.items():
        mp.setattr(cls, "__init__", _counting(cls.__init__, cls, label, counts))
    return counts


def _counting(init, cls: type, label: str, counts: Counter):
    @functools.wraps(init)  # keeps the signature, which diffusers and transformers read to build configs
    def counted(self, *args, **kwargs):
        if type(self) is cls:
            counts[label] += 1
        init(self, *args, **kwargs)

    return counted


def tiny_pipeline(cls: type, path: Path):
    """A diffusers pipeline of class `cls` from a tiny model folder, with qie's processor, quiet."""
    from qie.models.processor import load_processor

    pipe = cls.from_pretrained(path, processor=load_processor(path))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def cached_set(tiny_path: Path, root: Path, train: int) -> dict:
    """`train` 64 px samples of the synthetic task in `root`, precomputed for the tiny model at `tiny_path`:
    {"root", "base": the overrides that train on them}."""
    from qie.checks import compose
    from qie.demo.synthetic import make_dataset
    from qie.stages import precompute

    make_dataset(root, train=train, heldout=0, size=64)
    model = f"model.pretrained_model_name_or_path={tiny_path}"
    base = [model, f"data.path={root / 'train'}", f"cache.dir={root / 'cache'}", "data.num_workers=0"]
    precompute.run(compose("precompute", base[:3]), root / "precompute_run")
    return {"root": root, "base": base}


@contextlib.contextmanager
def held_run_lock(run: Path):
    """Another process holding the run lock of folder `run` (as a live training does) while the block runs;
    killed (-9) after it. Yields the process."""
    import subprocess
    import sys

    holder = subprocess.Popen(
        [sys.executable, "-c", f"from qie import run_lock; from pathlib import Path; import time; "
         f"run_lock.acquire(Path({str(run)!r})); print('held', flush=True); time.sleep(600)"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        yield holder
    finally:
        holder.kill()  # kill -9: the kernel drops the lock with the process
        holder.wait()


def hf_extra_image_column(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, field: str) -> tuple[bytes, list]:
    """A two-row Hugging Face data set (target, one control, prompt) with an image column `extra` set in the first
    row only, saved under tmp_path and read with `data.columns.<field>=extra`: (the extra image's bytes, samples)."""
    datasets = pytest.importorskip("datasets")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    from qie.data.formats import Columns, DataSource, read_dataset

    images = {}
    for name, colour in (("t", (255, 0, 0)), ("c", (0, 255, 0)), ("x", (255, 255, 255))):
        Image.new("RGB", (32, 32), colour).save(tmp_path / f"{name}.png")
        images[name] = (tmp_path / f"{name}.png").read_bytes()
    features = datasets.Features({"target": datasets.Image(), "controls": datasets.List(datasets.Image()),
                                  "prompt": datasets.Value("string"), "extra": datasets.Image()})  # fmt: skip
    rows = {"target": [images["t"]] * 2, "controls": [[images["c"]]] * 2, "prompt": ["a", "b"],
            "extra": [images["x"], None]}  # fmt: skip
    datasets.Dataset.from_dict(rows, features=features).save_to_disk(str(tmp_path / "ds"))
    columns = Columns(**{field: "extra"})
    return images["x"], read_dataset(DataSource(path=str(tmp_path / "ds"), format="hf", columns=columns,
                                                images_dir=tmp_path / "img")).samples  # fmt: skip


@contextlib.contextmanager
def optuna_logs_through_root():
    """optuna binds its own log handler to the stderr of the test that first searched (captured, then closed): a
    later search in the same worker would print a logging error into its own stderr. Within the block optuna's
    records go to the root logger's handlers, which each run sets up anew. Its first import in a worker logs
    (alembic's plugins, at INFO) through the root logger, whose handlers an earlier run in the worker may have bound
    to that test's stream, closed since: those are set aside before the import."""
    import logging

    root = logging.getLogger()
    for handler in list(root.handlers):
        stream = getattr(handler, "stream", None)
        if stream is not None and getattr(stream, "closed", False):
            root.removeHandler(handler)
    import optuna

    optuna.logging.disable_default_handler()
    try:
        yield
    finally:
        optuna.logging.enable_default_handler()


# --- sample fields declared by tests ----------------------------------------------------------------------


@contextmanager
def fields_forgotten() -> Iterator[None]:
    """Within the block, fields and stores may be declared (`SampleField(...)`, importing tests/plugins/depth.py, an
    objective's `context.store(TYPE)`); after it they are forgotten: declaring one makes its entry type a cache type,
    which other tests count."""
    import qie.data.fields as fields
    import qie.types as types

    saved = list(types.CACHE_TYPES), list(types.FIELD_TYPES), dict(fields._DECLARED), list(types.STORE_TYPES)
    try:
        yield
    finally:
        sys.modules.pop("plugins.depth", None)  # its import declared the field
        types.CACHE_TYPES[:], types.FIELD_TYPES[:], types.STORE_TYPES[:] = saved[0], saved[1], saved[3]
        fields._DECLARED.clear()
        fields._DECLARED.update(saved[2])
