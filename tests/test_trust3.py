"""Trust, third round: prompts longer than the transformer's text positions are refused in one line naming the
sample (precompute records them, training skips them, the loss and inference refuse them); one repair run leaves a
cache that verifies; NaN base weights are named, not written as a black image; masks are read and checked at start;
precompute that encodes nothing fails; a signal stop exits 128 + the signal; symbolic links are followed before the
outside-path check; the run lock covers inference; odd values end in one line; every cache read is checked; an
unreadable image with auto_caption is skipped; gc guards each type; layer numbers without gaps."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch
from helpers import CachedData, cached_set, held_run_lock, small_config, write_noise_image

from qie.cache.ssd import SsdBackend
from qie.checks import compose
from qie.models import text_positions
from qie.models.text_positions import PromptTooLong
from qie.stages import precompute
from qie.stages import train as train_stage
from qie.stages.cache_admin import run as cache_cli

FAST = ["train.learning_rate=1e-3", "logging.report_to=none", "train.seed=3"]
# ~5,000 tokens of the tiny tokenizer, well under the 20,000-character cap.
LONG = " ".join(f"{c}{d}" for c in "qwertyuiop" for d in "zxcvbnm") * 40


@pytest.fixture(scope="module")
def data(tiny_path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    return cached_set(tiny_path, tmp_path_factory.mktemp("trust3_data"), train=4)


@pytest.fixture
def copy(cached_data: CachedData, tmp_path: Path) -> CachedData:
    """A private copy of the shared cached data set (its cache may be changed)."""
    shutil.copytree(cached_data.root, tmp_path / "cached", symlinks=True)
    root = tmp_path / "cached"
    return CachedData(root, root / "train", root / "cache")


def copy_data(data: dict, tmp_path: Path) -> tuple[Path, list[str]]:
    """A private copy of the data set (no cache yet), and the base overrides pointing at it."""
    root = tmp_path / "data"
    shutil.copytree(data["root"] / "train", root / "train")
    base = [data["base"][0], f"data.path={root / 'train'}", f"cache.dir={root / 'cache'}", "data.num_workers=0"]
    return root, base


# --- 1: long prompts ------------------------------------------------------------------------------------


def test_the_text_position_limit_is_the_rope_table_less_the_images() -> None:
    assert text_positions.qwen_image([(1, 4, 4)]) == 4096 - 2
    assert text_positions.qwen_image([(1, 64, 64), (1, 32, 96)]) == 4096 - 48
    assert text_positions.qwen_image([(1, 4, 4)] * 6, layered=True) == 4096 - 5
    assert text_positions.qwen_image_21([(1, 64, 64), (1, 32, 48)]) == 8192 - 64 - 48


def test_a_long_caption_is_refused_by_precompute_skipped_by_training_refused_by_infer(
    data: dict, tmp_path: Path, capsys
) -> None:
    root, base = copy_data(data, tmp_path)
    captions = sorted((root / "train" / "training_images").glob("*.txt"))
    long_id = captions[0].stem
    captions[0].write_text(LONG)
    summary = precompute.run(compose("precompute", base[:3]), tmp_path / "pre")
    assert summary.types["prompt_embed"].failed == 1 and summary.types["prompt_embed"].new == 3
    (failure,) = summary.failures
    assert failure.id == long_id
    assert failure.reason.startswith(f"sample {long_id!r}: its prompt is ")
    assert "tokens, more than the 4,094 text positions the transformer has beside its images" in failure.reason
    assert failure.reason.endswith("at this size: shorten it")
    capsys.readouterr()
    result = train_stage.run(compose("train", base + FAST + ["train.max_steps=2"]), tmp_path / "run")
    assert result["step"] == 2 and all(torch.isfinite(torch.tensor(result["losses"])))
    out = capsys.readouterr().out
    assert f"qie: warning: skipping sample {long_id!r}: precompute could not encode it: sample {long_id!r}: its " \
           "prompt is " in out  # fmt: skip


def test_a_long_prompt_reaching_the_transformer_is_refused_naming_the_sample(tiny_path: Path) -> None:
    from diffusers import QwenImageTransformer2DModel

    from qie.models.qwen_image import FAMILY
    from qie.types import Batch

    transformer = QwenImageTransformer2DModel.from_pretrained(tiny_path, subfolder="transformer")
    dim = transformer.config.joint_attention_dim
    latents = torch.zeros(2, transformer.config.in_channels // 4, 1, 8, 8)
    embeds = torch.zeros(2, 4095, dim)
    mask = torch.ones(2, 4095, dtype=torch.long)
    mask[0, 10:] = 0
    batch = Batch(
        ids=["short", "long"],
        latents=latents,
        control_latents=[latents.clone()],
        prompt_embeds=embeds,
        prompt_embeds_mask=mask,
    )
    with pytest.raises(PromptTooLong) as info:
        FAMILY.loss(transformer, batch, torch.zeros_like(latents), torch.full((2,), 0.5))
    assert str(info.value) == (
        "sample 'long': its prompt (caption) is 4,095 tokens, more than the 4,094 text positions the transformer "
        "has beside its images at this size: shorten it (and run precompute again for a cached sample)"
    )
    batch = Batch(
        ids=["short", "long"],
        latents=latents,
        control_latents=[latents.clone()],
        prompt_embeds=embeds[:, :4094],
        prompt_embeds_mask=None,
    )
    assert torch.isfinite(FAMILY.loss(transformer, batch, torch.zeros_like(latents), torch.full((2,), 0.5)))


def test_infer_refuses_a_prompt_longer_than_the_text_positions(tiny_path: Path, tmp_path: Path) -> None:
    from stage_edges import predictor_for

    image = write_noise_image(tmp_path / "in.png", 1, (64, 64))
    predictor = predictor_for(small_config("infer", "model=tiny", "predict.true_cfg_scale=1.0"))
    with pytest.raises(PromptTooLong, match=r"^predict.prompt: the prompt is [\d,]+ tokens, more than the 4,094 "
                                            r"text positions .* at this size: shorten it$"):  # fmt: skip
        predictor.predict([image], LONG)
    latents = predictor.predict([image], "Make the sky blue.", output_type="latent", num_inference_steps=2)
    assert latents.isfinite().all()


# --- 2: repair in one pass ------------------------------------------------------------------------------


def test_repair_of_an_empty_prompt_entry_rewrites_the_prompts_cut_against_it(copy: CachedData, tiny_path: Path,
                                                                          capsys) -> None:  # fmt: skip
    victim = sorted((copy.cache / "empty_prompt_embed").rglob("*.safetensors"))[0]
    data = bytearray(victim.read_bytes())
    data[-5] ^= 0xFF
    victim.write_bytes(bytes(data))
    backend = SsdBackend(copy.cache)
    assert len(backend.verify().corrupt) == 1
    base = ["model=tiny", f"model.pretrained_model_name_or_path={tiny_path}", *copy.overrides, "cache.repair=true"]
    summary = precompute.run(compose("precompute", base), copy.root / "r1")
    assert {t: (s.new, s.skipped) for t, s in summary.types.items()} == {
        "pixel_latent": (0, 8), "control_latent": (0, 8), "empty_prompt_embed": (1, 7), "prompt_embed": (1, 7),
    }  # fmt: skip
    assert backend.verify().corrupt == []
    capsys.readouterr()
    assert cache_cli(compose("cache", [f"cache.dir={copy.cache}", "action=verify"])) == 0
    # A second run finds nothing to do.
    summary = precompute.run(compose("precompute", base), copy.root / "r2")
    assert sum(s.new for s in summary.types.values()) == 0


# --- 3: NaN base weights --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def nan_transformer(tiny_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny transformer as one file, one weight of its first block NaN."""
    import safetensors.torch

    (weights,) = (tiny_path / "transformer").glob("*.safetensors")
    tensors = safetensors.torch.load_file(str(weights))
    tensors["transformer_blocks.0.attn.to_q.weight"][0, 0] = float("nan")
    path = tmp_path_factory.mktemp("nan") / "transformer.safetensors"
    safetensors.torch.save_file(tensors, str(path))
    return path


