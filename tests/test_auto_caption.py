"""Samples without a caption: refused in one line naming the file, or with `data.auto_caption=true` captioned once
by the model's own VL text encoder (the family's caption prompt), the caption cached like any entry and the prompt
embedding keyed by it; precompute, lazy and cached training."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from helpers import small_config, write_noise_image
from stage_edges import encoder_for, hasher_for, key_context_for, sizes_for
from test_qwen_image_layered import rgba

from qie.cache.entries import read_logical
from qie.cache.ssd import SsdBackend
from qie.config import typed
from qie.data.keys import sample_keys
from qie.data.scan import scan_dataset
from qie.errors import CacheMissError, ConfigError, DataError
from qie.models import model_spec
from qie.models.captioning import Captioner
from qie.stages import auto_caption, precompute, sources
from qie.stages import caption as caption_stage
from qie.stages import train as train_stage

LAYERED = ["model=tiny_qwen_image_layered", "data.target_pixels=4096", "data.batch_size=1"]
FIX = "caption the data set with `python -m qie.caption`, or set data.auto_caption=true"


def layered_manifest(root: Path, prompt: str | None) -> Path:
    """One layered row (image, two layers) with `prompt` (None: no "prompt" field)."""
    root.mkdir(parents=True, exist_ok=True)
    rgba(1, 48, 40).save(root / "in.png")
    for k in range(2):
        rgba(2 + k, 48, 40).save(root / f"in_{k}.png")
    row = {"image": "in.png", "layers": ["in_0.png", "in_1.png"], **({} if prompt is None else {"prompt": prompt})}
    (root / "data.jsonl").write_text(json.dumps(row) + "\n", encoding="utf-8")
    return root / "data.jsonl"


def caption_yaml(path: Path, **fields) -> Path:
    """A caption prompt file for `data.auto_caption_prompt` (short generations keep the tests fast)."""
    path.write_text("".join(f"{k}: {json.dumps(v)}\n" for k, v in {"max_new_tokens": 6, **fields}.items()))
    return path


def count_generate(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the captioner's generate calls (one per batch of samples), in every captioner."""
    calls: list[int] = []
    real = Captioner._generate

    def generate(self, images):
        calls.append(len(images))
        return real(self, images)

    monkeypatch.setattr(Captioner, "_generate", generate)
    return calls


def test_a_sample_without_a_caption_is_refused_in_one_line_naming_its_file(tmp_path: Path) -> None:
    folder = tmp_path / "folder"
    for stem in ("a", "b", "c"):
        write_noise_image(folder / "training_images" / f"{stem}.png", 1)
        write_noise_image(folder / "control_images" / f"{stem}.png", 2)
    (folder / "training_images" / "a.txt").write_text("Make it red.", encoding="utf-8")
    (folder / "training_images" / "b.txt").write_text(" \n", encoding="utf-8")  # empty once stripped
    data = scan_dataset(folder)
    assert [s.id for s in data.samples] == ["a"]
    reasons = {p.id: p.reason for p in data.problems}
    b, c = folder / "training_images" / "b.txt", folder / "training_images" / "c.txt"
    assert reasons["b"] == f"caption {str(b)!r} is empty: write one, {FIX}"
    assert reasons["c"] == f"caption {str(c)!r} is missing: write one, {FIX} (a UTF-8 .txt beside the image)"
    assert all("\n" not in r for r in reasons.values())
    # The caption stage reads the same folder: it writes captions for exactly such samples.
    assert [s.prompt for s in scan_dataset(folder, require_prompt=False).samples] == ["Make it red.", "", ""]
    for prompt, said in (("", "an empty"), (None, "no")):
        manifest = layered_manifest(tmp_path / f"m{said}", prompt)
        text = manifest.read_text() + '{"image": "in.png", "layers": ["in_1.png"], "prompt": "two shapes"}\n'
        manifest.write_text(text)
        (problem,) = scan_dataset(manifest).problems
        assert problem.path == f"{manifest}:1"
        assert problem.reason == f"manifest row 1 has {said} 'prompt': write one, {FIX}"


