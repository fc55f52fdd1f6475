"""Qwen-Image-2.1 through qie's stages (tiny model, CPU, fp32): inference equals `QwenImage21Pipeline` for 0, 1
and 3 references of mixed sizes, the cache holds what the pipeline computes and recomputes exactly what a
change touches, resume with fp8, batching. (Cached == live training and the LoRA in the pipeline are cases of
tests/test_family_battery.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import QwenImage21Pipeline
from PIL import Image
from stage_edges import hasher_for, key_context_for, parts_of, predictor_for, sizes_for, source_for

from qie.cache.entries import STORED_TYPES
from qie.cache.ssd import SsdBackend
from qie.checks import compose
from qie.config import typed
from qie.data.collate import collate
from qie.data.keys import sample_keys
from qie.data.scan import scan_dataset
from qie.embedding.encode import prepare_sample
from qie.models import model_spec
from qie.models.processor import Qwen3VLProcessorNoVideo, load_processor
from qie.stages import infer as infer_stage
from qie.stages import precompute
from qie.stages import train as train_stage
from qie.stages.settings import sampling_options
from qie.stages.validation import validation_inputs, validation_samples
from qie.training.validation import Validator

MODEL = "model=tiny_qwen_image_21"
RES = 64  # the tiny model's condition area is 64², its text-to-image size 64x64
# What precompute stores of the prompts: the mask types are derived from the embeddings, never written.
TEXT = ["prompt_embed", "empty_prompt_embed"]
REFERENCE_DEPENDENT = ["control_latent", *TEXT]
TRAINING = ["train.max_steps=4", "train.learning_rate=1e-3", "data.batch_size=2", "train.seed=7"]


def write_rgba(path: Path, seed: int, size: tuple[int, int] = (64, 64), opaque: bool = False) -> Path:
    """A random RGBA png (width, height); a random alpha channel unless `opaque`."""
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 4), dtype=np.uint8)
    if opaque:
        pixels[..., 3] = 255
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels, "RGBA").save(path)
    return path


def make_dataset(root: Path) -> Path:
    """A manifest of text-to-image samples and edit samples with one and three references, RGBA targets."""
    rows = []
    for i, refs in enumerate([0, 0, 0, 0, 1, 1, 3, 3]):
        target = write_rgba(root / "targets" / f"t{i}.png", i)
        controls = [write_rgba(root / "refs" / f"r{i}_{k}.png", 100 * i + k, opaque=k == 1) for k in range(refs)]
        rows.append(
            {
                "id": f"s{i}",
                "target": str(target.relative_to(root)),
                "controls": [str(c.relative_to(root)) for c in controls],
                "prompt": f"A red cat number {i}." if refs == 0 else f"Put the cat of picture 1 on a mat, {i}.",
            }
        )
    manifest = root / "data.jsonl"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return manifest


@pytest.fixture(scope="module")
def pipe(tiny21_path: Path) -> QwenImage21Pipeline:
    pipe = QwenImage21Pipeline.from_pretrained(
        tiny21_path, processor=load_processor(tiny21_path, processor_class=Qwen3VLProcessorNoVideo)
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def data(tiny21_path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The data set and a cache filled for it."""
    root = tmp_path_factory.mktemp("q21_data")
    manifest = make_dataset(root)
    base = [MODEL, "data=manifest", f"data.path={manifest}", f"cache.dir={root / 'cache'}", "data.num_workers=0"]
    summary = precompute.run(compose("precompute", base[:4]), root / "precompute_run")
    return {"root": root, "manifest": manifest, "base": base, "summary": summary}


# ---------------------------------------------------------------- inference


@pytest.mark.parametrize("count", [0, 1, 3])
def test_infer_matches_pipeline(pipe: QwenImage21Pipeline, tmp_path: Path, count: int) -> None:
    """Text to image, one and three references (mixed sizes, RGBA and RGB), with true CFG and a negative prompt."""
    images = [write_rgba(tmp_path / f"ref{i}.png", i, (48 + 16 * i, 80), opaque=i == 1) for i in range(count)]
    predict = ["predict.negative_prompt=blurry", "predict.true_cfg_scale=3.0", "predict.seed=5"]
    cfg = compose("infer", [MODEL, *predict])
    mine = predictor_for(cfg).predict(images, "A red cat.", sampling_options(cfg.predict), output_type="np")
    pil = [Image.open(p) for p in images]
    generator = torch.Generator().manual_seed(5)
    expected = pipe("A red cat.", image=pil or None, negative_prompt="blurry", true_cfg_scale=3.0,
                    output_resolution=RES, generator=generator, output_type="np").images  # fmt: skip
    assert mine.shape == expected.shape and mine.shape[-1] == 4
    assert np.abs(mine - expected).max() <= 1e-5