def test_nan_base_weights_are_named_by_infer_and_training(data: dict, nan_transformer: Path, tmp_path: Path) -> None:
    from stage_edges import predictor_for

    from qie.errors import ModelLoadError
    from qie.runtime.guards import NonFiniteLoss

    image = write_noise_image(tmp_path / "in.png", 1, (64, 64))
    cfg = small_config("infer", "model=tiny", "predict.true_cfg_scale=1.0", f"model.transformer_path={nan_transformer}")
    predictor = predictor_for(cfg)
    with pytest.raises(ModelLoadError) as info:
        predictor.predict([image], "Make the sky blue.", num_inference_steps=2)
    assert str(info.value) == (
        "the sampled latents hold NaN or infinite values: the transformer's weights hold NaN or infinite values "
        "(transformer_blocks.0.attn.to_q.weight): its weight files are damaged; load it from intact files "
        "(model.pretrained_model_name_or_path, model.transformer_path)"
    )
    # A damaged VAE: refused before it decodes (a NaN image would be written as black).
    predictor.parts.transformer.transformer_blocks[0].attn.to_q.weight.data[0, 0] = 0.0
    predictor.parts.vae.decoder.conv_out.bias.data[0] = float("inf")
    vae = r"^the decoded image would hold NaN or infinite values: the vae's weights hold NaN or infinite values "
    with pytest.raises(ModelLoadError, match=vae + r"\(decoder.conv_out.bias\)"):
        predictor.predict([image], "Make the sky blue.", num_inference_steps=2)
    cfg = compose("train", data["base"] + FAST + ["train.max_steps=2", f"model.transformer_path={nan_transformer}"])
    with pytest.raises(NonFiniteLoss) as info:
        train_stage.run(cfg, tmp_path / "run")
    message = str(info.value)
    assert message.startswith("step 1 gave a NaN or infinite loss or gradient on samples ")
    assert message.endswith(": the base model's weights hold NaN or infinite values (transformer_blocks.0.attn."
                            "to_q.base_layer.weight): its weight files are damaged; load it from "
                            "intact files (model.pretrained_model_name_or_path, model.transformer_path)")  # fmt: skip
    assert "learning rate" not in message and "\n" not in message


