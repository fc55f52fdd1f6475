"""Text-to-image Qwen-Image (model=tiny_t2i): a data set without control images, a cache without control
entries, validation, and inference equal to diffusers' QwenImagePipeline (also for a folder qie did not build).
(Cached == live training and the LoRA in diffusers are cases of tests/test_family_battery.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import QwenImagePipeline
from helpers import write_noise_image
from PIL import Image
from stage_edges import encoder_for, hasher_for, key_context_for, predictor_for, source_for
from transformers import Qwen2Tokenizer

from qie.checks import compose
from qie.components.tiny import system_prefix
from qie.config import typed
from qie.data.keys import sample_keys
from qie.data.scan import scan_dataset
from qie.errors import ConfigError
from qie.models import model_spec
from qie.stages import infer, precompute
from qie.stages import train as train_stage

PROMPTS = ["a red circle on a blue ground", "a green square", "two yellow stripes", "a white cat"]
NEGATIVE = "blurry and dark"
TRAINING = ["train.max_steps=4", "train.learning_rate=1e-3", "data.batch_size=2", "train.seed=7"]
SAMPLING = ["predict.num_inference_steps=2", "predict.true_cfg_scale=4.0", f"predict.negative_prompt={NEGATIVE}"]


def t2i_folder(root: Path) -> Path:
    """training_images/ only: two 64x64 targets and two wide ones (two buckets of two)."""
    for i, prompt in enumerate(PROMPTS):
        write_noise_image(root / "training_images" / f"s{i}.png", i, (64 if i < 2 else 128, 64))
        (root / "training_images" / f"s{i}.txt").write_text(prompt, encoding="utf-8")
    return root


def _pipeline(path: Path) -> QwenImagePipeline:
    pipe = QwenImagePipeline.from_pretrained(path)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _reference(pipe: QwenImagePipeline, prompt: str, seed: int, output_type: str = "np", **kw):
    kw = {"negative_prompt": NEGATIVE, "true_cfg_scale": 4.0, **kw}
    out = pipe(prompt=prompt, num_inference_steps=2, generator=torch.Generator().manual_seed(seed),
               output_type=output_type, **kw)  # fmt: skip
    return out.images


@pytest.fixture(scope="module")
def data(tiny_t2i_path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("t2i")
    folder = t2i_folder(root / "data")
    base = ["model=tiny_t2i", f"data.path={folder}", f"cache.dir={root / 'cache'}", "data.num_workers=0"]
    summary = precompute.run(compose("precompute", base[:3]), root / "precompute")
    return {"root": root, "base": base, "summary": summary, "tiny": tiny_t2i_path}


def train(data: dict, overrides: list[str], run_dir: Path) -> dict:
    return train_stage.run(compose("train", data["base"] + overrides), run_dir)


@pytest.fixture(scope="module")
def cached_run(data: dict, tmp_path_factory: pytest.TempPathFactory) -> dict:
    run_dir = tmp_path_factory.mktemp("t2i_cached")
    validation = ["validation.every=4", "validation.num_inference_steps=2", "logging.log_images_count=2"]
    return {"dir": run_dir, "result": train(data, TRAINING + validation, run_dir)}


def test_the_tiny_model_is_a_text_to_image_pipeline(tiny_t2i_path: Path) -> None:
    index = json.loads((tiny_t2i_path / "model_index.json").read_text())
    assert index["_class_name"] == "QwenImagePipeline" and "processor" not in index
    assert not (tiny_t2i_path / "processor").exists()
    tokenizer = Qwen2Tokenizer.from_pretrained(tiny_t2i_path / "tokenizer")
    prefix, drop_idx = system_prefix(QwenImagePipeline)
    assert drop_idx == 34 and len(tokenizer(prefix)["input_ids"]) == 34
    pipe = _pipeline(tiny_t2i_path)
    spec = model_spec(typed(compose("infer", ["model=tiny_t2i"]).model))
    assert (
        spec.family.default_size(spec, pipe.vae_scale_factor) == (pipe.default_sample_size * pipe.vae_scale_factor,) * 2
    )


def test_the_encoder_builds_no_processor_and_encodes_as_the_pipeline(data: dict) -> None:
    encoder = encoder_for(compose("precompute", ["model=tiny_t2i"]))
    assert sorted(encoder.parts.built()) == ["text_encoder", "tokenizer", "vae"]
    pipe = _pipeline(data["tiny"])
    with torch.no_grad():
        expected = [pipe.encode_prompt(p, device=torch.device("cpu"))[0][0] for p in PROMPTS]
    for got, want in zip(encoder.encode_prompts(PROMPTS, [[]] * len(PROMPTS)), expected):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="text-to-image and takes none"):
        encoder.encode_prompts(["x"], [[Image.new("RGB", (64, 64))]])


def test_precompute_writes_no_control_entries(data: dict) -> None:
    types = data["summary"].types
    assert (types["pixel_latent"].new, types["prompt_embed"].new) == (4, 4)
    assert "prompt_embeds_mask" not in types  # masks are derived from the embeddings, never stored
    # Without control images every sample's empty prompt is the same text: stored once.
    assert (types["empty_prompt_embed"].new, types["empty_prompt_embed"].skipped) == (1, 3)
    assert (types["control_latent"].new, types["control_latent"].skipped, types["control_latent"].failed) == (0, 0, 0)
    cache = data["root"] / "cache"
    assert not list((cache / "control_latent").rglob("*.safetensors"))
    assert len(list((cache / "pixel_latent").rglob("*.safetensors"))) == 4
    # The stored prompt embeddings are the pipeline's (encoded in one batch: equal up to padding's rounding).
    cfg = compose("train", data["base"])
    samples = scan_dataset(cfg.data.path).samples
    assert all(s.controls == () for s in samples)
    source = source_for(cfg, mode="cached")
    pipe = _pipeline(data["tiny"])
    for sample, item in zip(samples, source.get(samples)):
        with torch.no_grad():
            want = pipe.encode_prompt(sample.prompt, device=torch.device("cpu"))[0][0]
        assert item.control_latents == ()
        torch.testing.assert_close(item.prompt_embed, want, atol=1e-5, rtol=0)
        assert "control_latent" not in sample_keys(sample, key_context_for(cfg), hasher_for(cfg))


def test_validation_samples_at_the_targets_size(cached_run: dict) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(cached_run["dir"] / "tensorboard"), size_guidance={"images": 0})
    events.Reload()
    (image,) = events.Images("validation")
    assert (image.step, image.width, image.height) == (4, 2 * 64, 64)  # s0 and s1, 64x64 targets


def test_infer_run_equals_the_pipeline_with_cfg_and_a_negative_prompt(data: dict, tmp_path: Path) -> None:
    overrides = ["model=tiny_t2i", *SAMPLING, f"predict.prompt={PROMPTS[1]}", "predict.seed=3",
                 "predict.height=64", "predict.width=96", "predict.output=t2i.png"]  # fmt: skip
    (written,) = infer.run(compose("infer", overrides), tmp_path)
    pipe = _pipeline(data["tiny"])
    (ref,) = _reference(pipe, PROMPTS[1], 3, output_type="pil", height=64, width=96)
    assert np.array_equal(np.asarray(Image.open(written)), np.asarray(ref))
    mine = predictor_for(compose("infer", overrides)).predict(
        [], PROMPTS[1], negative_prompt=NEGATIVE, true_cfg_scale=4.0, num_inference_steps=2, seed=3,
        height=64, width=96, output_type="np",
    )  # fmt: skip
    assert mine.shape == (1, 64, 96, 3)
    assert np.abs(mine - _reference(pipe, PROMPTS[1], 3, height=64, width=96)).max() <= 1e-5
    other_negative = _reference(pipe, PROMPTS[1], 3, height=64, width=96, negative_prompt="")
    assert np.abs(mine - other_negative).max() > 1e-3  # the negative prompt is used
    image = write_noise_image(tmp_path / "in.png", 9, (64, 64))
    with pytest.raises(ConfigError, match="text-to-image and takes none"):
        infer.run(compose("infer", [*overrides, f"predict.image={image}"]), tmp_path)


def test_a_folder_qie_did_not_build_runs_through_the_same_stages(data: dict, foreign_parts, tmp_path: Path) -> None:
    """A QwenImagePipeline of other sizes than qie's tiny preset, built and saved by diffusers alone."""
    tokenizer = Qwen2Tokenizer.from_pretrained(data["tiny"] / "tokenizer")
    folder = tmp_path / "foreign"
    QwenImagePipeline(tokenizer=tokenizer, **foreign_parts(tokenizer)).save_pretrained(folder)
    model = ["model=tiny_t2i", "model.tiny=null", f"model.pretrained_model_name_or_path={folder}"]
    mine = predictor_for(compose("infer", model)).predict(
        None, PROMPTS[2], negative_prompt=NEGATIVE, true_cfg_scale=4.0, num_inference_steps=2, seed=5,
        height=64, width=64, output_type="np",
    )  # fmt: skip
    assert np.abs(mine - _reference(_pipeline(folder), PROMPTS[2], 5, height=64, width=64)).max() <= 1e-5
    base = [*model, f"data.path={data['root'] / 'data'}", f"cache.dir={tmp_path / 'cache'}", "data.num_workers=0"]
    summary = precompute.run(compose("precompute", base[:5]), tmp_path / "pre")
    assert summary.types["prompt_embed"].new == 4 and summary.types["control_latent"].new == 0
    short = ["train.max_steps=2", "data.batch_size=2", "logging.report_to=none"]
    cached = train_stage.run(compose("train", base + short), tmp_path / "cached")
    live = train_stage.run(compose("train", base + short + ["cache=none"]), tmp_path / "live")
    np.testing.assert_allclose(live["losses"], cached["losses"], rtol=0, atol=1e-6)
