"""The Python API delegates to the stage code: same outputs as the CLI stages, nothing built twice."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel
from helpers import count_constructions, small_overrides
from PIL import Image
from transformers import Qwen2_5_VLForConditionalGeneration

import qie
from qie.demo.synthetic import make_dataset
from qie.embedding.manager import EmbeddingCacheManager
from qie.stages import infer

MODELS = (Qwen2_5_VLForConditionalGeneration, AutoencoderKLQwenImage, QwenImageTransformer2DModel)


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_dataset(tmp_path_factory.mktemp("api") / "data", train=4, heldout=1)


@pytest.fixture
def constructions(monkeypatch: pytest.MonkeyPatch) -> Counter:
    return count_constructions(monkeypatch, MODELS)


def overrides(data: Path, cache: Path, *extra: str) -> list[str]:
    """A shrunk train config's overrides (see helpers.SHRINK) on `data` and `cache`, then `extra`."""
    return small_overrides("train", f"data.path={data}/train", f"cache.dir={cache}", *extra)


def test_predict_equals_the_infer_stage(data: Path, tmp_path: Path, tiny_path: Path, constructions: Counter) -> None:
    image = data / "heldout" / "control_images" / "00000.png"
    cfg = qie.compose("train", overrides(data, tmp_path / "cache", "predict.num_inference_steps=3"))
    trainer = qie.Trainer(cfg, run_dir=tmp_path / "run")
    assert not constructions  # a Trainer builds nothing up front
    first = trainer.predict(
        image, "make the circle red", negative_prompt="blurry", true_cfg_scale=2.0, num_inference_steps=3, seed=5
    )
    second = trainer.predict(image, "make the square blue", num_inference_steps=3, seed=5)
    # The same picture as a numpy array (uint8 or float in [0, 1]) or a PIL image gives the same edit.
    pixels = np.asarray(Image.open(image).convert("RGB"))
    for same in (pixels, pixels / 255.0, Image.open(image)):
        again = trainer.predict(same, "make the square blue", num_inference_steps=3, seed=5)
        assert np.array_equal(np.asarray(again), np.asarray(second))
    assert constructions == Counter(
        {n: 1 for n in ("Qwen2_5_VLForConditionalGeneration", "AutoencoderKLQwenImage", "QwenImageTransformer2DModel")}
    )
    assert first.size == second.size == (64, 64)

    infer_cfg = qie.compose(
        "infer",
        [
            f"predict.image={image}",
            "predict.prompt=make the circle red",
            "predict.negative_prompt=blurry",
            "predict.true_cfg_scale=2.0",
            "predict.num_inference_steps=3",
            "predict.seed=5",
        ],
    )
    (written,) = infer.run(infer_cfg, tmp_path / "infer")
    assert np.array_equal(np.asarray(Image.open(written)), np.asarray(first))


def test_fit_in_cached_mode_builds_no_encoder(data: Path, tmp_path: Path, tiny_path: Path) -> None:
    cfg = qie.compose("train", overrides(data, tmp_path / "cache"))
    trainer = qie.Trainer(cfg, run_dir=tmp_path / "run")
    trainer.cache_embeddings()
    with pytest.MonkeyPatch.context() as mp:
        counts = count_constructions(mp, MODELS)
        result = trainer.fit()
    assert counts == Counter({"QwenImageTransformer2DModel": 1})
    assert result["step"] == 2 and Path(result["lora"]).exists()


def test_manager_writes_what_training_reads(data: Path, tmp_path: Path, tiny_path: Path) -> None:
    """Entries written through EmbeddingCacheManager (with the config's keys) are cache hits for training."""
    cache = tmp_path / "cache"
    cfg = qie.compose("train", overrides(data, cache, "cache.mode=lazy"))
    filler = qie.EditDataset(cfg)  # computes live values to store by hand
    computed = [
        filler.source.encoder.encode_entries(  # noqa: SLF001 - reuse the encoder the source holds
            [__import__("qie.embedding.encode", fromlist=["prepare_sample"]).prepare_sample(s, filler.source.sizes)],
            ["pixel_latent", "control_latent", "prompt_embed", "empty_prompt_embed"],
        )[0]
        for s in filler.samples
    ]
    manager = qie.cache_manager(cfg)
    for sample, entry in zip(filler.samples, computed):
        keys = manager.keys_for(sample.target, list(sample.controls), sample.prompt)
        manager.save_cache("pixel_latent", keys["pixel_latent"], entry["pixel_latent"]["latent"])
        manager.save_cache("control_latent", keys["control_latent"], [entry["control_latent"]["0"]])
        manager.save_cache("prompt_embed", keys["prompt_embed"], entry["prompt_embed"]["embed"])
        manager.save_cache("empty_prompt_embed", keys["empty_prompt_embed"], entry["empty_prompt_embed"]["embed"])
    cached = qie.EditDataset(qie.compose("train", overrides(data, cache, "cache.mode=cached")))
    item = cached[1]
    assert item["cached"] is True and cached.get_cache_stats() == {"hits": 1, "misses": 0}
    assert torch.equal(item["prompt_embed"], computed[1]["prompt_embed"]["embed"])
    assert EmbeddingCacheManager(cache).get_cache_stats()["prompt_embed"] == len(filler.samples)