# --- 4, 5, 9: masks checked at start ---------------------------------------------------------------------


def test_masks_are_read_at_start_and_those_that_cannot_train_are_skipped(data: dict, tmp_path: Path,
                                                                         capsys) -> None:  # fmt: skip
    from PIL import Image

    from qie.data.samples import DataError

    root, base = copy_data(data, tmp_path)
    shutil.copytree(data["root"] / "cache", root / "cache")
    masks = root / "train" / "masks"
    masks.mkdir()
    ids = sorted(p.stem for p in (root / "train" / "training_images").glob("*.png"))
    (masks / f"{ids[0]}.png").write_bytes(b"not a png")
    Image.new("L", (64, 64), 0).save(masks / f"{ids[1]}.png")
    Image.new("L", (17, 90), 255).save(masks / f"{ids[2]}.png")
    Image.new("L", (32, 32), 255).save(masks / f"{ids[3]}.png")  # half the size, the same shape: scaled
    on = ["train.mask.source=file", "train.max_steps=3"]
    capsys.readouterr()
    result = train_stage.run(compose("train", base + FAST + on), tmp_path / "run")
    assert result["step"] == 3 and all(loss > 0 for loss in result["losses"])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("qie: skipping")]
    assert lines[0].startswith(f"qie: skipping sample {ids[0]!r}: {masks / ids[0]}.png: mask '{masks / ids[0]}.png' "
                               "cannot be read (")  # fmt: skip
    assert lines[1:] == [
        f"qie: skipping sample {ids[1]!r}: {masks / ids[1]}.png: its loss mask is black all over, so with "
        "train.mask.outside_weight=0 it would train nothing: paint white what should train",
        f"qie: skipping sample {ids[2]!r}: {masks / ids[2]}.png: mask '{masks / ids[2]}.png' is 17x90, its target "
        "64x64: a mask must have its target's shape (at any scale)",
    ]
    # Black masks weigh train.mask.outside_weight: above 0 they train.
    for i in (0, 2, 3):
        Image.new("L", (64, 64), 0).save(masks / f"{ids[i]}.png")
    with pytest.raises(DataError) as info:
        train_stage.run(compose("train", base + FAST + on), tmp_path / "black")
    assert str(info.value) == (
        f"no sample has a loss mask that can train; the first, {ids[0]!r}: its loss mask is black all over, so "
        "with train.mask.outside_weight=0 it would train nothing: paint white what should train"
    )
    result = train_stage.run(compose("train", base + FAST + on + ["train.mask.outside_weight=0.5"]), tmp_path / "r")
    assert result["step"] == 3 and all(loss > 0 for loss in result["losses"])


