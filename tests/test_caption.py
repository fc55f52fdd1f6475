"""The caption stage: prompts and images the VL model receives, deterministic greedy captions on every tiny
family, folder and manifest outputs, resume, no overwrite without the flag, dry run, and caption -> precompute
-> train on data that had no captions."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from diffusers import QwenImageLayeredPipeline
from omegaconf import DictConfig

from qie.config import typed
from qie.data.images import fit_area, open_image, resize
from qie.data.scan import scan_dataset
from qie.models import model_spec
from qie.models.captioning import Captioner, pipeline_prompt
from qie.stages import caption as caption_stage
from qie.stages import precompute
from qie.stages import train as train_stage
from tests.helpers import small_config, write_noise_image

# model yaml, caption prompt, control images per sample (2.1 and Edit-Plus: two, to show the order).
FAMILIES = {
    "edit": ("tiny", "edit_instruction", 1),
    "edit_plus": ("tiny_plus", "edit_instruction", 2),
    "text_to_image": ("tiny_t2i", "describe", 0),
    "qwen_image_21": ("tiny_qwen_image_21", "edit_instruction", 2),
}
SHORT = ["caption.max_new_tokens=6"]


def folder(root: Path, samples: int, controls: int) -> Path:
    """A data set folder without captions: 64 px noise targets, `controls` control images each."""
    for i in range(samples):
        write_noise_image(root / "training_images" / f"s{i}.png", i)
        for k in range(controls):
            name = f"s{i}.png" if k == 0 else f"s{i}_control_{k}.png"
            write_noise_image(root / "control_images" / name, 100 * i + k, (64, 32 + 32 * k))
    return root


def config(family: str, data: Path, *overrides: str) -> DictConfig:
    model, prompt, _ = FAMILIES[family]
    return small_config("caption", f"model={model}", f"caption={prompt}", f"data.path={data}", *SHORT, *overrides)


def captioner(cfg: DictConfig) -> Captioner:
    device = str(cfg.cache.text_encoder_device)
    return caption_stage.build_captioner(typed(cfg.model), model_spec(typed(cfg.model)), device, settings_of(cfg))


def settings_of(cfg: DictConfig) -> caption_stage.Settings:
    """The caption stage's settings of `cfg` (its `caption` group, as the stage reads it)."""
    return caption_stage.read_settings(typed(cfg.caption))


def vl_image(path: Path, cfg: DictConfig):
    img = open_image(path)
    return resize(img, *fit_area(img.width, img.height, int(cfg.model.vl_image_pixels)))


def spy_generate(monkeypatch: pytest.MonkeyPatch, model) -> list[dict]:
    """Record the inputs `model.generate` receives."""
    calls: list[dict] = []
    real = model.generate

    def generate(**kwargs):
        calls.append(kwargs)
        return real(**kwargs)

    monkeypatch.setattr(model, "generate", generate)
    return calls