# ---------------------------------------------------------------- cache


def test_cache_holds_the_pipeline_values_and_the_rgba_target_keeps_its_alpha(data: dict, pipe) -> None:
    cfg = compose("precompute", data["base"][:4])
    samples = {s.id: s for s in scan_dataset(data["manifest"]).samples}
    source = source_for(cfg, mode="cached")
    (three,) = source.get([samples["s6"]])
    assert len(three.control_latents) == 3 and three.prompt_image_mask.sum() == 3 * 4  # 4 slots per 64² image
    # qie reads the target with its alpha channel, exactly...
    image = Image.open(samples["s6"].target)
    target = prepare_sample(samples["s6"], sizes_for(cfg)).target
    alpha = torch.from_numpy(np.asarray(image)[..., 3].astype(np.float32))
    assert target.shape == (4, RES, RES) and torch.equal(target[3], alpha / 127.5 - 1)
    # ...and the VAE encoded all four channels: equal to encoding the RGBA pixels, not the opaque ones.
    rgba = pipe.image_processor.preprocess(image, RES, RES).unsqueeze(2)
    assert rgba.shape[1] == 4 and not torch.all(rgba[:, 3] == 1)
    # (precompute encodes the targets in one VAE batch: equal up to the batch's float rounding)
    torch.testing.assert_close(three.pixel_latent, pipe._encode_vae_image(rgba, None)[0], rtol=0, atol=1e-6)
    opaque = rgba.clone()
    opaque[:, 3] = 1
    assert (three.pixel_latent - pipe._encode_vae_image(opaque, None)[0]).abs().max() > 1e-2
    # The prompt embedding and its image-pad mask are the pipeline's.
    refs = [pipe.image_processor.resize(Image.open(p).convert("RGBA"), RES, RES) for p in samples["s6"].controls]
    embeds, _, image_mask = pipe.encode_prompt(samples["s6"].prompt, image=refs)
    torch.testing.assert_close(three.prompt_embed, embeds[0], rtol=0, atol=0)
    assert torch.equal(three.prompt_image_mask, image_mask[0])


def test_changing_a_reference_or_the_order_recomputes_exactly_the_dependent_entries(tmp_path: Path) -> None:
    manifest = make_dataset(tmp_path / "ds")
    base = [MODEL, "data=manifest", f"data.path={manifest}", f"cache.dir={tmp_path / 'cache'}"]
    runs = iter(range(100))

    def run() -> dict[str, int]:
        summary = precompute.run(compose("precompute", base), tmp_path / f"run{next(runs)}")
        assert summary.failures == []
        return {t: s.new for t, s in summary.types.items() if s.new}

    first = run()
    assert first["pixel_latent"] == 8 and first["control_latent"] == 4 and first["prompt_embed"] == 8
    assert run() == {}
    write_rgba(tmp_path / "ds" / "refs" / "r6_2.png", 999)  # the third reference of one sample
    assert run() == dict.fromkeys(REFERENCE_DEPENDENT, 1)
    rows = [json.loads(line) for line in manifest.read_text().splitlines()]
    rows[7]["controls"] = rows[7]["controls"][::-1]  # the same references in another order
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    assert run() == dict.fromkeys(REFERENCE_DEPENDENT, 1)
    samples = scan_dataset(manifest).samples
    cfg = compose("precompute", base)
    keys = [sample_keys(s, key_context_for(cfg), hasher_for(cfg)) for s in samples]
    backend = SsdBackend(tmp_path / "cache")
    assert all(backend.exists(t, k[t]) for k in keys for t in k if t in STORED_TYPES)


# ---------------------------------------------------------------- training


