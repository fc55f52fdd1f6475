"""Training data: collate (padding + mask), caption dropout in every source mode, shape buckets."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from PIL import Image

from qie.components.tiny_presets import VAE_CONFIG
from qie.config import compose
from qie.data.buckets import BucketBatchSampler
from qie.data.collate import collate, pad_embeds
from qie.data.dataset import EmbeddingDataset, bucket_keys
from qie.data.samples import scan_dataset
from qie.demo.synthetic import make_dataset
from qie.embeddings import CachedSource, LiveSource, SampleEmbeddings
from qie.stages import precompute
from qie.stages.common import build_source

SCALE = 2 ** len(VAE_CONFIG["temperal_downsample"])  # pixels per latent of the tiny VAE, as diffusers counts


@pytest.fixture(scope="module")
def cached(tiny_path: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[list[str], Path]:
    """A 4-sample data set and a cache filled for it; returns the overrides that point at both."""
    root = tmp_path_factory.mktemp("data")
    make_dataset(root, train=4, heldout=0, size=64)
    overrides = [f"model.pretrained_model_name_or_path={tiny_path}", f"data.path={root / 'train'}"]
    overrides.append(f"cache.dir={root / 'cache'}")
    precompute.run(compose("precompute", overrides), root / "precompute_run")
    return overrides, root


def test_pad_embeds_pads_to_the_longest_with_a_mask() -> None:
    a, b = torch.randn(3, 4), torch.randn(5, 4)
    embeds, mask = pad_embeds([a, b])
    assert embeds.shape == (2, 5, 4) and mask.tolist() == [[1, 1, 1, 0, 0], [1] * 5]
    assert torch.equal(embeds[0, :3], a) and not embeds[0, 3:].any() and torch.equal(embeds[1], b)


@pytest.mark.parametrize("mode", ["cached", "live"])
def test_caption_dropout_swaps_in_the_samples_own_empty_prompt(cached, mode: str) -> None:
    overrides, root = cached
    cfg = compose("train", overrides)
    source = build_source(cfg, mode)
    assert isinstance(source, CachedSource if mode == "cached" else LiveSource)
    samples = scan_dataset(cfg.data.path).samples
    own = source.get(samples[:2])
    dropped = EmbeddingDataset(samples, source, caption_dropout_rate=1.0)[(0, [0, 1])][1]
    kept = EmbeddingDataset(samples, source, caption_dropout_rate=0.0)[(0, [0, 1])][1]
    for i, e in enumerate(own):
        n, m = e.empty_prompt_embed.shape[0], e.prompt_embed.shape[0]
        assert n != m or not torch.equal(e.empty_prompt_embed, e.prompt_embed)
        assert torch.equal(dropped.prompt_embeds[i, :n], e.empty_prompt_embed)
        assert dropped.prompt_embeds_mask[i].sum() == n and not dropped.prompt_embeds[i, n:].any()
        assert torch.equal(kept.prompt_embeds[i, :m], e.prompt_embed)
    # Both sources hand the step the same tensors.
    other = build_source(cfg, "live" if mode == "cached" else "cached").get(samples[:2])
    for a, b in zip(own, other):
        torch.testing.assert_close(a.empty_prompt_embed, b.empty_prompt_embed, rtol=0, atol=1e-6)
        torch.testing.assert_close(a.pixel_latent, b.pixel_latent, rtol=0, atol=1e-6)


def test_caption_dropout_rate_is_a_rate_and_repeats_per_batch_number() -> None:
    class Stub:
        def get(self, samples):
            return [
                SampleEmbeddings(
                    s, torch.zeros(4, 1, 2, 2), (torch.zeros(4, 1, 2, 2),), torch.ones(3, 2), torch.zeros(2, 2)
                )
                for s in samples
            ]

    data = EmbeddingDataset([f"s{i}" for i in range(8)], Stub(), caption_dropout_rate=0.3, seed=5)
    drops = [data[(n, list(range(8)))][1].prompt_embeds_mask.sum(1).eq(2).tolist() for n in range(50)]
    rate = sum(map(sum, drops)) / (50 * 8)
    assert 0.2 < rate < 0.4
    assert drops[7] == data[(7, list(range(8)))][1].prompt_embeds_mask.sum(1).eq(2).tolist()


def _image(path: Path, size: tuple[int, int], color: tuple[int, int, int]) -> None:
    Image.new("RGB", size, color).save(path)


@pytest.fixture(scope="module")
def two_shapes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Six square and six wide samples (64x64 and 128x32: different latent shapes at 4096 px)."""
    root = tmp_path_factory.mktemp("shapes")
    (root / "training_images").mkdir()
    (root / "control_images").mkdir()
    for i in range(12):
        size = (64, 64) if i % 2 else (128, 32)
        _image(root / "training_images" / f"{i:02d}.png", size, (20 * i, 0, 0))
        _image(root / "control_images" / f"{i:02d}.png", size, (0, 20 * i, 0))
        (root / "training_images" / f"{i:02d}.txt").write_text("x" * (i + 1))
    return root


def test_buckets_never_mix_shapes(two_shapes: Path) -> None:
    samples = scan_dataset(two_shapes).samples
    keys = bucket_keys(samples, 4096, 4096, 32)
    assert len(set(keys)) == 2
    for replicas in (1, 2):
        for rank in range(replicas):
            sampler = BucketBatchSampler(keys, [len(s.prompt) for s in samples], 2, 3, True, replicas, rank)
            seen = set()
            for number, indices in zip(range(30), sampler):
                shapes = {keys[i] for i in indices[1]}
                assert len(shapes) == 1 and len(indices[1]) == 2, (number, indices)
                seen |= shapes
            assert seen == set(keys)  # both buckets are used
    # Each process takes its own share of one global batch, so their shapes agree too.
    a = BucketBatchSampler(keys, [1] * 12, 2, 3, True, 2, 0)
    b = BucketBatchSampler(keys, [1] * 12, 2, 3, True, 2, 1)
    for (_, x), (_, y) in zip(zip(range(10), a), zip(range(10), b)):
        assert not set(x[1]) & set(y[1]) and len({keys[i] for i in x[1] + y[1]}) == 1


def test_bucket_keys_are_the_latent_shapes_and_collate_refuses_a_mix(two_shapes: Path, tiny_path: Path) -> None:
    cfg = compose("train", [f"model.pretrained_model_name_or_path={tiny_path}", f"data.path={two_shapes}"])
    cfg.cache.mode = "live"
    samples = scan_dataset(two_shapes).samples[:2]
    embeds = build_source(cfg).get(samples)
    for e, key in zip(embeds, bucket_keys(samples, 4096, 4096, 32)):
        for latent, (w, h) in zip((e.pixel_latent, *e.control_latents), key):
            assert latent.shape[-2:] == (h // SCALE, w // SCALE)
    with pytest.raises(ValueError, match="mixes latent shapes"):
        collate(embeds)