@pytest.mark.parametrize("family", FAMILIES)
def test_the_vl_model_receives_the_chat_template_and_the_images_in_order(family, tmp_path, monkeypatch) -> None:
    _, _, controls = FAMILIES[family]
    data = folder(tmp_path, 1, controls)
    cfg = config(family, data)
    cap = captioner(cfg)
    calls = spy_generate(monkeypatch, cap.text_encoder)
    (sample,) = scan_dataset(data, require_prompt=False).samples
    dry = dataclasses.replace(settings_of(cfg), dry_run=1)  # writes nothing: no output needed
    spec = model_spec(typed(cfg.model))
    caption_stage.caption_all(cap, [sample], spec, dry, None, caption_stage.CaptionSummary(), {})
    # What the chat template makes of it, spelled out: each image labelled when there are several, the
    # controls first, the target last, the instruction naming them.
    names = [f"Picture {i}" for i in range(1, controls + 2)]
    if controls:
        inputs = names[0] if controls == 1 else f"{', '.join(names[:-2])} and {names[-2]}"
        text = cfg.caption.instruction.replace("{inputs}", inputs).replace("{target}", names[-1])
        slots = "".join(f"{n}: <|vision_start|><|image_pad|><|vision_end|>" for n in names)
    else:
        text, slots = cfg.caption.instruction, "<|vision_start|><|image_pad|><|vision_end|>"
    system = "" if family == "qwen_image_21" else "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    expected = f"{system}<|im_start|>user\n{slots}{text}<|im_end|>\n<|im_start|>assistant\n"
    assert cap.text(controls) == expected
    images = (
        [vl_image(p, cfg) for p in [*sample.controls, sample.target]] if controls else [vl_image(sample.target, cfg)]
    )
    want = cap.processor(text=[expected], images=[images], return_tensors="pt")
    (got,) = calls
    for key in ("input_ids", "attention_mask", "pixel_values", "image_grid_thw"):
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=0)
    # The images differ, so their order is seen: the controls' grids come first (the second control is 64x96).
    if controls == 2:
        assert got["image_grid_thw"][1].tolist() != got["image_grid_thw"][0].tolist()


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_captions_are_deterministic_and_a_batch_equals_single_samples(family, tmp_path) -> None:
    _, _, controls = FAMILIES[family]
    data = folder(tmp_path, 2, controls)
    cfg = config(family, data)
    cap = captioner(cfg)
    samples = scan_dataset(data, require_prompt=False).samples
    images = [
        caption_stage.shown_images(s, cap, model_spec(typed(cfg.model)), cfg.model.vl_image_pixels) for s in samples
    ]
    batch = cap.caption(images)
    assert all(batch) and cap.caption(images) == batch
    assert [cap.caption([imgs])[0] for imgs in images] == batch


def test_layered_prompt_is_the_pipelines_own(tmp_path) -> None:
    pipe = QwenImageLayeredPipeline(scheduler=None, vae=None, text_encoder=None, tokenizer=None, processor=None,
                                    transformer=None)  # fmt: skip
    assert pipeline_prompt("QwenImageLayeredPipeline.image_caption_prompt_en") == pipe.image_caption_prompt_en
    assert pipeline_prompt("QwenImageLayeredPipeline.image_caption_prompt_cn") == pipe.image_caption_prompt_cn
    data = folder(tmp_path, 1, 1)
    cfg = small_config("caption", "model=tiny_plus", "caption=layered", f"data.path={data}", *SHORT)
    cap = captioner(cfg)
    (sample,) = scan_dataset(data, require_prompt=False).samples
    # The target alone, with the pipeline's prompt as it is (the pipeline's get_image_caption does the same).
    assert cap.shown(sample.controls, sample.target) == [sample.target]
    assert cap.text(1) == pipe.image_caption_prompt_en
    want = cap.processor(text=[pipe.image_caption_prompt_en], images=[[vl_image(sample.target, cfg)]],
                         return_tensors="pt")  # fmt: skip
    torch.testing.assert_close(cap.inputs([[vl_image(sample.target, cfg)]])["input_ids"], want["input_ids"])


def test_an_unknown_pipeline_prompt_is_one_clear_error() -> None:
    from qie.errors import ConfigError

    with pytest.raises(ConfigError, match="has no prompt 'nope'"):
        pipeline_prompt("QwenImageLayeredPipeline.nope")


def test_folder_resume_never_overwrites_without_the_flag(tmp_path, monkeypatch) -> None:
    data = folder(tmp_path / "data", 3, 1)
    first = caption_stage.run(config("edit", data), tmp_path / "run1")
    assert (first.captioned, first.skipped_existing, first.failures) == (3, 0, [])
    images = data / "training_images"
    captions = {p.stem: p.read_text(encoding="utf-8") for p in images.glob("*.txt")}
    assert sorted(captions) == ["s0", "s1", "s2"] and all(captions.values())
    info = json.loads((images / "s0.caption.json").read_text(encoding="utf-8"))
    assert info["caption"] == captions["s0"].strip() and info["generation"]["do_sample"] is False
    assert info["checkpoint_generation"]["eos_token_id"] == 2  # the tiny checkpoint's generation_config.json
    assert info["images"] == [str(data / "control_images" / "s0.png"), str(images / "s0.png")]
    assert "Picture 2: <|vision_start|>" in info["prompt"] and info["model"]["name"] == "tiny"
    (images / "s1.txt").write_text("My own caption.", encoding="utf-8")
    (images / "s2.txt").unlink()
    second = caption_stage.run(config("edit", data), tmp_path / "run2")
    assert (second.captioned, second.skipped_existing) == (1, 2)
    assert (images / "s1.txt").read_text(encoding="utf-8") == "My own caption."
    assert (images / "s2.txt").read_text(encoding="utf-8") == captions["s2"]  # greedy: the same caption again
    # Nothing left to caption: no model is built.
    monkeypatch.setattr(caption_stage, "build_captioner", lambda *a: pytest.fail("built a model with nothing to do"))
    assert caption_stage.run(config("edit", data), tmp_path / "run3").skipped_existing == 3
    monkeypatch.undo()
    third = caption_stage.run(config("edit", data, "caption.overwrite=true"), tmp_path / "run4")
    assert third.captioned == 3 and (images / "s1.txt").read_text(encoding="utf-8") == captions["s1"]


