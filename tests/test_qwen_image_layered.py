"""Qwen-Image-Layered: inference against `QwenImageLayeredPipeline` itself (tiny model, CPU, fp32, the 640
bucket the pipeline asserts), its training loss against the pipeline's packing, and its config rules."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import QwenImageLayeredPipeline
from helpers import tiny_pipeline
from PIL import Image

from qie.models import qwen_image_layered as layered
from qie.types import Batch

PROMPT = "a red square over a blue circle"
SAMPLING = dict(negative_prompt="blurry", true_cfg_scale=2.5, num_inference_steps=2, seed=3)


def rgba(seed: int, height: int, width: int) -> Image.Image:
    """A random image with a random alpha channel."""
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 4), dtype=np.uint8)
    return Image.fromarray(pixels, "RGBA")


def test_infer_writes_the_pipelines_layers(tiny_layered_path: Path, tmp_path: Path) -> None:
    """`qie.infer ... predict.layers=2 predict.output=DIR` writes DIR/layer_0.png, layer_1.png: RGBA, in the
    pipeline's order, equal to `QwenImageLayeredPipeline` (same seed, steps, CFG and negative prompt); a
    non-square input keeps its aspect (the pipeline's 640-bucket size, 704x576)."""
    from stage_edges import predictor_for

    from qie.checks import compose
    from qie.stages import infer

    image = tmp_path / "in.png"
    rgba(0, 60, 50).save(image)
    overrides = [f"predict.{k}={v}" for k, v in SAMPLING.items()]
    cfg_overrides = ["model=tiny_qwen_image_layered", "predict.layers=2", *overrides]
    single = [f"predict.image={image}", f"predict.prompt={PROMPT}", "predict.output=layers"]
    cfg = compose("infer", [*cfg_overrides, *single])
    written = infer.run(cfg, tmp_path)
    assert written == [tmp_path / "layers" / "layer_0.png", tmp_path / "layers" / "layer_1.png"]
    mine = np.stack([np.asarray(Image.open(p)) for p in written])
    assert mine.shape == (2, 704, 576, 4)

    pipe = tiny_pipeline(QwenImageLayeredPipeline, tiny_layered_path)
    kwargs = {k: v for k, v in SAMPLING.items() if k != "seed"}
    out = pipe(Image.open(image), PROMPT, layers=2, resolution=640, output_type="np",
               generator=torch.Generator().manual_seed(SAMPLING["seed"]), **kwargs).images[0]  # fmt: skip
    assert out.shape == (2, 704, 576, 4)
    assert np.abs(mine.astype(int) - np.rint(out * 255).astype(int)).max() <= 1  # PNG rounding

    predictor = predictor_for(cfg)
    direct = predictor.predict([Image.open(image)], PROMPT, output_type="np", layers=2, **SAMPLING)
    assert np.abs(direct - out).max() <= 1e-5
    # output_type="latent": the frames before decoding (the composite, then the layers), which decode to the same.
    latents = predictor.predict([Image.open(image)], PROMPT, output_type="latent", layers=2, **SAMPLING)
    assert latents.shape[:3] == (1, 8, 3)
    assert np.array_equal(predictor.spec.family.decode(predictor.parts.vae, latents, output_type="np"), direct)

    # Batch mode: each row's layers in <output_dir>/<id>/.
    (tmp_path / "rows.jsonl").write_text(f'{{"id": "r", "controls": ["in.png"], "prompt": "{PROMPT}"}}\n')
    batch = infer.run(compose("infer", [*cfg_overrides, f"predict.input={tmp_path / 'rows.jsonl'}"]), tmp_path)
    assert batch == [tmp_path / "predictions" / "r" / f"layer_{i}.png" for i in range(2)]
    assert np.array_equal(np.stack([np.asarray(Image.open(p)) for p in batch]), mine)


def test_loss_packs_every_frame_and_the_condition_as_the_pipeline(tiny_layered_path: Path) -> None:
    """The loss runs the transformer on the pipeline's sequence (output frames, then the condition, with their
    `img_shapes` and `additional_t_cond`=0) and regresses the frames' tokens onto noise - x0."""
    from diffusers import QwenImageTransformer2DModel

    transformer = QwenImageTransformer2DModel.from_pretrained(tiny_layered_path / "transformer")
    g = torch.Generator().manual_seed(0)
    x0, noise = torch.randn(1, 8, 3, 4, 6, generator=g), torch.randn(1, 8, 3, 4, 6, generator=g)
    control = torch.randn(1, 8, 1, 4, 6, generator=g)
    embeds = torch.randn(1, 5, 16, generator=g)
    sigma = torch.tensor([0.4])
    batch = Batch(ids=["a"], latents=x0, control_latents=[control], prompt_embeds=embeds, prompt_embeds_mask=None)
    loss = layered.FAMILY.loss(transformer, batch, noise, sigma)

    pack = QwenImageLayeredPipeline._pack_latents
    tokens = pack(((1 - 0.4) * x0 + 0.4 * noise).permute(0, 2, 1, 3, 4), 1, 8, 4, 6, 3)
    cond = pack(control.permute(0, 2, 1, 3, 4), 1, 8, 4, 6, 1)
    pred = transformer(hidden_states=torch.cat([tokens, cond], 1), timestep=sigma, encoder_hidden_states=embeds,
                       img_shapes=[[(1, 2, 3)] * 4], additional_t_cond=torch.zeros(1, dtype=torch.long),
                       return_dict=False)[0][:, : tokens.shape[1]]  # fmt: skip
    target = pack((noise - x0).permute(0, 2, 1, 3, 4), 1, 8, 4, 6, 3)
    assert torch.equal(loss, ((pred - target) ** 2).mean())


def test_a_lora_trained_on_the_layered_loss_loads_in_the_pipeline_and_gives_qies_output(
    tiny_layered_path: Path, tmp_path: Path
) -> None:
    """A LoRA trained a few steps on the layered loss and written by qie loads with the Layered pipeline's
    `load_lora_weights`, and the pipeline's output then equals qie's inference with `predict.lora`."""
    from diffusers import QwenImageTransformer2DModel
    from stage_edges import predictor_for

    from qie.adapters.lora import add_lora, save_lora
    from qie.checks import compose
    from qie.config.model import ModelConfig

    torch.manual_seed(0)
    transformer = QwenImageTransformer2DModel.from_pretrained(tiny_layered_path / "transformer")
    params = add_lora(transformer, 4, 8, ModelConfig().lora_target_modules)
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    g = torch.Generator().manual_seed(1)
    x0, control = torch.randn(1, 8, 3, 4, 4, generator=g), torch.randn(1, 8, 1, 4, 4, generator=g)
    batch = Batch(
        ids=["a"],
        latents=x0,
        control_latents=[control],
        prompt_embeds=torch.randn(1, 5, 16, generator=g),
        prompt_embeds_mask=None,
    )
    for _ in range(3):
        loss = layered.FAMILY.loss(transformer, batch, torch.randn(x0.shape, generator=g), torch.tensor([0.6]))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    lora = save_lora(transformer, tmp_path / "lora")

    image = rgba(1, 40, 40)
    pipe = tiny_pipeline(QwenImageLayeredPipeline, tiny_layered_path)
    kwargs = {k: v for k, v in SAMPLING.items() if k != "seed"}

    def pipeline_output() -> np.ndarray:
        generator = torch.Generator().manual_seed(SAMPLING["seed"])
        return pipe(image, PROMPT, layers=1, resolution=640, output_type="np", generator=generator, **kwargs).images[0]

    base = pipeline_output()
    pipe.load_lora_weights(str(lora.parent), weight_name=lora.name)
    with_lora = pipeline_output()
    assert np.abs(with_lora - base).max() > 1e-4  # the LoRA moves the output
    predictor = predictor_for(compose("infer", ["model=tiny_qwen_image_layered", f"predict.lora={lora}"]))
    mine = predictor.predict([image], PROMPT, output_type="np", layers=1, **SAMPLING)
    assert mine.shape == with_lora.shape == (1, 640, 640, 4)
    assert np.abs(mine - with_lora).max() <= 1e-5


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("model.vae_image_pixels=4096", "resolution buckets only"),
        ("model.max_control_images=2", "splits one input image"),
    ],
)
def test_config_outside_the_pipelines_rules_is_refused(override: str, message: str) -> None:
    from qie.checks import compose
    from qie.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        compose("infer", ["model=tiny_qwen_image_layered", override])