# --- 10: precompute fails when nothing could be encoded -----------------------------------------------------


def test_precompute_that_encodes_no_sample_fails_after_writing_its_report(data: dict, tmp_path: Path) -> None:
    from qie.errors import DataError

    root, base = copy_data(data, tmp_path)
    targets = sorted((root / "train" / "training_images").glob("*.png"))
    for png in targets:
        png.write_bytes(b"broken " + png.name.encode())  # distinct bytes: distinct keys
    run = tmp_path / "pre"
    with pytest.raises(DataError) as info:
        precompute.run(compose("precompute", base[:3]), run)
    message = str(info.value)
    assert message.startswith(f"none of the 4 samples could be encoded (all listed in {run / 'failures.jsonl'}); "
                              f"the first, {targets[0].stem!r}: ")  # fmt: skip
    assert len((run / "failures.jsonl").read_text().splitlines()) == 4 and (run / "precompute_summary.json").exists()
    # One good sample is enough for the run to succeed.
    shutil.copy(data["root"] / "train" / "training_images" / targets[0].name, targets[0])
    summary = precompute.run(compose("precompute", base[:3]), tmp_path / "pre2")
    assert summary.types["pixel_latent"].new == 1 and len(summary.failures) == 3


# --- 12: exit codes after a signal ------------------------------------------------------------------------


def test_a_signal_stop_saves_the_state_and_exits_128_plus_the_signal(data: dict, tmp_path: Path, monkeypatch) -> None:
    import json
    import os
    import signal
    import sys

    from qie import train as train_entry
    from qie.cli import exit_after_signal

    run = tmp_path / "run"

    def interrupt(info) -> None:
        if info.step == 2:
            os.kill(os.getpid(), signal.SIGTERM)

    cfg = compose("train", data["base"] + FAST + ["train.max_steps=6", "train.checkpoint_every=0"])
    result = train_stage.run(cfg, run, on_step_end=interrupt)
    # Received after step 2, seen by every process with step 3's collective: the run stops after step 3.
    assert result["signal"] == signal.SIGTERM and result["stopped_by_signal"] and result["step"] == 3
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step-000003"]
    assert json.loads((run / "train_result.json").read_text())["signal"] == 15
    with pytest.raises(SystemExit) as info:
        exit_after_signal(result)
    assert info.value.code == 143
    exit_after_signal({"signal": None, "step": 6})  # a finished run: no exit
    # The entry point exits with it (SIGINT: 130).
    monkeypatch.setattr(train_stage, "start", lambda checked, run_dir: {"signal": int(signal.SIGINT)})
    monkeypatch.setattr(sys, "argv", ["qie.train", *data["base"], f"hydra.run.dir={tmp_path / 'cli'}"])
    with pytest.raises(SystemExit) as info:
        train_entry.main()
    assert info.value.code == 130


# --- 11: symbolic links followed before the outside check ---------------------------------------------------


