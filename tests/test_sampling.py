"""The Qwen-Image family's sampler reproduces the diffusers Edit pipelines' loop from already-encoded inputs."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import QwenImageEditPipeline
from helpers import noise_image, tiny_pipeline

from qie.models.flow import inference_sigmas
from qie.models.qwen_image_sampling import decode_latents, sample_latents
from qie.models.qwen_image_sampling import vae_scale as vae_scale_factor
from qie.models.sampling import true_cfg_enabled
from qie.types import pad_prompt_embeds

SIZE = 64


@pytest.fixture(scope="module")
def pipe(tiny_path: Path) -> QwenImageEditPipeline:
    return tiny_pipeline(QwenImageEditPipeline, tiny_path)


def _image(seed: int):
    return noise_image(seed, (SIZE, SIZE))


def test_pad_prompt_embeds_drops_an_all_ones_mask() -> None:
    a, b = torch.randn(3, 4), torch.randn(5, 4)
    batch, mask = pad_prompt_embeds([a, a.clone()])
    assert batch.shape == (2, 3, 4) and mask is None
    batch, mask = pad_prompt_embeds([a, b])
    assert batch.shape == (2, 5, 4)
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]
    assert torch.equal(batch[0, :3], a) and not batch[0, 3:].any() and torch.equal(batch[1], b)


def test_the_inference_sigma_schedules_are_the_pipelines_spellings() -> None:
    """`qie.models.flow.inference_sigmas` spells both schedules the pipelines use; they give the same numbers in exact
    arithmetic but not the same bits, so each family's sampling names its own pipeline's."""
    for steps in (1, 3, 7, 40, 50):
        assert np.array_equal(inference_sigmas("linspace_to_1_over_n", steps), np.linspace(1.0, 1 / steps, steps))
        assert np.array_equal(inference_sigmas("linspace_to_0_dropped", steps), np.linspace(1.0, 0, steps + 1)[:-1])
    apart = [inference_sigmas(name, 7) for name in ("linspace_to_1_over_n", "linspace_to_0_dropped")]
    assert np.allclose(*apart, rtol=0, atol=1e-15) and not np.array_equal(*apart)


def test_true_cfg_needs_scale_and_negative(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="qie.models.sampling"):
        assert true_cfg_enabled(4.0, True)
        assert not caplog.records
        assert not true_cfg_enabled(4.0, False)
        assert "no negative prompt" in caplog.text
        caplog.clear()
        assert not true_cfg_enabled(1.0, True)
        assert "true_cfg_scale <= 1" in caplog.text


@pytest.mark.usefixtures("small_conditions")
def test_padded_batch_with_cfg_matches_pipeline(pipe: QwenImageEditPipeline) -> None:
    """Two prompts of different lengths (a real padding mask) and true CFG, against the pipeline."""
    images = [_image(1), _image(2)]
    prompts = ["Make the sky blue.", "Remove the red car from the street and add a small hat to the dog."]
    negative = ["", " "]
    generator = torch.Generator().manual_seed(7)
    ref = pipe(image=images, prompt=prompts, negative_prompt=negative, true_cfg_scale=3.0,
               num_inference_steps=3, generator=generator, output_type="np").images  # fmt: skip

    resized = [pipe.image_processor.resize(im, SIZE, SIZE) for im in images]
    embeds, mask = pipe.encode_prompt(prompts, image=resized)
    neg_embeds, neg_mask = pipe.encode_prompt(negative, image=resized)
    assert mask is not None  # the prompts differ in length, so this batch exercises the mask
    pixels = pipe.image_processor.preprocess(resized, SIZE, SIZE).unsqueeze(2)
    control = pipe._encode_vae_image(pixels, generator=None)
    scheduler = pipe.scheduler
    latents = sample_latents(
        pipe.transformer, scheduler, embeds, mask, [control], SIZE, SIZE, vae_scale_factor(pipe.vae),
        num_inference_steps=3, generator=torch.Generator().manual_seed(7),
        negative_prompt_embeds=neg_embeds, negative_prompt_embeds_mask=neg_mask, true_cfg_scale=3.0,
    )  # fmt: skip
    assert latents.shape == (2, 4, 1, SIZE // 4, SIZE // 4)
    mine = decode_latents(pipe.vae, latents, output_type="np")
    assert mine.shape == ref.shape == (2, SIZE, SIZE, 3)
    assert np.abs(mine - ref).max() <= 1e-5
    assert scheduler is pipe.scheduler  # a copy ran the loop
    pils = decode_latents(pipe.vae, latents)
    assert [im.size for im in pils] == [(SIZE, SIZE)] * 2


@pytest.mark.usefixtures("small_conditions")
def test_one_control_repeats_over_the_batch_and_steps_change_result(pipe: QwenImageEditPipeline) -> None:
    image = pipe.image_processor.resize(_image(3), SIZE, SIZE)
    embeds, mask = pipe.encode_prompt("Make the sky blue.", image=image)
    control = pipe._encode_vae_image(pipe.image_processor.preprocess(image, SIZE, SIZE).unsqueeze(2), None)
    args = (pipe.transformer, pipe.scheduler)
    kw = dict(control_latents=[control], height=SIZE, width=SIZE, vae_scale_factor=4)
    two = sample_latents(*args, embeds.repeat(2, 1, 1), mask, num_inference_steps=2,
                         generator=torch.Generator().manual_seed(0), **kw)  # fmt: skip
    assert two.shape[0] == 2 and not torch.equal(two[0], two[1])  # one noise draw of batch 2
    three = sample_latents(*args, embeds, mask, num_inference_steps=3, generator=torch.Generator().manual_seed(0), **kw)
    assert not torch.allclose(three[0], two[0])
