"""Training data: collate (padding + mask), caption dropout in every source mode, shape buckets."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest
import torch
from helpers import CachedData, small_config, write_solid_image
from stage_edges import source_for

from qie.data.buckets import BucketBatchSampler, bucket_keys
from qie.data.collate import collate
from qie.data.scan import scan_dataset
from qie.embedding.sources import CachedSource, LiveSource, SampleEmbeddings
from qie.models.qwen_image import TINY_VAE
from qie.training.batches import EmbeddingDataset
from qie.types import pad_prompt_embeds

SCALE = 2 ** len(TINY_VAE["temperal_downsample"])  # pixels per latent of the tiny VAE, as diffusers counts


def test_pad_embeds_pads_to_the_longest_with_a_mask() -> None:
    a, b = torch.randn(3, 4), torch.randn(5, 4)
    embeds, mask = pad_prompt_embeds([a, b])
    assert embeds.shape == (2, 5, 4) and mask.tolist() == [[1, 1, 1, 0, 0], [1] * 5]
    assert torch.equal(embeds[0, :3], a) and not embeds[0, 3:].any() and torch.equal(embeds[1], b)


@pytest.mark.parametrize("mode", ["cached", "live"])
def test_caption_dropout_swaps_in_the_samples_own_empty_prompt(cached_data: CachedData, mode: str) -> None:
    cfg = small_config("train", *cached_data.overrides)
    source = source_for(cfg, mode)
    assert isinstance(source, CachedSource if mode == "cached" else LiveSource)
    samples = scan_dataset(cfg.data.path).samples
    own = source.get(samples[:2])
    dropped = EmbeddingDataset(samples, source, caption_dropout_rate=1.0)[(0, [0, 1])][1]
    kept = EmbeddingDataset(samples, source, caption_dropout_rate=0.0)[(0, [0, 1])][1]
    for i, e in enumerate(own):
        n, m = e.empty_prompt_embed.shape[0], e.prompt_embed.shape[0]
        assert n != m or not torch.equal(e.empty_prompt_embed, e.prompt_embed)
        assert torch.equal(dropped.prompt_embeds[i, :n], e.empty_prompt_embed)
        # No mask means nothing is padded: every row is all tokens (as diffusers' encode_prompt gives it).
        mask = dropped.prompt_embeds_mask
        tokens = dropped.prompt_embeds.shape[1] if mask is None else int(mask[i].sum())
        assert tokens == n and not dropped.prompt_embeds[i, n:].any()
        assert torch.equal(kept.prompt_embeds[i, :m], e.prompt_embed)
    # Both sources hand the step the same tensors.
    other = source_for(cfg, "live" if mode == "cached" else "cached").get(samples[:2])
    for a, b in zip(own, other):
        torch.testing.assert_close(a.empty_prompt_embed, b.empty_prompt_embed, rtol=0, atol=1e-6)
        torch.testing.assert_close(a.pixel_latent, b.pixel_latent, rtol=0, atol=1e-6)


def test_caption_dropout_is_a_function_of_seed_and_batch_number() -> None:
    class Stub:
        def get(self, samples):
            return [
                SampleEmbeddings(
                    s, torch.zeros(4, 1, 2, 2), (torch.zeros(4, 1, 2, 2),), torch.ones(3, 2), torch.full((2, 2), 2.0)
                )
                for s in samples
            ]

    data = EmbeddingDataset([f"s{i}" for i in range(8)], Stub(), caption_dropout_rate=0.3, seed=5)
    drops = [data[(n, list(range(8)))][1].prompt_embeds[:, 0, 0].eq(2.0).tolist() for n in range(50)]
    # Exactly the documented rule: one uniform draw per position from Random(f"{seed}:{batch number}").
    expected = []
    for n in range(50):
        rng = random.Random(f"5:{n}")
        expected.append([rng.random() < 0.3 for _ in range(8)])
    assert drops == expected
    assert 0.2 < sum(map(sum, drops)) / (50 * 8) < 0.4
    assert drops[7] == data[(7, list(range(8)))][1].prompt_embeds[:, 0, 0].eq(2.0).tolist()


@pytest.fixture(scope="module")
def two_shapes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Six square and six wide samples (64x64 and 128x32: different latent shapes at 4096 px)."""
    root = tmp_path_factory.mktemp("shapes")
    for i in range(12):
        size = (64, 64) if i % 2 else (128, 32)
        write_solid_image(root / "training_images" / f"{i:02d}.png", (20 * i, 0, 0), size)
        write_solid_image(root / "control_images" / f"{i:02d}.png", (0, 20 * i, 0), size)
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


