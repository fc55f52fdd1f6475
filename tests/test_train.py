"""The train stage in-process on the tiny model: source modes, logging, checkpoints, resume, fp8, LoRA export."""

from __future__ import annotations

import io
import json
import math
import shutil
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import AutoencoderKLQwenImage, QwenImageEditPipeline
from helpers import CachedData, count_constructions, small_config, small_overrides, tiny_pipeline
from PIL import Image
from safetensors.torch import load_file
from stage_edges import source_for
from transformers import Qwen2_5_VLForConditionalGeneration

from qie.data.buckets import BucketBatchSampler
from qie.data.scan import scan_dataset
from qie.errors import CacheMissError
from qie.stages import precompute
from qie.stages import train as train_stage

# Shared by every run compared here: what decides the losses.
TRAINING = ["train.max_steps=4", "train.learning_rate=1e-3", "data.batch_size=2", "train.seed=7"]
# The tiny model's losses under TRAINING on `cached_data`, the same in cached, live and lazy mode; and its
# first two with model.quantize=fp8 and gradient checkpointing. They move when the tiny model, the
# synthetic data, the encoders, the noise draws or the step change. When such a change is meant, take the
# new values from the failing assertion's message (it prints the losses the run gave):
#   python -m pytest tests/test_train.py -k "pinned or fp8"
LOSSES = [1.3846794366836548, 1.4264967441558838, 1.5395618677139282, 1.4196131229400635]
FP8_LOSSES = [1.3248077630996704, 1.3579487800598145]
ENCODERS = {"text_encoder": Qwen2_5_VLForConditionalGeneration, "vae": AutoencoderKLQwenImage}