def test_resume_with_fp8_and_gradient_checkpointing_continues_exactly(data: dict, tmp_path: Path) -> None:
    extra = TRAINING + ["model.quantize=fp8", "train.gradient_checkpointing=true", "train.checkpoint_every=2"]
    full = train_stage.run(compose("train", data["base"] + extra), tmp_path / "full")
    half = [o if not o.startswith("train.max_steps") else "train.max_steps=2" for o in extra]
    train_stage.run(compose("train", data["base"] + half), tmp_path / "resumed")
    resumed = train_stage.run(compose("train", data["base"] + extra + ["train.resume=latest"]), tmp_path / "resumed")
    assert np.isfinite(full["losses"]).all()
    np.testing.assert_allclose(resumed["losses"], full["losses"][2:], rtol=1e-6, atol=0)


def test_batch_of_equal_prompt_lengths_equals_single_samples(data: dict, pipe) -> None:
    """Padding moves the target's rotary position (the transformer places it after the padded prompt), so a
    batch equals its samples one by one only for prompts of one length; other batches differ slightly."""
    from qie.models.qwen_image_21 import FAMILY

    cfg = compose("train", data["base"])
    samples = {s.id: s for s in scan_dataset(data["manifest"]).samples}
    source = source_for(cfg, mode="cached")
    items = source.get([samples[i] for i in ("s0", "s1", "s2")])  # prompts "A red cat number i.": one length
    assert items[0].prompt_embed.shape == items[1].prompt_embed.shape
    noise = torch.randn(2, *items[0].pixel_latent.shape, generator=torch.Generator().manual_seed(0))
    sigmas = torch.tensor([0.3, 0.6])

    def per_sample(pair) -> list[float]:
        batch = collate(pair)
        with torch.no_grad():
            joint = [FAMILY.loss(pipe.transformer, batch, noise, sigmas, "none").item()]
            alone = [FAMILY.loss(pipe.transformer, collate([s]), noise[i : i + 1], sigmas[i : i + 1]).item()
                     for i, s in enumerate(pair)]  # fmt: skip
        return joint + [sum(alone) / 2]

    joint, alone = per_sample(items[:2])
    assert joint == pytest.approx(alone, rel=1e-6)
    shorter = items[2]
    shorter.prompt_pieces = (shorter.prompt_embed[:-1],)
    shorter.prompt_image_mask = shorter.prompt_image_mask[:-1]
    joint, alone = per_sample([items[0], shorter])
    assert joint != alone and joint == pytest.approx(alone, rel=1e-3)


def test_validation_samples_the_cached_inputs_as_the_pipeline_does(data: dict, pipe) -> None:
    """Validation during training (defaults: no CFG, the checkpoint's sigmas) from cached inputs."""
    cfg = compose("train", data["base"] + ["predict.seed=4"])
    sample = next(s for s in scan_dataset(data["manifest"]).samples if s.id == "s6")  # three references
    chosen = validation_samples(cfg.validation, [sample], 1)
    inputs, negatives = validation_inputs(source_for(cfg, mode="cached"), chosen, "")
    parts = parts_of(cfg.model, ["vae", "transformer", "scheduler"])
    options = sampling_options(cfg.predict)
    validator = Validator(inputs, negatives, parts.scheduler, parts.vae, None, options, model_spec(typed(cfg.model)),
                          pipeline_config=parts.pipeline_config)  # fmt: skip
    (image,) = validator.images(parts.transformer)
    refs = [Image.open(p) for p in sample.controls]
    expected = pipe(sample.prompt, image=refs, output_resolution=RES, generator=torch.Generator().manual_seed(4)).images
    assert image.mode == expected[0].mode == "RGBA"
    assert np.abs(np.asarray(image, dtype=int) - np.asarray(expected[0], dtype=int)).max() <= 1  # uint8 rounding


def test_infer_cli_writes_an_rgba_png(tmp_path: Path) -> None:
    refs = [str(write_rgba(tmp_path / f"r{i}.png", i, (64 * (i + 1), 32 * (i + 1)))) for i in range(2)]
    cfg = compose("infer", [MODEL, "predict.prompt=A red cat.", f"predict.images=[{','.join(refs)}]"])
    (path,) = infer_stage.run(cfg, tmp_path / "run")
    with Image.open(path) as out:
        assert out.mode == "RGBA" and out.size == (96, 32)  # calculate_dimensions(64², 2:1), from the last reference