def test_manifest_paths_leading_outside_through_a_link_are_refused(tmp_path: Path) -> None:
    import json

    from helpers import write_solid_image

    from qie.data.scan import scan_dataset

    outside = tmp_path / "elsewhere"
    for name in ("t.png", "c.png"):
        write_solid_image(outside / name)
        write_solid_image(tmp_path / "meta" / "in" / name)
    (tmp_path / "meta" / "linked").symlink_to(outside, target_is_directory=True)  # a folder linking out
    (tmp_path / "meta" / "in" / "file.png").symlink_to(outside / "t.png")  # a file linking out
    (tmp_path / "meta" / "in" / "local.png").symlink_to(tmp_path / "meta" / "in" / "t.png")  # a link inside
    rows = [
        {"id": "inside", "target": "in/local.png", "controls": ["in/c.png"], "prompt": "ok"},
        {"id": "folder", "target": "linked/t.png", "controls": ["in/c.png"], "prompt": "leaves"},
        {"id": "file", "target": "in/t.png", "controls": ["in/file.png"], "prompt": "leaves"},
    ]
    manifest = tmp_path / "meta" / "m.jsonl"
    manifest.write_text("\n".join(json.dumps(r) for r in rows), encoding="utf-8")
    data = scan_dataset(manifest)
    assert [s.id for s in data.samples] == ["inside"]
    folder = str(manifest.parent)
    assert {p.id: p.reason.split(": ", 1)[1] for p in data.problems} == {
        "folder": f"'linked/t.png' (a link to {str(outside / 't.png')!r}) lies outside the manifest's folder "
        f"{folder!r}: move it inside, or set data.allow_outside_paths=true",
        "file": f"'in/file.png' (a link to {str(outside / 't.png')!r}) lies outside the manifest's folder "
        f"{folder!r}: move it inside, or set data.allow_outside_paths=true",
    }
    assert sorted(s.id for s in scan_dataset(manifest, allow_outside=True).samples) == ["file", "folder", "inside"]


# --- 13: the run lock covers inference ------------------------------------------------------------------


def test_infer_into_a_live_training_folder_is_refused_before_it_writes(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    run = tmp_path / "run"
    with held_run_lock(run) as holder:
        (run / ".hydra").mkdir()
        (run / ".hydra" / "config.yaml").write_text("the training's own\n")
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = subprocess.run([sys.executable, "-m", "qie.infer", f"hydra.run.dir={run}", "predict.prompt=x"],
                              capture_output=True, text=True, timeout=120, env=env)  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert (
        proc.stderr.strip()
        .splitlines()[-1]
        .startswith(f"qie: error: run folder '{run}' is in use by another training or inference (pid {holder.pid} on ")
    )
    assert "Traceback" not in proc.stderr
    assert sorted(p.name for p in (run / ".hydra").iterdir()) == ["config.yaml"]
    assert (run / ".hydra" / "config.yaml").read_text() == "the training's own\n"


# --- 14: no raw tracebacks ------------------------------------------------------------------------------


def test_odd_values_and_files_end_in_one_line_not_a_traceback(tiny_path: Path, tmp_path: Path) -> None:
    import json

    from qie import run_lock
    from qie.checks import validate
    from qie.components.check import read_facts
    from qie.components.tiny import _check_existing
    from qie.errors import ConfigError, ModelLoadError, StorageError

    for lr, shown in (("1e39", "1e+39"), ("nan", "nan"), ("-1e-4", "-0.0001")):
        with pytest.raises(ConfigError) as info:
            validate(compose("train", [f"train.learning_rate={lr}"]))
        assert str(info.value) == f"train.learning_rate={shown} is out of range: it must lie in [0.0, 3.4e+38]"
    validate(compose("train", ["train.learning_rate=1.0"]))  # Prodigy's learning rate

    run = tmp_path / "run"
    (run / ".qie-run.lock").mkdir(parents=True)
    with pytest.raises(StorageError) as info:
        run_lock.acquire(run)
    assert str(info.value) == (
        f"cannot open the run lock '{run / '.qie-run.lock'}' (Is a directory): it must be a file qie may write; "
        "remove what is there, or give this run its own hydra.run.dir"
    )

    model = tmp_path / "model"
    shutil.copytree(tiny_path, model, ignore=shutil.ignore_patterns("*.safetensors"))
    index = json.loads((model / "model_index.json").read_text())
    (model / "model_index.json").write_text(json.dumps({**index, "_class_name": ["QwenImageEditPipeline"]}))
    with pytest.raises(ModelLoadError) as info:
        read_facts(str(model))
    assert str(info.value) == (
        f"{model}: model_index.json's _class_name is ['QwenImageEditPipeline'], not a pipeline class name: fix that "
        "file or point model.pretrained_model_name_or_path elsewhere"
    )
    with pytest.raises(ModelLoadError) as info:
        _check_existing(model, "edit")
    assert str(info.value) == (
        f"{model / 'model_index.json'}: _class_name is ['QwenImageEditPipeline'], not a pipeline class name: remove "
        f"{model} to rebuild it"
    )


# --- 15: wording ----------------------------------------------------------------------------------------


def test_a_missing_transformer_path_and_a_resume_with_nothing_left_are_said_plainly(data: dict, tmp_path: Path,
                                                                                   capsys) -> None:  # fmt: skip
    from qie.components import transformer_folder
    from qie.errors import ModelLoadError

    missing = tmp_path / "nowhere" / "transformer.safetensors"
    with pytest.raises(ModelLoadError) as info:
        transformer_folder(str(missing))
    assert str(info.value) == (f"model.transformer_path={str(missing)!r} does not exist: give a .safetensors "
                               "transformer file or a diffusers transformer folder")  # fmt: skip
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="holds no diffusers transformer"):
        transformer_folder(str(tmp_path / "empty"))
    run = tmp_path / "run"
    train_stage.run(compose("train", data["base"] + FAST + ["train.max_steps=2", "train.checkpoint_every=2"]), run)
    capsys.readouterr()
    again = ["train.max_steps=2", "train.resume=latest"]
    result = train_stage.run(compose("train", data["base"] + FAST + again), run)
    assert result["step"] == 2 and result["losses"] == []
    out = capsys.readouterr().out
    assert "qie: trained at step 2, no step left (train.max_steps reached); weights: " in out
    assert "nan" not in out


