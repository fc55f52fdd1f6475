"""The Encoder gives what diffusers' own Qwen-Image-Edit(-Plus) pipelines compute (tiny models, CPU)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import QwenImageEditPipeline, QwenImageEditPlusPipeline
from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions
from helpers import small_config, tiny_pipeline, write_noise_image
from PIL import Image
from stage_edges import encoder_for

from qie.data.samples import Sample
from qie.embedding.encode import EMPTY_PROMPT, Encoder, ImageSizes, prepare_sample
from qie.types import CACHE_TYPES, TRAINING_TYPES

AREA = 64 * 64
SIZES = ImageSizes(target_pixels=AREA, vae_image_pixels=AREA, vl_image_pixels=AREA)
ALL_TYPES = list(CACHE_TYPES)


@pytest.fixture(scope="module")
def edit(tiny_path: Path) -> tuple[Encoder, QwenImageEditPipeline]:
    return encoder_for(small_config("precompute")), tiny_pipeline(QwenImageEditPipeline, tiny_path)


@pytest.fixture(scope="module")
def plus(tiny_plus_path: Path) -> tuple[Encoder, QwenImageEditPlusPipeline]:
    encoder = encoder_for(small_config("precompute", "model=tiny_plus"))
    return encoder, tiny_pipeline(QwenImageEditPlusPipeline, tiny_plus_path)


def _pipeline_inputs(pipe, path: Path, area: int = AREA) -> tuple[Image.Image, torch.Tensor]:
    """What the pipeline's __call__ makes of a condition image: the resized PIL image and the VAE input."""
    img = Image.open(path).convert("RGB")
    w, h, _ = calculate_dimensions(area, img.width / img.height)
    resized = pipe.image_processor.resize(img, h, w)
    return resized, pipe.image_processor.preprocess(resized, h, w).unsqueeze(2)


def test_prepared_images_are_the_pipelines(edit, tmp_path: Path) -> None:
    _, pipe = edit
    path = write_noise_image(tmp_path / "c.png", 0, (80, 48))
    prepared = prepare_sample(Sample(id="s", target=path, controls=(path,), prompt="p"), SIZES)
    vl_image, vae_input = _pipeline_inputs(pipe, path)
    assert prepared.control_pixels[0].shape == (3, 64, 96)
    assert torch.equal(prepared.control_pixels[0], vae_input[0, :, 0])
    assert np.array_equal(np.asarray(prepared.vl_images[0]), np.asarray(vl_image))
    assert torch.equal(prepared.target, vae_input[0, :, 0])  # target area == condition area here


def test_latents_equal_the_pipelines_vae_encoding(edit, tmp_path: Path) -> None:
    encoder, pipe = edit
    paths = [write_noise_image(tmp_path / f"{i}.png", i) for i in range(3)]
    inputs = [_pipeline_inputs(pipe, p)[1] for p in paths]
    with torch.no_grad():
        expected = [pipe._encode_vae_image(x, generator=None)[0] for x in inputs]
    singles = [encoder.encode_latents([x[0, :, 0]])[0] for x in inputs]
    for got, want in zip(singles, expected):
        assert got.shape == (4, 1, 16, 16) and got.dtype == torch.float32
        assert torch.equal(got, want)
    batched = encoder.encode_latents([x[0, :, 0] for x in inputs])
    for got, want in zip(batched, expected):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    # Normalised with the VAE's latents_mean / latents_std, not raw.
    with torch.no_grad():
        raw = pipe.vae.encode(inputs[0]).latent_dist.mode()[0]
    assert not torch.allclose(raw, singles[0], atol=1e-3)


def test_prompt_embeddings_equal_encode_prompt(edit, tmp_path: Path) -> None:
    encoder, pipe = edit
    images = [_pipeline_inputs(pipe, write_noise_image(tmp_path / f"{i}.png", 10 + i))[0] for i in range(3)]
    prompts = ["Make the sky blue.", "Remove the red car from the street.", EMPTY_PROMPT]
    with torch.no_grad():
        expected = []
        for prompt, image in zip(prompts, images):
            embeds, mask = pipe.encode_prompt(prompt, image=image, device=torch.device("cpu"))
            assert mask is None  # nothing padded in a batch of one
            expected.append(embeds[0])
    singles = [encoder.encode_prompts([p], [[im]])[0] for p, im in zip(prompts, images)]
    for got, want in zip(singles, expected):
        assert torch.equal(got, want)
    batched = encoder.encode_prompts(prompts, [[im] for im in images])
    assert len({e.shape[0] for e in batched}) == 3  # different lengths, returned unpadded
    for got, want in zip(batched, expected):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_same_prompt_other_image_other_embedding(edit, tmp_path: Path) -> None:
    encoder, _ = edit
    a, b = (
        prepare_sample(
            Sample(id="s", target=None, controls=(write_noise_image(tmp_path / f"{i}.png", i),), prompt="x"), SIZES
        )
        for i in (1, 2)
    )
    ea, eb = encoder.encode_prompts(["Make it red."] * 2, [a.vl_images, b.vl_images])
    assert ea.shape == eb.shape and not torch.allclose(ea, eb)


def test_edit_prompt_takes_exactly_one_image(edit, tmp_path: Path) -> None:
    encoder, _ = edit
    img = Image.open(write_noise_image(tmp_path / "a.png", 3)).convert("RGB")
    with pytest.raises(ValueError, match="takes at most 1"):
        encoder.encode_prompts(["two images"], [[img, img]])
    with pytest.raises(ValueError, match="needs its images"):
        encoder.encode_prompts(["no image"], [[]])