def test_precompute_refuses_a_layered_sample_without_a_caption_before_encoding(tmp_path: Path, monkeypatch) -> None:
    manifest = layered_manifest(tmp_path / "data", "")
    monkeypatch.setattr(precompute, "build_encoder", lambda *a: pytest.fail("encoded a sample without a caption"))
    cfg = small_config("precompute", *LAYERED, f"data.path={manifest}", f"cache.dir={tmp_path / 'cache'}")
    with pytest.raises(DataError, match=r"no usable sample") as e:
        precompute.run(cfg, tmp_path / "run")
    assert f"{manifest}:1: manifest row 1 has an empty 'prompt': write one, {FIX}" in str(e.value)


def test_every_model_captions_with_a_preset_that_exists() -> None:
    from qie.models import variants

    presets = auto_caption.presets()
    assert {v.caption for _, v in variants().values()} <= set(presets)
    cfg = small_config("precompute", "model=tiny_qwen_image_layered")
    settings = auto_caption.caption_settings(cfg.data.auto_caption_prompt, model_spec(typed(cfg.model)))
    assert settings.prompt.pipeline_prompt == "QwenImageLayeredPipeline.image_caption_prompt_en"
    cfg = small_config("precompute", "model=tiny_t2i", "data.auto_caption_prompt=nope")
    with pytest.raises(ConfigError, match="'nope' is no caption preset: choose one of describe, edit_instruction"):
        auto_caption.caption_settings(cfg.data.auto_caption_prompt, model_spec(typed(cfg.model)))


def test_layered_auto_caption_is_generated_once_cached_and_keys_the_prompt(
    tiny_layered_path: Path, tmp_path: Path, monkeypatch
) -> None:
    manifest = layered_manifest(tmp_path / "data", None)
    en = caption_yaml(tmp_path / "en.yaml", name="layered", show_controls=False,
                      pipeline_prompt="QwenImageLayeredPipeline.image_caption_prompt_en")  # fmt: skip
    cn = caption_yaml(tmp_path / "cn.yaml", name="layered", show_controls=False,
                      pipeline_prompt="QwenImageLayeredPipeline.image_caption_prompt_cn")  # fmt: skip
    cache = tmp_path / "cache"
    base = [*LAYERED, f"data.path={manifest}", f"cache.dir={cache}", "data.auto_caption=true"]
    calls = count_generate(monkeypatch)

    def run(name: str, prompt: Path):
        cfg = small_config("precompute", *base, f"data.auto_caption_prompt={prompt}")
        return cfg, precompute.run(cfg, tmp_path / name)

    cfg, first = run("one", en)
    assert first.failures == [] and calls == [1]
    c = first.types["caption"]
    assert (c.new, c.skipped, c.failed) == (1, 0, 0) and c.bytes_written > 0
    spec = model_spec(typed(cfg.model))
    settings = auto_caption.caption_settings(cfg.data.auto_caption_prompt, spec)
    assert settings.generation.do_sample is False and settings.generation.max_new_tokens == 6
    (sample,) = scan_dataset(manifest, require_prompt=False).samples
    ctx, hasher = key_context_for(cfg, spec), hasher_for(cfg)
    key = auto_caption.caption_key(sample, settings, ctx, hasher)
    backend = SsdBackend(dir=cache)
    text = auto_caption.caption_text(backend.get("caption", key)["text"])
    # The caption is the one the caption stage's captioner writes for the image, greedy: the same twice.
    captioner = caption_stage.build_captioner(typed(cfg.model), spec, str(cfg.cache.text_encoder_device), settings)
    shown = [caption_stage.shown_images(sample, captioner, spec, int(cfg.model.vl_image_pixels))]
    assert text and captioner.caption(shown) == captioner.caption(shown) == [text]
    # The prompt embedding stored is the caption's, keyed by its text, equal to encoding that text directly.
    captioned = replace(sample, prompt=text)
    stored = read_logical(backend, "prompt_embed", sample_keys(captioned, ctx, hasher)["prompt_embed"])
    from qie.embedding.encode import prepare_sample

    encoder = encoder_for(cfg, spec)
    direct = encoder.encode_entries([prepare_sample(captioned, sizes_for(cfg, spec))], ["prompt_embed"])
    assert torch.equal(stored, direct[0]["prompt_embed"]["embed"])

    calls.clear()
    _, second = run("two", en)  # read, not generated again; nothing else to encode
    assert calls == [] and (second.types["caption"].new, second.types["caption"].skipped) == (0, 1)
    assert sum(s.new for s in second.types.values()) == 0
    cfg, other = run("three", cn)  # another caption prompt: captioned again, under another key
    assert calls == [1] and other.types["caption"].new == 1
    cn_settings = auto_caption.caption_settings(cfg.data.auto_caption_prompt, spec)
    cn_key = auto_caption.caption_key(sample, cn_settings, ctx, hasher)
    assert cn_key != key and backend.exists("caption", cn_key)
    rgba(7, 48, 40).save(tmp_path / "data" / "in.png")  # another image: captioned again
    _, changed = run("four", cn)
    assert calls == [1, 1] and changed.types["caption"].new == 1