def train(data: CachedData, overrides: list[str], run_dir: Path) -> dict:
    return train_stage.run(small_config("train", *data.overrides, *overrides), run_dir)


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def cached_run(cached_data: CachedData, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One cached run with image logging, TensorBoard, checkpoints and the ComfyUI export, counting encoders."""
    run_dir = tmp_path_factory.mktemp("cached_run")
    logging = ["logging.report_to=tensorboard", "logging.log_images=true", "logging.log_images_every=2"]
    logging.append("logging.log_images_count=3")
    with pytest.MonkeyPatch.context() as mp:
        counts = count_constructions(mp, ENCODERS)
        overrides = (
            TRAINING + logging + ["train.checkpoint_every=2", "train.export_comfyui=true", "train.export_kohya=true"]
        )
        result = train(cached_data, overrides, run_dir)
        during_run = Counter(counts)
        source_for(small_config("train", *cached_data.overrides), "live")  # the counters do see an encoder
        when_live = Counter(counts)
    return {"dir": run_dir, "result": result, "counts": during_run, "counts_live": when_live}


def test_cached_mode_builds_no_text_encoder_and_no_vae(cached_run: dict) -> None:
    assert cached_run["counts"] == Counter()
    assert cached_run["counts_live"]["text_encoder"] >= 1 and cached_run["counts_live"]["vae"] >= 1


def test_pinned_first_losses(cached_run: dict) -> None:
    losses = cached_run["result"]["losses"]
    assert losses == pytest.approx(LOSSES, rel=1e-6), f"losses: {losses}"


@pytest.mark.parametrize("mode", ["live", "lazy"])
def test_live_and_lazy_give_the_cached_losses(
    cached_data: CachedData, cached_run: dict, tmp_path: Path, mode: str
) -> None:
    overrides = ["cache=none"] if mode == "live" else ["cache.mode=lazy", f"cache.dir={tmp_path / 'empty_cache'}"]
    result = train(cached_data, TRAINING + overrides, tmp_path / "run")
    expected = cached_run["result"]["losses"]
    assert len(result["losses"]) == len(expected) == 4
    np.testing.assert_allclose(result["losses"], expected, rtol=0, atol=1e-6)
    assert result["losses"] == pytest.approx(LOSSES, rel=1e-6), f"losses: {result['losses']}"
    if mode == "lazy":  # it wrote what it encoded
        assert len(list((tmp_path / "empty_cache" / "prompt_embed").rglob("*.safetensors"))) == 8


def test_metrics_and_tensorboard_hold_the_scalars_and_image_grids(cached_run: dict) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rows = metrics(cached_run["dir"])
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(set(r) == {"step", "loss", "lr", "grad_norm", "seconds", "memory/max_rss_gib"} for r in rows)
    assert all(math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0 for r in rows)
    events = EventAccumulator(str(cached_run["dir"] / "tensorboard"), size_guidance={"images": 0})
    events.Reload()
    tags = events.Tags()
    for name in ("loss", "lr", "grad_norm", "seconds"):
        assert [e.value for e in events.Scalars(f"train/{name}")] == pytest.approx([r[name] for r in rows])
    assert any(t.startswith("memory/") for t in tags["scalars"])
    images = events.Images("images/control_and_target")
    assert [i.step for i in images] == [2, 4]
    grid = np.asarray(Image.open(io.BytesIO(images[-1].encoded_image_string)).convert("RGB"))
    # 3 recent samples, one row each: control then target, scaled to 128 px high; none left blank.
    assert grid.shape == (3 * 128, 2 * 128, 3)
    assert all(
        (grid[r * 128 : (r + 1) * 128, c * 128 : (c + 1) * 128] != 255).any() for r in range(3) for c in range(2)
    )


def test_checkpoints_hold_the_lora_and_the_full_state(cached_run: dict) -> None:
    folders = sorted(p.name for p in (cached_run["dir"] / "checkpoints").iterdir())
    assert folders == ["step-000002", "step-000004"]
    last = cached_run["dir"] / "checkpoints" / "step-000004"
    assert json.loads((last / "trainer_state.json").read_text())["step"] == 4
    state = ["model.safetensors", "optimizer.safetensors", "optimizer.json", "lr_scheduler.json",
             "lr_scheduler.safetensors", "rng_state_0.json", "rng_state_0.safetensors"]  # fmt: skip
    files = ("pytorch_lora_weights.safetensors", "comfyui_lora.safetensors", "kohya_lora.safetensors")
    for name in (*files, *(f"state/{n}" for n in state)):
        assert (last / name).is_file(), name
    assert not [p for p in last.rglob("*") if p.suffix not in (".safetensors", ".json", "")]  # no pickles
    final = load_file(cached_run["dir"] / "lora" / "pytorch_lora_weights.safetensors")
    assert final.keys() == load_file(last / "pytorch_lora_weights.safetensors").keys()
    assert all(k.startswith("transformer.") for k in final)
    comfy = load_file(last / "comfyui_lora.safetensors")
    assert any(k.startswith("diffusion_model.") and k.endswith(".lora_down.weight") for k in comfy)
    kohya = load_file(cached_run["dir"] / "lora" / "kohya_lora.safetensors")
    assert len(kohya) == len(comfy) and all(k.startswith("lora_unet_transformer_blocks_") for k in kohya)


# The pipeline resizes conditions to 1024² whatever their size; 64² keeps the tiny VAE fast.
@pytest.mark.usefixtures("small_conditions")
def test_saved_lora_loads_into_the_diffusers_pipeline_and_changes_its_output(
    cached_run: dict, cached_data: CachedData, tiny_path: Path
) -> None:
    pipe = tiny_pipeline(QwenImageEditPipeline, tiny_path)
    image = Image.open(next((cached_data.data / "control_images").iterdir()))

    def edit() -> np.ndarray:
        out = pipe(image=image, prompt="make the circle red", num_inference_steps=2, height=64, width=64,
                   true_cfg_scale=1.0, generator=torch.Generator().manual_seed(0), output_type="np")  # fmt: skip
        return out.images[0]

    before = edit()
    lora = cached_run["dir"] / "lora"
    pipe.load_lora_weights(lora, weight_name="pytorch_lora_weights.safetensors")
    saved = load_file(lora / "pytorch_lora_weights.safetensors")
    loaded = {k: v for k, v in pipe.transformer.state_dict().items() if "lora_" in k}
    assert len(loaded) == len(saved)
    for key, value in saved.items():  # transformer.<module>.lora_A.weight -> <module>.lora_A.default_0.weight
        module, _, kind = key.removeprefix("transformer.").rpartition(".lora_")
        match = [v for k, v in loaded.items() if k.startswith(f"{module}.lora_{kind[0]}.")]
        assert len(match) == 1 and torch.equal(match[0], value), key
    assert np.abs(edit() - before).max() > 1e-6


def test_resume_continues_exactly_like_an_uninterrupted_run(cached_data: CachedData, tmp_path: Path) -> None:
    # Warmup makes the LR differ per step, dropout draws from the restored RNG, accumulation spans batches.
    overrides = [
        "train.max_steps=6", "train.checkpoint_every=3", "train.gradient_accumulation_steps=2",
        "train.lr_scheduler.num_warmup_steps=5", "train.lora.dropout=0.1", "data.caption_dropout_rate=0.3",
        "train.learning_rate=1e-3", "data.batch_size=2",
    ]  # fmt: skip
    train(cached_data, overrides, tmp_path / "whole")
    resumed = train(cached_data, overrides + [f"train.resume={tmp_path / 'whole' / 'checkpoints' / 'step-000003'}"],
                    tmp_path / "resumed")  # fmt: skip
    assert resumed["step"] == 6 and len(resumed["losses"]) == 3
    expected = [r for r in metrics(tmp_path / "whole") if r["step"] > 3]
    got = metrics(tmp_path / "resumed")
    assert [r["step"] for r in got] == [4, 5, 6]
    for a, b in zip(got, expected):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-6) and a["lr"] == pytest.approx(b["lr"], rel=1e-9)
    assert len({r["lr"] for r in got}) > 1  # the schedule was still warming up
    a = load_file(tmp_path / "whole" / "lora" / "pytorch_lora_weights.safetensors")
    b = load_file(tmp_path / "resumed" / "lora" / "pytorch_lora_weights.safetensors")
    assert all(torch.allclose(a[k], b[k], rtol=0, atol=1e-7) for k in a)


def test_fp8_with_gradient_checkpointing_trains(cached_data: CachedData, tmp_path: Path) -> None:
    overrides = ["model.quantize=fp8", "train.gradient_checkpointing=true", "train.max_steps=2"]
    result = train(cached_data, overrides + ["train.learning_rate=1e-3"], tmp_path)
    assert all(math.isfinite(x) for x in result["losses"])
    assert result["losses"] == pytest.approx(FP8_LOSSES, rel=1e-6), f"losses: {result['losses']}"
    lora = load_file(tmp_path / "lora" / "pytorch_lora_weights.safetensors")
    b_weights = [v for k, v in lora.items() if "lora_B" in k]
    assert b_weights and all(v.abs().sum() > 0 for v in b_weights)  # B starts at zero: every one moved


def test_a_cache_miss_in_a_loader_worker_names_the_sample(cached_data: CachedData, tmp_path: Path) -> None:
    samples = scan_dataset(cached_data.data).samples
    sampler = BucketBatchSampler([0] * len(samples), [1] * len(samples), 1, seed=7)
    first = samples[next(iter(sampler))[1][0]]
    gone = next(s for s in samples if s.id != first.id)
    partial = tmp_path / "partial"  # the data set without `gone`, to fill a cache that lacks it
    shutil.copytree(cached_data.data, partial)
    for f in partial.rglob(f"{gone.id}.*"):
        f.unlink()
    cache = f"cache.dir={tmp_path / 'cache'}"
    precompute.run(small_config("precompute", f"data.path={partial}", cache), tmp_path / "pre")
    with pytest.raises(CacheMissError) as err:
        train(cached_data, ["train.max_steps=8", "train.seed=7", cache, "data.num_workers=1"], tmp_path / "run")
    message = str(err.value)
    assert repr(gone.id) in message and "python -m qie.precompute" in message and str(partial) not in message
    assert "Traceback" not in message and "worker" not in message


def test_multirun_gives_each_job_its_own_run_directory(cached_data: CachedData, tmp_path: Path, monkeypatch) -> None:
    from qie import train as cli

    sweep = tmp_path / "sweep"
    overrides = ["train.learning_rate=1e-4,3e-4", "train.max_steps=1", f"hydra.sweep.dir={sweep}"]
    argv = ["qie.train", "-m", *small_overrides("train", *cached_data.overrides, *overrides)]
    monkeypatch.setattr(sys, "argv", argv)
    cli.main()
    lrs = {job.name: metrics(job)[0]["lr"] for job in sweep.iterdir() if (job / "metrics.jsonl").exists()}
    assert lrs == {"0": pytest.approx(1e-4), "1": pytest.approx(3e-4)}
    # Each job's report, its command the job's own overrides; the sweep's report beside its summary.
    assert (sweep / "sweep_report.html").is_file() and (sweep / "1" / "report.html").is_file()
    command = json.loads((sweep / "1" / "run_info.json").read_text())["command"]
    assert command.startswith("python -m qie.train model=tiny ") and command.endswith(" train.learning_rate=0.0003")
    assert " train.max_steps=1 " in command and "0.0001" not in command and "hydra.sweep.dir" not in command


def test_full_mode_trains_every_weight_but_the_dead_ones(
    cached_data: CachedData, tiny_path: Path, tmp_path: Path
) -> None:
    from safetensors.torch import load_file as load

    result = train(cached_data, ["train=full", "train.max_steps=2"], tmp_path)
    before = load(tiny_path / "transformer" / "diffusion_pytorch_model.safetensors")
    after = load(Path(result["transformer"]) / "diffusion_pytorch_model.safetensors")
    assert before.keys() == after.keys()
    frozen = {k for k in before if torch.equal(before[k], after[k])}
    last = "transformer_blocks.1."  # the tiny model's last block: its text stream never reaches the loss
    assert frozen and all(k.startswith(last) for k in frozen)
    assert f"{last}txt_mlp.net.2.weight" in frozen and "img_in.weight" not in frozen


def test_validation_samples_with_the_cached_inputs_and_builds_only_the_vae(
    cached_data: CachedData, tmp_path: Path
) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    overrides = ["train.max_steps=2", "validation.every=2", "validation.num_inference_steps=2"]
    with pytest.MonkeyPatch.context() as mp:
        counts = count_constructions(mp, ENCODERS)
        train(cached_data, overrides + ["logging.log_images_count=2", "logging.report_to=tensorboard"], tmp_path)
    assert counts == Counter({"vae": 1})  # the decoder's VAE; inputs came from the cache
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"images": 0})
    events.Reload()
    (image,) = events.Images("validation")
    assert image.step == 2 and image.width == 2 * 64  # two validation samples side by side
    # Edit-aware metrics, plotted: the first two training samples keep their targets for them.
    (row,) = [json.loads(line) for line in (tmp_path / "validation" / "metrics.jsonl").read_text().splitlines()]
    first = [s.id for s in scan_dataset(cached_data.data).samples[:2]]
    assert row["step"] == 2 and sorted(row["samples"]) == first
    for name in ("psnr_keep", "ssim_keep", "psnr_edit", "ssim_edit"):
        (scalar,) = events.Scalars(f"validation/{name}")
        assert scalar.step == 2 and scalar.value == pytest.approx(row["mean"][name], rel=1e-6)
        assert all(math.isfinite(m[name]) for m in row["samples"].values())
    assert all(0 < m["edit_fraction"] < 1 for m in row["samples"].values())


def test_validation_images_are_saved_under_the_run_without_a_tracker(cached_data: CachedData, tmp_path: Path) -> None:
    overrides = ["train.max_steps=4", "validation.every=2", "validation.num_inference_steps=2"]
    train(cached_data, overrides + ["logging.log_images_count=2", "logging.report_to=none"], tmp_path)
    first = [s.id for s in scan_dataset(cached_data.data).samples[:2]]
    for step in (2, 4):
        folder = tmp_path / "validation" / f"step-{step:06d}"
        assert sorted(p.name for p in folder.iterdir()) == [f"{i}.png" for i in first]
        assert Image.open(folder / f"{first[0]}.png").size == (64, 64)
    steps = [json.loads(line)["step"] for line in (tmp_path / "validation" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [2, 4] and not (tmp_path / "tensorboard").exists()
    # Beside the images, what each was sampled from (what an export's model card shows with it).
    inputs = json.loads((tmp_path / "validation" / "inputs.json").read_text())
    samples = scan_dataset(cached_data.data).samples[:2]
    expected = {s.id: {"prompt": s.prompt, "control": str(s.controls[0]), "target": str(s.target)} for s in samples}
    assert inputs == expected


def test_the_collector_pause_of_a_start_up_leaves_it_as_it_was(cached_data: CachedData, tmp_path: Path) -> None:
    """A train start-up pauses the garbage collector while its data is read and checked (on again inside for
    captions a model writes) and freezes what it made; the collector is on and nothing frozen once the run is
    over, or once its start failed."""
    import gc

    from qie.stages.train import collecting

    gc.disable()
    with collecting():
        assert gc.isenabled()
    assert not gc.isenabled()
    gc.enable()
    seen: list[tuple[bool, int]] = []
    train(cached_data, ["train.max_steps=1"], tmp_path / "run")
    assert gc.isenabled() and gc.get_freeze_count() == 0
    real = train_stage.split_heldout

    def record(*args, **kwargs):  # inside the start-up's data part
        seen.append((gc.isenabled(), gc.get_freeze_count()))
        return real(*args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(train_stage, "split_heldout", record)
        train(cached_data, ["train.max_steps=1"], tmp_path / "run2")
        assert seen == [(False, 0)] and gc.isenabled() and gc.get_freeze_count() == 0
        with pytest.raises(CacheMissError):
            train(cached_data, ["train.max_steps=1", f"cache.dir={tmp_path / 'empty'}"], tmp_path / "run3")
    assert gc.isenabled() and gc.get_freeze_count() == 0