def test_dry_run_writes_nothing(tmp_path, capsys) -> None:
    data = folder(tmp_path / "data", 3, 1)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    summary = caption_stage.run(config("edit", data, "caption.dry_run=true", "caption.dry_run_samples=2"),
                                tmp_path / "run")  # fmt: skip
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
    assert [sid for sid, _ in summary.preview] == ["s0", "s1"] and all(text for _, text in summary.preview)
    out = capsys.readouterr().out
    assert "dry run: nothing written" in out and f"s0: {summary.preview[0][1]}" in out


def manifest(root: Path) -> Path:
    """Three rows: two without a prompt, one with the user's."""
    rows = []
    for i in range(3):
        write_noise_image(root / "img" / f"t{i}.png", i)
        write_noise_image(root / "img" / f"c{i}.png", 10 + i)
        row = {"id": f"r{i}", "target": f"img/t{i}.png", "controls": [f"img/c{i}.png"]}
        rows.append({**row, "prompt": "Keep this one."} if i == 1 else row)
    path = root / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def test_manifest_output_keeps_the_input_and_resumes_from_an_interrupted_run(tmp_path, monkeypatch) -> None:
    path = manifest(tmp_path)
    given = path.read_text(encoding="utf-8")
    out = tmp_path / "data.captioned.jsonl"
    # An interrupted earlier run left its part file with r2's caption: kept, not generated again.
    earlier = {"id": "r2", "target": "img/t2.png", "controls": ["img/c2.png"], "prompt": "Earlier.", "caption": {}}
    out.with_name(out.name + ".part-0").write_text(json.dumps(earlier) + "\n", encoding="utf-8")
    summary = caption_stage.run(config("edit", path), tmp_path / "run")
    assert (summary.captioned, summary.skipped_existing, summary.skipped_done) == (1, 1, 1)
    assert path.read_text(encoding="utf-8") == given and not list(tmp_path.glob("*.part-*"))
    rows = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert [r["id"] for r in rows] == ["r0", "r1", "r2"]
    assert rows[1]["prompt"] == "Keep this one." and rows[2]["prompt"] == "Earlier."
    assert rows[0]["prompt"] and rows[0]["caption"]["prompt_name"] == "edit_instruction"
    assert rows[0]["target"] == "img/t0.png" and rows[0]["controls"] == ["img/c0.png"]
    # The new manifest is a data set with every prompt.
    assert [s.prompt for s in scan_dataset(out).samples] == [rows[0]["prompt"], "Keep this one.", "Earlier."]


# model yaml, caption prompt, controls, train overrides: caption -> precompute -> train for each family.
@pytest.mark.parametrize("family", FAMILIES)
def test_caption_then_precompute_then_train(family, tmp_path) -> None:
    model, prompt, controls = FAMILIES[family]
    data = folder(tmp_path / "data", 2, min(controls, 1))
    with pytest.raises(Exception, match="caption"):  # no captions: precompute cannot use the data yet
        scan_dataset(data)
    base = [f"model={model}", f"data.path={data}", f"cache.dir={tmp_path / 'cache'}"]
    assert caption_stage.run(config(family, data), tmp_path / "caption").captioned == 2
    summary = precompute.run(small_config("precompute", *base), tmp_path / "precompute")
    prompts = summary.types["prompt_embed"]  # the tiny text-to-image model may write one caption for both
    assert summary.failures == [] and prompts.new + prompts.skipped == 2 and prompts.failed == 0
    train = ["train.max_steps=2", "data.batch_size=1", "train.learning_rate=1e-3"]
    result = train_stage.run(small_config("train", *base, *train), tmp_path / "train")
    assert len(result["losses"]) == 2 and all(torch.isfinite(torch.tensor(result["losses"])))