def test_bucket_keys_are_the_latent_shapes_and_collate_refuses_a_mix(two_shapes: Path, small_cfg) -> None:
    cfg = small_cfg("train", f"data.path={two_shapes}", "cache.mode=live")
    samples = scan_dataset(two_shapes).samples[:2]
    embeds = source_for(cfg).get(samples)
    for e, key in zip(embeds, bucket_keys(samples, 4096, 4096, 32)):
        for latent, (w, h) in zip((e.pixel_latent, *e.control_latents), key):
            assert latent.shape[-2:] == (h // SCALE, w // SCALE)
    with pytest.raises(ValueError, match="mixes latent shapes"):
        collate(embeds)


def test_no_sample_is_dropped_and_the_stream_stays_a_function_of_seed_and_n() -> None:
    # Buckets of 5, 1 and 7 samples; batches of 2 (x 2 processes): a 1-sample bucket, odd remainders.
    keys = ["a"] * 5 + ["b"] + ["c"] * 7
    for replicas in (1, 2):
        streams = [BucketBatchSampler(keys, [1] * 13, 2, 3, True, replicas, rank) for rank in range(replicas)]
        first = [[b for _, b in zip(range(60), s)] for s in streams]
        for rank, sampler in enumerate(streams):
            epochs = [sampler.epoch_batches(e) for e in range(6)]
            seen = [i for batches in epochs for batch in batches for i in batch]
            counts = {i: seen.count(i) for i in range(13)}
            # The lone sample trains each epoch, as a batch of its own (one copy per process).
            assert counts[5] == 6 * replicas and all(
                batch == [5] * replicas for b in epochs for batch in b if 5 in batch
            )
            # Leftovers carry over: after 6 epochs every other sample trained 5 or 6 times, none fewer.
            assert all(counts[i] in (5, 6) for i in range(13) if i != 5), counts
            assert all(len({keys[i] for i in batch}) == 1 for batches in epochs for batch in batches)
            # Resuming at batch k gives exactly batch k onwards, and a fresh sampler computes the same epochs.
            resumed = BucketBatchSampler(keys, [1] * 13, 2, 3, True, replicas, rank, start=37)
            assert [b for _, b in zip(range(23), resumed)] == first[rank][37:]
        if replicas == 2:  # both processes take disjoint halves of each full global batch
            for (_, x), (_, y) in zip(first[0], first[1]):
                assert x == y == [5] or not set(x) & set(y)


def test_the_start_up_summary_and_a_one_sample_bucket_is_trained_on(
    two_shapes: Path, tiny_path: Path, tmp_path: Path, capsys
) -> None:
    from qie.stages import train as train_stage

    data = tmp_path / "data"
    shutil.copytree(two_shapes, data)
    for stem in ("02", "04", "06", "08", "10"):  # one wide sample (00) is left, and the six square ones
        for gone in data.rglob(f"{stem}.*"):
            gone.unlink()
    overrides = [f"model.pretrained_model_name_or_path={tiny_path}", f"data.path={data}", "cache=none",
                 "data.batch_size=2", "train.max_steps=4", "logging.report_to=none", "data.num_workers=0"]  # fmt: skip
    seen: list[str] = []
    train_stage.run(
        small_config("train", *overrides), tmp_path / "run", on_step_end=lambda info: seen.extend(info.batch.ids)
    )
    out = capsys.readouterr().out
    assert "qie: data: 7 samples in 2 bucket(s) (128x32+128x32: 1, 64x64+64x64: 6)" in out
    assert "1 bucket(s) smaller than a batch of 2: each trains as one smaller batch" in out
    # One epoch is four steps: three batches of two square samples, and the wide sample alone.
    assert sorted(seen) == ["00", "01", "03", "05", "07", "09", "11"]


@pytest.mark.parametrize(
    ("keys", "batch_size", "seed", "replicas", "digest"),
    [
        (["a"] * 5 + ["b"] + ["c"] * 7, 2, 3, 1, "afa8f3453afc19f0"),
        (["a"] * 5 + ["b"] + ["c"] * 7, 2, 3, 2, "70de55815076625f"),
        ([0] * 50, 1, 7, 1, "d582ca532a6bcf8a"),
        (["x", "y"] * 20 + ["z"], 3, 11, 2, "255447d314627f95"),
    ],
)
def test_the_batch_stream_is_the_one_runs_resume_into(keys, batch_size, seed, replicas, digest) -> None:
    """The first 120 batches of each process, pinned: a checkpoint taken by an earlier run resumes into exactly
    the batches it would have trained on (the stream's order may not change however epochs are made)."""
    import hashlib
    import json

    out = []
    for rank in range(replicas):
        s = BucketBatchSampler(keys, [i % 4 for i in range(len(keys))], batch_size, seed, True, replicas, rank)
        out.append([b for _, b in zip(range(120), s)])
    assert hashlib.sha256(json.dumps(out).encode()).hexdigest()[:16] == digest