# ---------------------------------------------------------------- a folder qie did not build


def test_a_qwen_image_21_folder_qie_did_not_build(data: dict, pipe: QwenImage21Pipeline, tmp_path: Path) -> None:
    """A QwenImage21Pipeline of other sizes than qie's tiny preset (one wider block, another VAE, a one-layer
    Qwen3-VL), built and saved by diffusers and transformers alone: the same stages, equal to the pipeline."""
    from diffusers import AutoencoderKLQwenImage21, FlowMatchEulerDiscreteScheduler, QwenImage21Transformer2DModel
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    tokenizer = pipe.processor.tokenizer
    ids = tokenizer.convert_tokens_to_ids(["<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"])
    text = Qwen3VLConfig(
        text_config={"vocab_size": len(tokenizer), "hidden_size": 24, "intermediate_size": 40, "num_hidden_layers": 1,
                     "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 12, "pad_token_id":
                     tokenizer.pad_token_id, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6,
                     "mrope_section": [2, 2, 2], "mrope_interleaved": True}},
        vision_config={"depth": 1, "hidden_size": 16, "intermediate_size": 24, "num_heads": 2, "out_hidden_size": 24,
                       "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
                       "num_position_embeddings": 64, "deepstack_visual_indexes": [0]},
        image_token_id=ids[0], video_token_id=ids[1], vision_start_token_id=ids[2], vision_end_token_id=ids[3],
    )  # fmt: skip
    torch.manual_seed(21)
    foreign = QwenImage21Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler.from_config(pipe.scheduler.config),
        vae=AutoencoderKLQwenImage21(base_dim=8, decoder_base_dim=8, z_dim=64, dim_mult=[1, 1, 2, 2, 2],
                                     num_res_blocks=1, temperal_downsample=[False, True, True, True], in_channels=4,
                                     out_channels=4),
        text_encoder=Qwen3VLForConditionalGeneration(text).eval(),
        processor=pipe.processor,
        transformer=QwenImage21Transformer2DModel(patch_size=1, in_channels=64, out_channels=64, num_layers=1,
                                                  attention_head_dim=16, num_attention_heads=3, context_in_dim=24,
                                                  mlp_ratio=2, axes_dims_rope=(8, 4, 4), causal_condition=True),
    )  # fmt: skip
    folder = tmp_path / "foreign"
    foreign.save_pretrained(folder)
    model = ["model=qwen_image_21", f"model.pretrained_model_name_or_path={folder}", "model.dtype=float32",
             f"model.vae_image_pixels={RES * RES}", f"model.vl_image_pixels={RES * RES}"]  # fmt: skip
    image = write_rgba(tmp_path / "ref.png", 3, (64, 64))
    cfg = compose("infer", [*model, "predict.negative_prompt=blurry", "predict.true_cfg_scale=3.0", "predict.seed=5"])
    mine = predictor_for(cfg).predict([image], "A red cat.", sampling_options(cfg.predict), output_type="np")
    reloaded = QwenImage21Pipeline.from_pretrained(
        folder, processor=load_processor(folder, processor_class=Qwen3VLProcessorNoVideo)
    )
    reloaded.set_progress_bar_config(disable=True)
    expected = reloaded(
        "A red cat.",
        image=[Image.open(image)],
        negative_prompt="blurry",
        true_cfg_scale=3.0,
        output_resolution=RES,
        generator=torch.Generator().manual_seed(5),
        output_type="np",
    ).images
    assert np.abs(mine - expected).max() <= 1e-5  # fmt: skip
    base = [*model, "data=manifest", f"data.path={data['manifest']}", f"cache.dir={tmp_path / 'cache'}",
            "data.num_workers=0"]  # fmt: skip
    summary = precompute.run(compose("precompute", base[:-1]), tmp_path / "pre")
    assert summary.types["prompt_embed"].new == 8
    short = ["train.max_steps=2", "logging.report_to=none", "train.seed=3"]
    cached = train_stage.run(compose("train", base + short), tmp_path / "cached")
    live = train_stage.run(compose("train", base + short + ["cache=none"]), tmp_path / "live")
    np.testing.assert_allclose(live["losses"], cached["losses"], rtol=0, atol=1e-6)