def test_layers_on_a_model_without_layers_is_refused() -> None:
    """Refused when the config is composed (`qie.checks.validate`), before the stage builds anything."""
    from qie.checks import compose
    from qie.errors import ConfigError

    with pytest.raises(ConfigError, match="makes one image, not layers"):
        compose("infer", ["model=tiny_t2i", "predict.prompt=x", "predict.layers=2"])


def write_layered_data(root: Path, count: int = 2) -> Path:
    """A manifest of layered rows (image, layers, prompt): RGBA images 48x40 with two or three layers each."""
    import json

    root.mkdir(parents=True, exist_ok=True)
    rows = []
    for n in range(count):
        rgba(10 * n, 48, 40).save(root / f"in_{n}.png")
        layers = []
        for k in range(2 + n % 2):
            rgba(10 * n + k + 1, 48, 40).save(root / f"in_{n}_layer{k}.png")
            layers.append(f"in_{n}_layer{k}.png")
        rows.append({"image": f"in_{n}.png", "layers": layers, "prompt": f"shapes {n}"})
    (root / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root / "data.jsonl"


def test_layered_manifest_rows_are_image_control_and_composite_then_layers(tmp_path: Path) -> None:
    from qie.data.scan import scan_dataset

    manifest = write_layered_data(tmp_path)
    (sample, other) = scan_dataset(manifest).samples
    assert sample.controls == (tmp_path / "in_0.png",) and sample.target == tmp_path / "in_0.png"
    assert sample.layers == (tmp_path / "in_0_layer0.png", tmp_path / "in_0_layer1.png")
    assert len(other.layers) == 3
    manifest.write_text('{"image": "in_0.png", "layers": ["gone.png"], "prompt": "x"}\n' + manifest.read_text())
    problems = scan_dataset(manifest).problems
    assert len(problems) == 1 and "gone.png" in problems[0].reason


def test_samples_with_other_layer_counts_are_batched_apart(tmp_path: Path) -> None:
    """Frames of one size but another count cannot share a batch: the layer count is part of the bucket key."""
    from qie.data.buckets import BucketBatchSampler, bucket_keys, describe_key
    from qie.data.scan import scan_dataset

    samples = scan_dataset(write_layered_data(tmp_path, count=4)).samples  # 2, 3, 2, 3 layers
    keys = bucket_keys(samples, 409600, 409600, 32)
    assert keys[0] == keys[2] == ((576, 704, 3), (576, 704)) and keys[1] == keys[3] == ((576, 704, 4), (576, 704))
    assert describe_key(keys[1]) == "576x704 (4 frames)+576x704"
    sampler = BucketBatchSampler(keys, [1] * 4, 2, 0, True, 1, 0)
    batches = [batch for _, (_, batch) in zip(range(8), sampler)]
    assert sorted({len(samples[i].layers) for i in batch} == {2} for batch in batches) == [False] * 4 + [True] * 4
    assert all(len(batch) == 2 and len({len(samples[i].layers) for i in batch}) == 1 for batch in batches)


def test_a_layered_folder_gives_the_same_samples_layers_in_number_order(tmp_path: Path) -> None:
    from qie.data.formats import detect_format
    from qie.data.scan import scan_dataset

    (tmp_path / "images").mkdir()
    (tmp_path / "layers").mkdir()
    rgba(0, 8, 8).save(tmp_path / "images" / "a.png")
    (tmp_path / "images" / "a.txt").write_text("two shapes\n")
    for n in (10, *range(10)):  # numbered 0 to 10: sorted by number (text would put 10 after 1)
        rgba(n + 1, 8, 8).save(tmp_path / "layers" / f"a_{n}.png")
    rgba(5, 8, 8).save(tmp_path / "images" / "lonely.png")
    (tmp_path / "images" / "lonely.txt").write_text("no layers")
    data = scan_dataset(tmp_path)
    (sample,) = data.samples
    assert (sample.id, sample.target, sample.controls, sample.prompt) == (
        "a",
        tmp_path / "images" / "a.png",
        (tmp_path / "images" / "a.png",),
        "two shapes",
    )
    assert sample.layers == tuple(tmp_path / "layers" / f"a_{n}.png" for n in range(11))
    assert [(p.id, p.reason) for p in data.problems] == [("lonely", "its layers are missing")]
    assert detect_format(tmp_path) == "folder"  # data.format=auto: images/ and layers/ are the folder layout


def test_a_hugging_face_data_set_names_its_layers_column(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    from qie.data.formats import Columns, DataSource, read_dataset

    def png(seed: int) -> bytes:
        rgba(seed, 8, 8).save(tmp_path / "x.png")
        return (tmp_path / "x.png").read_bytes()

    layers = [png(1), png(2), png(3)]
    features = datasets.Features({"image": datasets.Image(), "layers": datasets.List(datasets.Image()),
                                  "prompt": datasets.Value("string")})  # fmt: skip
    rows = {"image": [png(0), png(4)], "layers": [layers, []], "prompt": ["three shapes", "none"]}
    datasets.Dataset.from_dict(rows, features=features).save_to_disk(str(tmp_path / "ds"))
    columns = Columns(target="image", controls=("image",), prompt="prompt", layers="layers")
    data = read_dataset(
        DataSource(path=str(tmp_path / "ds"), format="hf", columns=columns, images_dir=tmp_path / "img")
    )
    (sample,) = data.samples
    assert sample.target == sample.controls[0] and sample.target.read_bytes() == rows["image"][0]
    assert [p.read_bytes() for p in sample.layers] == layers
    assert [p.reason for p in data.problems] == ["row 1 has no layers in column 'layers'"]


def test_cached_training_equals_live_and_one_changed_layer_recomputes_only_the_layers(
    tiny_layered_path: Path, tmp_path: Path
) -> None:
    """Precompute stores the input's latent, the layers' latents and the prompts; training from the cache and
    live gives the same losses; changing one layer recomputes only the layer entry of its sample."""
    from helpers import small_config

    from qie.stages import precompute, train

    manifest = write_layered_data(tmp_path / "data")
    base = ["model=tiny_qwen_image_layered", f"data.path={manifest}", f"cache.dir={tmp_path / 'cache'}",
            "data.target_pixels=409600", "data.batch_size=1"]  # fmt: skip
    summary = precompute.run(small_config("precompute", *base), tmp_path / "pre")
    assert summary.failures == []
    assert {t: s.new for t, s in summary.types.items() if s.new} == {
        "pixel_latent": 2, "control_latent": 2, "layer_latent": 2, "prompt_embed": 2, "empty_prompt_embed": 2,
    }  # fmt: skip
    cached = train.run(small_config("train", *base, "train.seed=7"), tmp_path / "cached")
    live = train.run(small_config("train", *base, "train.seed=7", "cache.mode=live"), tmp_path / "live")
    assert len(cached["losses"]) == 2 and all(np.isfinite(cached["losses"]))
    np.testing.assert_allclose(live["losses"], cached["losses"], rtol=1e-6, atol=0)

    rgba(99, 48, 40).save(tmp_path / "data" / "in_1_layer2.png")
    again = precompute.run(small_config("precompute", *base), tmp_path / "pre2")
    assert {t: s.new for t, s in again.types.items() if s.new} == {"layer_latent": 1}


def test_a_layered_folder_qie_did_not_build(tiny_layered_path: Path, tmp_path: Path) -> None:
    """A Layered folder whose VAE (8x, 16 latent channels) and transformer have sizes qie does not ship, saved by
    diffusers' own classes: precompute, cached training, and inference with the trained LoRA equal to the
    pipeline after `load_lora_weights`."""
    import shutil

    from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel
    from helpers import small_config

    from qie.stages import infer, precompute, train

    folder = tmp_path / "model"
    shutil.copytree(tiny_layered_path, folder)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(5)
        vae = AutoencoderKLQwenImage(
            base_dim=4,
            z_dim=16,
            dim_mult=[1, 1, 1, 1],
            num_res_blocks=1,
            temperal_downsample=[False] * 3,
            input_channels=4,
            latents_mean=[0.05 * i for i in range(16)],
            latents_std=[1.2] * 16,
        )
        transformer = QwenImageTransformer2DModel(patch_size=2, in_channels=64, out_channels=16, num_layers=1,
                                                  attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16,
                                                  axes_dims_rope=(2, 2, 4), use_layer3d_rope=True,
                                                  use_additional_t_cond=True)  # fmt: skip
    for name, part in (("vae", vae), ("transformer", transformer)):
        shutil.rmtree(folder / name)
        part.save_pretrained(folder / name)

    manifest = write_layered_data(tmp_path / "data", count=1)
    base = ["model=qwen_image_layered", f"model.pretrained_model_name_or_path={folder}", "model.dtype=float32",
            f"data.path={manifest}", f"cache.dir={tmp_path / 'cache'}", "data.target_pixels=409600"]  # fmt: skip
    assert precompute.run(small_config("precompute", *base), tmp_path / "pre").failures == []
    run = train.run(small_config("train", *base, "train.learning_rate=1e-2"), tmp_path / "train")
    assert len(run["losses"]) == 2 and all(np.isfinite(run["losses"]))
    lora = Path(run["lora"])

    image = tmp_path / "data" / "in_0.png"
    overrides = [f"predict.{k}={v}" for k, v in SAMPLING.items()]
    cfg = small_config("infer", *base[:3], f"predict.image={image}", f"predict.prompt={PROMPT}", "predict.layers=1",
                       "predict.output=out", f"predict.lora={lora}", *overrides)  # fmt: skip
    (written,) = infer.run(cfg, tmp_path)
    pipe = tiny_pipeline(QwenImageLayeredPipeline, folder)
    pipe.load_lora_weights(str(lora.parent), weight_name=lora.name)
    kwargs = {k: v for k, v in SAMPLING.items() if k != "seed"}
    out = pipe(Image.open(image), PROMPT, layers=1, resolution=640, output_type="np",
               generator=torch.Generator().manual_seed(SAMPLING["seed"]), **kwargs).images[0]  # fmt: skip
    assert out.shape == (1, 704, 576, 4)
    mine = np.asarray(Image.open(written))[None]
    assert np.abs(mine.astype(int) - np.rint(out * 255).astype(int)).max() <= 1  # PNG rounding


def test_samples_without_layers_are_refused_for_a_layered_model_and_layers_for_others(
    tiny_layered_path: Path, tmp_path: Path
) -> None:
    import json

    from helpers import small_config

    from qie.errors import DataError
    from qie.stages import precompute, train

    rgba(0, 8, 8).save(tmp_path / "a.png")
    plain = tmp_path / "plain.jsonl"
    plain.write_text(json.dumps({"target": "a.png", "controls": ["a.png"], "prompt": "x"}) + "\n")
    base = ["model=tiny_qwen_image_layered", f"data.path={plain}", f"cache.dir={tmp_path / 'cache'}"]
    with pytest.raises(DataError, match="^none of the 1 samples could be encoded .*no layers, but model "
                       "'tiny_qwen_image_layered' learns to split an image into layers"):  # fmt: skip
        precompute.run(small_config("precompute", *base), tmp_path / "pre")
    with pytest.raises(DataError, match="no layers"):
        train.run(small_config("train", *base), tmp_path / "train")
    layered = write_layered_data(tmp_path / "data", count=1)
    with pytest.raises(DataError, match="2 layers, but model 'tiny' makes one image"):
        train.run(small_config("train", f"data.path={layered}", f"cache.dir={tmp_path / 'cache'}"), tmp_path / "t2")
