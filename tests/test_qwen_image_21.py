"""Qwen-Image-2.1: the tiny model, prompt and latent encoding, the training step and the sampling loop
against `QwenImage21Pipeline` itself (tiny model, CPU, fp32)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import QwenImage21Pipeline
from PIL import Image

from qie.config import typed
from qie.data.images import condition_images, fit_area
from qie.models import qwen_image_21 as q21
from qie.models import qwen_image_21_pipeline
from qie.models.processor import Qwen3VLProcessorNoVideo, load_processor
from qie.types import Batch

RES = 64  # the pipeline's output_resolution: condition area and text-to-image size


@pytest.fixture(scope="module")
def pipe(tiny21_path: Path) -> QwenImage21Pipeline:
    pipe = QwenImage21Pipeline.from_pretrained(
        tiny21_path, processor=load_processor(tiny21_path, processor_class=Qwen3VLProcessorNoVideo)
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def rgba(seed: int, height: int, width: int) -> Image.Image:
    """A random image with a random alpha channel."""
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 4), dtype=np.uint8)
    return Image.fromarray(pixels, "RGBA")


def references(count: int) -> list[Image.Image]:
    # Mixed sizes and modes: the output takes the last one's aspect; an RGB one is made opaque RGBA.
    images = [rgba(i, 48 + 16 * i, 80) for i in range(count)]
    if count > 1:
        images[1] = images[1].convert("RGB")
    return images


def test_tiny_model_is_the_real_pipeline(pipe: QwenImage21Pipeline) -> None:
    assert pipe.config.sample_sigmas == [1.0, 0.8, 0.55, 0.3]
    assert pipe.vae.config.in_channels == 4 and pipe.vae.config.z_dim == pipe.transformer.config.in_channels == 64
    # The drop index comes from the chat template: the system turn, exactly.
    system = "<|im_start|>system\nComprehend and analyze the provided prompt.<|im_end|>\n"
    assert pipe._drop_idx == len(pipe.processor.tokenizer(system)["input_ids"]) > 0
    entry = q21.encode_prompts(pipe, None, ["A red cat."], [[]], torch.device("cpu"))[0]
    assert entry["embed"].shape[1] == 16 and not entry["image_mask"].any()
    # One 64x64 reference: (64/32)^2 = 4 merged vision tokens, each standing for 2x2 latent tokens.
    vl = condition_images(rgba(0, 64, 64), RES * RES, RES * RES)[1]
    entry = q21.encode_prompts(pipe, None, ["A red cat."], [[vl]], torch.device("cpu"))[0]
    assert int(entry["image_mask"].sum()) == 4 and entry["embed"].shape[0] == entry["image_mask"].shape[0]


@pytest.mark.parametrize("count", [0, 1, 3])
def test_sampling_matches_pipeline(pipe: QwenImage21Pipeline, count: int) -> None:
    """Text-to-image, one and three references, with true CFG and a negative prompt."""
    images = references(count)
    kw = dict(output_resolution=RES, negative_prompt="blurry", true_cfg_scale=3.0, output_type="np")
    expected = pipe("A red cat.", image=images or None, generator=torch.Generator().manual_seed(3), **kw).images

    prepared = [condition_images(im.convert("RGBA"), RES * RES, RES * RES) for im in images]
    vl = [v for _, v in prepared]
    latents = [pipe._encode_vae_image(px[None, :, None], None)[0] for px, _ in prepared]
    prompt, negative = (
        tuple(q21.encode_prompts(pipe, None, [text], [vl], torch.device("cpu"))[0].values())
        for text in ("A red cat.", "blurry")
    )
    width, height = fit_area(*images[-1].size, RES * RES) if images else (RES, RES)
    out = qwen_image_21_pipeline.sample_latents(
        pipe, prompt, negative, latents, height, width, torch.Generator().manual_seed(3), true_cfg_scale=3.0
    )
    mine = q21.decode_latents(pipe.vae, out, "np")
    assert mine.shape == expected.shape and mine.shape[-1] == 4  # RGBA out
    assert np.abs(mine - expected).max() <= 1e-5


def captured_calls(model: torch.nn.Module) -> tuple[list, object]:
    """A list that fills with (keyword arguments, output) of each forward call of `model`, and the hook."""
    calls = []
    handle = model.register_forward_hook(lambda m, args, kwargs, out: calls.append((kwargs, out[0])), with_kwargs=True)
    return calls, handle


def test_training_step_predicts_what_the_sampling_loop_predicts(pipe: QwenImage21Pipeline) -> None:
    """The step's transformer call equals the pipeline's first denoising call (references before the target,
    image-pad mask with the target's slots, σ as the timestep), and the loss regresses it onto noise - x0."""
    calls, hook = captured_calls(pipe.transformer)
    try:
        pipe("A red cat.", image=references(2), output_resolution=RES, use_kv_cache=False, sigmas=[0.7],
             output_type="latent", generator=torch.Generator().manual_seed(0))  # fmt: skip
    finally:
        hook.remove()
    (call, output) = calls[0]
    shapes = call["img_shapes"][0]
    ref_tokens = sum(h * w for _, h, w in shapes[:-1])
    _, h, w = shapes[-1]
    x_t = call["hidden_states"][:, ref_tokens:]
    unpack = lambda tokens, hh, ww: tokens.transpose(1, 2).reshape(1, -1, 1, hh, ww)  # noqa: E731
    refs, start = [], 0
    for _, rh, rw in shapes[:-1]:
        refs.append(unpack(call["hidden_states"][:, start : start + rh * rw], rh, rw))
        start += rh * rw
    sigma = call["timestep"]
    x0 = torch.randn(1, 64, 1, h, w, generator=torch.Generator().manual_seed(1))
    noise = (unpack(x_t, h, w) - (1 - sigma) * x0) / sigma
    batch = Batch(
        ids=["s"],
        latents=x0,
        control_latents=refs,
        prompt_embeds=call["encoder_hidden_states"],
        prompt_embeds_mask=call["encoder_hidden_states_mask"],
        prompt_image_mask=call["img_mask"][:, : call["encoder_hidden_states"].shape[1]],
    )
    calls, hook = captured_calls(pipe.transformer)
    try:
        loss = q21.FAMILY.loss(pipe.transformer, batch, noise, sigma)
    finally:
        hook.remove()
    (step_call, step_output) = calls[0]
    torch.testing.assert_close(step_call["hidden_states"], call["hidden_states"], rtol=0, atol=1e-6)
    assert step_call["img_shapes"] == call["img_shapes"] and torch.equal(step_call["img_mask"], call["img_mask"])
    pred = output[:, -h * w :]
    torch.testing.assert_close(step_output[:, -h * w :], pred, rtol=0, atol=1e-5)
    velocity = q21.packed(noise - x0)[0]
    assert loss.item() == pytest.approx(((pred - velocity) ** 2).mean().item(), rel=1e-5)


def test_tiny_cli_is_deterministic_and_the_check_tells_the_families_apart(tiny21_path: Path, tmp_path: Path) -> None:
    from qie.checks import compose
    from qie.components.check import read_facts
    from qie.models import model_spec
    from qie.tiny import main

    main(["qwen_image_21", str(tmp_path / "a")])
    for part in ("transformer", "vae", "text_encoder"):
        for file in (tiny21_path / part).glob("*.safetensors"):
            assert file.read_bytes() == (tmp_path / "a" / part / file.name).read_bytes()
    facts = read_facts(str(tiny21_path))
    assert model_spec(typed(compose("infer", ["model=tiny_qwen_image_21"]).model)).mismatches(facts) == []
    problems = model_spec(typed(compose("infer", ["model=tiny_plus"]).model)).mismatches(facts)
    # Another pipeline is named as such, alone: its transformer's details would only confuse.
    assert len(problems) == 1 and "the checkpoint is a QwenImage21Pipeline" in problems[0]


def test_every_model_yaml_samples_with_its_pipelines_defaults() -> None:
    """The `predict` group defaults to the model's CFG scale and step count: each yaml's are its pipeline's."""
    import inspect

    from qie.checks import compose
    from qie.config.tree import conf_dir
    from qie.models import model_spec

    names = [p.name[:-5] for p in conf_dir().joinpath("model").iterdir() if p.name.endswith(".yaml")]
    assert "qwen_image_21" in names
    for name in names:
        cfg = compose("infer", [f"model={name}"])
        params = inspect.signature(model_spec(typed(cfg.model)).pipeline_cls().__call__).parameters
        assert cfg.predict.true_cfg_scale == params["true_cfg_scale"].default, name
        assert cfg.predict.num_inference_steps == params["num_inference_steps"].default, name