# --- 6: every read checked ----------------------------------------------------------------------------------


def flip_exponent_bit(path: Path) -> None:
    """Flip the lowest exponent bit of the last float32 value of an entry file: the value doubles or halves and
    stays finite, so only the checksum can tell."""
    import struct

    data = bytearray(path.read_bytes())
    (value,) = struct.unpack("<f", data[-4:])
    data[-2] ^= 0x80  # little-endian: bit 23 of the value is bit 7 of its third byte
    (flipped,) = struct.unpack("<f", data[-4:])
    assert flipped != value and abs(flipped) < float("inf")
    path.write_bytes(bytes(data))


def test_a_finite_bit_flip_in_a_prompt_entry_is_never_trained_on(copy: CachedData, tiny_path: Path,
                                                                 tmp_path: Path) -> None:  # fmt: skip
    from qie.errors import CacheMissError

    victim = sorted((copy.cache / "prompt_embed").rglob("*.safetensors"))[0]
    flip_exponent_bit(victim)
    base = [f"model.pretrained_model_name_or_path={tiny_path}", *copy.overrides, "data.num_workers=0", *FAST]
    run = tmp_path / "run"
    with pytest.raises(CacheMissError) as info:
        train_stage.run(compose("train", base + ["train.max_steps=8"]), run)
    # The steps before the sample comes up are saved; it is not trained on.
    images = copy.data / "training_images"
    assert re.match(rf"sample '(\d+)' \({images}/\1.png\) has a damaged cached prompt_embed \(its bytes changed\) "
                    r"in SsdBackend\(", str(info.value))  # fmt: skip
    assert f"cache.dir={copy.cache} cache.repair=true\n" in str(info.value)
    (saved,) = (run / "checkpoints").iterdir()
    assert int(saved.name.removeprefix("step-")) < 8
    # As told: precompute with repair writes it again, and training passes it.
    pre = [f"model.pretrained_model_name_or_path={tiny_path}", *copy.overrides, "cache.repair=true"]
    assert precompute.run(compose("precompute", pre), tmp_path / "pre").types["prompt_embed"].new == 1
    assert train_stage.run(compose("train", base + ["train.max_steps=8", "train.resume=latest"]), run)["step"] == 8


# --- 7: an unreadable image with auto_caption is skipped, not a refused training -------------------------------