def test_encode_entries_gives_every_type(edit, tmp_path: Path) -> None:
    encoder, _ = edit
    samples = [
        Sample(
            id=f"s{i}",
            target=write_noise_image(tmp_path / f"t{i}.png", i),
            controls=(write_noise_image(tmp_path / f"c{i}.png", 50 + i),),
            prompt=f"edit {i}",
            # a preference pair: the other sample's target is rejected
            field_images=(("rejected", tmp_path / f"t{1 - i}.png"),),
        )
        for i in range(2)
    ]
    prepared = [prepare_sample(s, SIZES) for s in samples]
    entries = encoder.encode_entries(prepared, ALL_TYPES)
    for i, entry in enumerate(entries):  # the masks are derived from the embeddings' lengths, never stored
        assert set(entry) == set(TRAINING_TYPES) - {"layer_latent"}  # an Edit sample has no layers
        rejected = entry["rejected_latent"]["latent"]  # encoded as the target it is elsewhere
        torch.testing.assert_close(rejected, entries[1 - i]["pixel_latent"]["latent"])
        assert entry["pixel_latent"]["latent"].shape == (4, 1, 16, 16)
        assert list(entry["control_latent"]) == ["0"]
        for kind in ("prompt_embed", "empty_prompt_embed"):
            embed = entry[kind]["embed"]
            assert embed.ndim == 2 and embed.shape[1] == 16
    # Batched like encode_entries batches them (the two targets together), the latents are bit-identical.
    targets = encoder.encode_latents([p.target for p in prepared])
    assert all(torch.equal(e["pixel_latent"]["latent"], t) for e, t in zip(entries, targets))
    only = encoder.encode_entries(prepared, ["control_latent"])
    assert [set(e) for e in only] == [{"control_latent"}] * 2


def test_edit_plus_multi_image_prompt(plus, tmp_path: Path) -> None:
    encoder, pipe = plus
    paths = [write_noise_image(tmp_path / f"{i}.png", 20 + i, size) for i, size in enumerate([(64, 64), (80, 48)])]
    sample = Sample(
        id="s", target=None, controls=tuple(paths), prompt="Put the object from picture 2 on the table in picture 1."
    )
    prepared = prepare_sample(sample, SIZES)
    conditions = [_pipeline_inputs(pipe, p)[0] for p in paths]
    for got, want in zip(prepared.vl_images, conditions):
        assert np.array_equal(np.asarray(got), np.asarray(want))
    with torch.no_grad():
        expected, _ = pipe.encode_prompt(sample.prompt, image=conditions, device=torch.device("cpu"))
    (got,) = encoder.encode_prompts([sample.prompt], [prepared.vl_images])
    assert torch.equal(got, expected[0])
    (swapped,) = encoder.encode_prompts([sample.prompt], [prepared.vl_images[::-1]])
    assert not torch.allclose(swapped, got)  # "Picture 1", "Picture 2" follow the image order
    entry = encoder.encode_entries([prepared], ALL_TYPES)[0]
    assert list(entry["control_latent"]) == ["0", "1"]
    assert entry["control_latent"]["1"].shape == (4, 1, 16, 24)
    assert torch.equal(entry["prompt_embed"]["embed"], expected[0])


def test_a_batch_shares_encoder_calls_and_one_sample_is_encoded_alone(edit, tmp_path: Path, monkeypatch) -> None:
    encoder, pipe = edit
    samples = [
        Sample(
            id=f"b{i}",
            target=write_noise_image(tmp_path / f"t{i}.png", 70 + i),
            controls=(write_noise_image(tmp_path / f"c{i}.png", 80 + i),),
            prompt=f"edit {i}",
        )
        for i in range(2)
    ]
    prepared = [prepare_sample(s, SIZES) for s in samples]
    calls: list[tuple[str, int]] = []
    latents, prompts = encoder.encode_latents, encoder.encode_prompt_entries
    monkeypatch.setattr(encoder, "encode_latents", lambda px: calls.append(("vae", len(px))) or latents(px))
    monkeypatch.setattr(
        encoder, "encode_prompt_entries", lambda p, im: calls.append(("prompt", len(p))) or prompts(p, im)
    )
    batched = encoder.encode_entries(prepared, ALL_TYPES)
    # Two samples: targets and controls (one size) in one VAE call, prompts and empty prompts in one call.
    assert calls == [("vae", 4), ("prompt", 4)]
    vae = encoder.parts.vae
    assert vae.encoder.conv_in.weight.is_contiguous(memory_format=torch.channels_last_3d)
    assert vae.decoder.conv_in.weight.is_contiguous()  # only the encoding half changes layout
    calls.clear()
    alone = [encoder.encode_entries([p], ALL_TYPES)[0] for p in prepared]
    # One sample: each type alone, each image alone, as the pipeline encodes it, bit for bit.
    assert calls == [("vae", 1), ("vae", 1), ("prompt", 1), ("prompt", 1)] * 2
    for p, entry in zip(prepared, alone):
        with torch.no_grad():
            want = pipe._encode_vae_image(p.target[None, :, None], generator=None)[0]
        assert torch.equal(entry["pixel_latent"]["latent"], want)
    for got, want in zip(batched, alone):
        assert list(got) == list(want)
        torch.testing.assert_close(got["pixel_latent"]["latent"], want["pixel_latent"]["latent"], atol=1e-5, rtol=0)
        torch.testing.assert_close(got["control_latent"]["0"], want["control_latent"]["0"], atol=1e-5, rtol=0)
        for kind in ("prompt_embed", "empty_prompt_embed"):
            assert got[kind]["embed"].shape == want[kind]["embed"].shape
            torch.testing.assert_close(got[kind]["embed"], want[kind]["embed"], atol=1e-5, rtol=0)