def test_quantized_text_encoder_captions_and_the_sidecar_says_so(tmp_path) -> None:
    data = folder(tmp_path / "data", 1, 1)
    cfg = config("edit", data, "model.text_encoder_quantize=int8", "cache.text_encoder_device=cpu")
    assert caption_stage.run(cfg, tmp_path / "run").captioned == 1
    info = json.loads((data / "training_images" / "s0.caption.json").read_text(encoding="utf-8"))
    assert info["caption"] and info["model"]["text_encoder_quantize"] == "int8"


def test_bad_settings_are_one_clear_error(tmp_path) -> None:
    from qie.errors import ConfigError

    with pytest.raises(ConfigError, match="data.path is not set"):
        caption_stage.run(small_config("caption"), tmp_path)
    with pytest.raises(ConfigError, match="caption.batch_size=0 is out of range"):
        caption_stage.run(config("edit", tmp_path, "caption.batch_size=0"), tmp_path)


@pytest.mark.subprocess
def test_two_processes_write_the_captions_of_one(tmp_path) -> None:
    """`torchrun -m qie.caption` in two CPU processes: each captions its share into its part file, the main one
    merges them into the manifest one process would write."""
    path = manifest(tmp_path)
    single = caption_stage.run(config("edit", path, f"caption.output={tmp_path / 'one.jsonl'}"), tmp_path / "one_run")
    assert single.captioned == 2
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m"]
    args = ["model=tiny", f"data.path={path}", *SHORT, f"hydra.run.dir={tmp_path / 'run'}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([*launcher, "qie.caption", *args], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "caption: 2 captioned, 1 kept" in done.stdout
    summary = json.loads((tmp_path / "run" / "caption_summary.json").read_text(encoding="utf-8"))
    assert sorted((p["process"], p["captioned"]) for p in summary["processes"]) == [(0, 1), (1, 1)]
    assert (tmp_path / "run" / "failures.jsonl").read_text() == "" and not list(tmp_path.glob("*.part-*"))
    rows = [json.loads(line) for line in (tmp_path / "data.captioned.jsonl").read_text(encoding="utf-8").splitlines()]
    want = [json.loads(line) for line in (tmp_path / "one.jsonl").read_text(encoding="utf-8").splitlines()]
    assert [r["prompt"] for r in rows] == [r["prompt"] for r in want]


def test_a_hugging_face_data_set_without_a_prompt_column_gets_a_manifest(tmp_path, monkeypatch) -> None:
    datasets = pytest.importorskip("datasets")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    images = [write_noise_image(tmp_path / "src" / f"{n}.png", i).read_bytes() for i, n in enumerate("tc")]
    features = datasets.Features({"target": datasets.Image(), "controls": datasets.List(datasets.Image())})
    rows = {"target": [images[0]], "controls": [[images[1]]]}
    datasets.Dataset.from_dict(rows, features=features).save_to_disk(str(tmp_path / "ds"))
    cache = tmp_path / "cache"
    summary = caption_stage.run(config("edit", tmp_path / "ds", f"cache.dir={cache}"), tmp_path / "run")
    assert summary.captioned == 1
    out = tmp_path / "ds.captioned.jsonl"
    (row,) = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    # The images qie extracted from the data set (under cache.dir/state/images), relative to the manifest's folder.
    target = out.parent / row["target"]
    assert target.read_bytes() == images[0] and target.is_relative_to(cache / "state" / "images")
    (sample,) = scan_dataset(out).samples
    assert sample.prompt == row["prompt"] and sample.controls[0].read_bytes() == images[1]