def test_auto_caption_skips_an_unreadable_image_as_training_without_it_does(tiny_t2i_path: Path, tmp_path: Path,
                                                                          capsys) -> None:  # fmt: skip
    data = tmp_path / "data"
    for i in range(3):
        write_noise_image(data / "training_images" / f"s{i}.png", i)
    broken = data / "training_images" / "s1.png"
    broken.write_bytes(b"not an image")
    describe = tmp_path / "describe.yaml"
    describe.write_text('max_new_tokens: 6\nname: "describe"\nshow_controls: false\ninstruction: "Describe it."\n')
    base = ["model=tiny_t2i", f"data.path={data}", f"cache.dir={tmp_path / 'cache'}", "data.auto_caption=true",
            f"data.auto_caption_prompt={describe}", "data.batch_size=1"]  # fmt: skip
    summary = precompute.run(small_config("precompute", *base), tmp_path / "pre")
    assert summary.types["caption"].new == 2 and {p.id for p in summary.failures} == {"s1"}
    capsys.readouterr()
    result = train_stage.run(small_config("train", *base, "train.max_steps=2"), tmp_path / "run")
    assert len(result["losses"]) == 2
    out = capsys.readouterr().out
    assert f"qie: skipping sample 's1': {broken}: image '{broken}' cannot be read (" in out


# --- 8: gc's guard per type ---------------------------------------------------------------------------------


def test_gc_refuses_to_take_a_whole_type_under_other_settings(copy: CachedData, tiny_path: Path,
                                                              tiny_plus_path: Path) -> None:  # fmt: skip
    from qie.errors import ConfigError

    def files() -> set[Path]:
        return set(copy.cache.glob("*/??/*.safetensors"))

    before = files()
    gc = ["action=gc", f"cache.dir={copy.cache}", f"data.path={copy.data}", "gc.dry_run=false"]
    plus = ["model=tiny_plus", f"model.pretrained_model_name_or_path={tiny_plus_path}"]  # the same VAE
    with pytest.raises(ConfigError) as info:
        cache_cli(compose("cache", gc + plus))
    assert str(info.value).startswith("none of the 8 samples' prompt_embed, empty_prompt_embed entries is in "
                                      "SsdBackend(")  # fmt: skip
    assert str(info.value).endswith("(or gc.force=true to remove them all the same)")
    tiny = ["model=tiny", f"model.pretrained_model_name_or_path={tiny_path}"]
    with pytest.raises(ConfigError, match="^none of the 8 samples' pixel_latent, control_latent entries is in"):
        cache_cli(compose("cache", gc + tiny + ["model.vae_image_pixels=2048"]))
    assert files() == before
    assert cache_cli(compose("cache", gc + tiny)) == 0 and files() == before  # the right settings: all kept
    assert cache_cli(compose("cache", gc + plus + ["gc.force=true"])) == 0
    assert {p.parent.parent.name for p in before - files()} == {"empty_prompt_embed", "prompt_embed"}


# --- 9: a gap in layer numbers ------------------------------------------------------------------------------


def test_layers_with_a_gap_in_their_numbers_are_a_problem_of_their_sample(tmp_path: Path) -> None:
    from helpers import write_solid_image

    from qie.data.scan import scan_dataset

    for stem, numbers in (("gap", (0, 2, 3)), ("whole", (0, 1, 2)), ("twice", (0, 1))):
        write_solid_image(tmp_path / "images" / f"{stem}.png")
        (tmp_path / "images" / f"{stem}.txt").write_text("split it")
        for n in numbers:
            write_solid_image(tmp_path / "layers" / f"{stem}_{n}.png")
    write_solid_image(tmp_path / "layers" / "twice_01.png")  # layer 1 again
    data = scan_dataset(tmp_path)
    assert [(s.id, len(s.layers)) for s in data.samples] == [("whole", 3)]
    assert {(p.id, p.path, p.reason) for p in data.problems} == {
        ("gap", str(tmp_path / "layers" / "gap_0.png"),
         "its layers are numbered 0, 2, 3: number them 0 to 2 with none missing"),
        ("twice", str(tmp_path / "layers" / "twice_0.png"),
         "its layers are numbered 0, 1, 1: number them 0 to 2 with none missing"),
    }  # fmt: skip