def test_lazy_training_captions_and_cached_training_needs_no_text_encoder(
    tiny_t2i_path: Path, tmp_path: Path, monkeypatch
) -> None:
    data = tmp_path / "data"
    for i in range(2):
        write_noise_image(data / "training_images" / f"s{i}.png", i)
    describe = caption_yaml(tmp_path / "describe.yaml", name="describe", show_controls=False,
                            instruction="Describe this image.")  # fmt: skip
    base = ["model=tiny_t2i", f"data.path={data}", f"cache.dir={tmp_path / 'cache'}", "data.auto_caption=true",
            f"data.auto_caption_prompt={describe}", "train.max_steps=2", "data.batch_size=1"]  # fmt: skip
    calls = count_generate(monkeypatch)
    cached = small_config("train", *base)
    with pytest.raises(CacheMissError, match=r"2 samples have no cached caption, the first 's0'.*cache.mode=lazy"):
        train_stage.run(cached, tmp_path / "cold")
    assert calls == []  # a cache-only run builds no text encoder
    # The transformer loads only once the captions are written: a load beside the text encoder's build switches
    # module construction to the meta device process-wide, and the encoder came out empty.
    real_load, events = train_stage.load_model, []
    monkeypatch.setattr(train_stage, "load_model", lambda *a: events.append(("load", sum(calls))) or real_load(*a))
    lazy = train_stage.run(small_config("train", *base, "cache.mode=lazy"), tmp_path / "lazy")
    assert len(lazy["losses"]) == 2 and sum(calls) == 2 and events == [("load", 2)]
    monkeypatch.setattr(caption_stage, "build_captioner", lambda *a: pytest.fail("built the text encoder"))
    monkeypatch.setattr(sources, "build_encoder", lambda *a: pytest.fail("built the encoders"))
    warm = train_stage.run(cached, tmp_path / "warm")
    assert warm["losses"] == pytest.approx(lazy["losses"], rel=1e-6) and sum(calls) == 2
    # The cache's garbage collection keeps the captions (and the prompt embeddings keyed by them).
    from qie.checks import precompute_command
    from qie.stages.cache_gc import gc_setup, used_keys

    gc = small_config("cache", "action=gc", *base[:5])
    backend = SsdBackend(dir=tmp_path / "cache")
    setup = gc_setup(typed(gc.model), typed(gc.data), typed(gc.cache), typed(gc.gc), precompute_command(gc))
    keep, count = used_keys(setup, backend)
    assert count == 2 and len(keep["caption"]) == 2 and all(backend.exists("caption", k) for k in keep["caption"])
    assert backend.unused(keep)["prompt_embed"]["count"] == 0 and backend.unused(keep)["caption"]["count"] == 0
