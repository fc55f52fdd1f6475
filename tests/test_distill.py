"""Distillation (`train/objective=distill`): the teacher and the student are the family's own sampler, teacher
outputs are cache entries a cached run reads, and what the objective refuses. Every family's pinned losses, lazy ==
cached entries and exact resume are in the family battery (`test_family_battery.py`, case distill)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from distill_checks import check_teacher_and_student
from PIL import Image
from safetensors.torch import load_file
from stage_edges import predictor_for

from qie.cache.ssd import SsdBackend
from qie.checks import compose
from qie.config import typed
from qie.errors import CacheMissError, ConfigError
from qie.models import model_spec
from qie.stages import precompute, train
from qie.stages.cache_admin import run as cache_cli
from qie.training.objectives import ObjectiveUse, check_use

OPTIONS = {"student_steps": 2, "teacher_steps": 3, "teacher_cfg": 4.0, "seeds": 2}
DISTILL = ["train/objective=distill", "train.objective.student_steps=2", "train.objective.teacher_steps=2",
           "train.objective.teacher_cfg=4", "train.max_steps=1"]  # fmt: skip


def test_the_teacher_is_the_base_sampling_and_the_student_the_lora_sampling_with_a_gradient(
    small_cfg, cached_data
) -> None:
    check_teacher_and_student(small_cfg("train", *cached_data.overrides), OPTIONS)


def test_a_cached_run_without_teacher_outputs_names_the_sample_and_lazy_mode(small_cfg, cached_data, tmp_path) -> None:
    shutil.copytree(cached_data.cache, tmp_path / "cache")  # the embeddings; no teacher output
    cfg = small_cfg("train", *cached_data.overrides, *DISTILL, f"cache.dir={tmp_path / 'cache'}")
    with pytest.raises(CacheMissError, match=r"sample '.+': its teacher output \(seed \d\) .*cache.mode=lazy") as info:
        train.run(cfg, tmp_path / "run")
    assert "\n" not in str(info.value)
    assert not (tmp_path / "cache" / "teacher_latent").exists()  # cached mode computes and writes none


def test_precompute_fills_every_teacher_output_a_cached_run_reads_as_lazy_mode_writes_them(
    small_cfg, cached_data, tmp_path
) -> None:
    """`precompute.teachers=true` with the training run's overrides: one output per sample and seed (and per
    caption-dropped prompt), under the keys training looks up, bit for bit what a lazy run computes; the cached run
    then samples no teacher and repeats the lazy run's losses."""
    filled, lazy_cache = tmp_path / "filled", tmp_path / "lazy"
    shutil.copytree(cached_data.cache, filled)
    shutil.copytree(cached_data.cache, lazy_cache)
    run = [*DISTILL, "train.objective.seeds=2", "data.caption_dropout_rate=0.5", "train.max_steps=3"]
    fill = small_cfg("precompute", *cached_data.overrides, *run, f"cache.dir={filled}", "precompute.teachers=true")
    summary = precompute.run(fill, tmp_path / "pre")
    assert (summary.types["teacher_latent"].new, summary.types["teacher_latent"].skipped) == (8 * 2 * 2, 0)
    stored = {p.name: load_file(p)["latent"] for p in (filled / "teacher_latent").rglob("*.safetensors")}
    assert len(stored) == 8 * 2 * 2
    again = precompute.run(fill, tmp_path / "pre_again")  # all present: none computed
    assert (again.types["teacher_latent"].new, again.types["teacher_latent"].skipped) == (0, 32)

    cached = train.run(small_cfg("train", *cached_data.overrides, *run, f"cache.dir={filled}"), tmp_path / "cached")
    lazy = train.run(small_cfg("train", *cached_data.overrides, *run, f"cache.dir={lazy_cache}", "cache.mode=lazy"),
                     tmp_path / "lazy_run")  # fmt: skip
    assert cached["losses"] == lazy["losses"] and len(lazy["losses"]) == 3
    written = list((lazy_cache / "teacher_latent").rglob("*.safetensors"))
    assert written and all(torch.equal(load_file(p)["latent"], stored[p.name]) for p in written)
    logged = [json.loads(line) for line in (tmp_path / "cached" / "metrics.jsonl").read_text().splitlines()]
    assert [r["teacher_computed"] for r in logged if "teacher_computed" in r] == [0.0] * 3


def test_precompute_teachers_needs_the_distillation_runs_overrides(small_cfg, cached_data, tmp_path) -> None:
    with pytest.raises(
        ConfigError, match=r"precompute.teachers=true computes .* FlowMatching \(train.objective\) computes none"
    ) as e:
        small_cfg("precompute", *cached_data.overrides, f"cache.dir={tmp_path}", "precompute.teachers=true")
    assert "\n" not in str(e.value)  # one line, when the config is composed: before anything is built


def test_precompute_teachers_refuses_fsdp_over_several_processes_before_encoding() -> None:
    from types import SimpleNamespace

    from qie.stages.teacher_fill import check_processes

    sharded = SimpleNamespace(memory=SimpleNamespace(fsdp=True))
    check_processes(sharded, 1)  # one process holds the whole model
    with pytest.raises(ConfigError, match=r"precompute.teachers=true fills each process's share .* train.fsdp=true"):
        check_processes(sharded, 2)
    check_processes(SimpleNamespace(memory=SimpleNamespace(fsdp=False)), 2)


@pytest.mark.parametrize(
    ("lora", "regularization", "options", "message"),
    [
        (False, False, {}, "train/objective=distill needs train.mode=lora"),
        (True, True, {}, "train/objective=distill does not mix in data.regularization"),
        (True, False, {"seeds": 0}, r"train.objective.seeds=0 is out of range"),
        (True, False, {"student_steps": 0}, r"train.objective.student_steps=0 is out of range"),
        (True, False, {"teacher_cfg": 0.0}, r"train.objective.teacher_cfg=0.0 is out of range"),
    ],
)
def test_what_distillation_refuses_in_one_line(small_cfg, lora, regularization, options, message) -> None:
    family = model_spec(typed(small_cfg("train").model)).family
    with pytest.raises(ConfigError, match=message) as info:
        check_use(
            {"_target_": "qie.training.objectives.distill.Distill", **options},
            ObjectiveUse(family, lora, regularization),
        )
    assert "\n" not in str(info.value)


def test_a_full_model_run_is_refused_before_anything_loads(small_cfg, cached_data) -> None:
    """Refused when the config is composed (`qie.checks.validate` asks the objective), before the stage runs."""
    with pytest.raises(ConfigError, match="train/objective=distill needs train.mode=lora"):
        small_cfg("train", *cached_data.overrides, *DISTILL, "train.mode=full")


def test_gc_keeps_teacher_outputs_and_clear_removes_them(cached_data, tiny_path, tmp_path) -> None:
    shutil.copytree(cached_data.cache, tmp_path / "cache")
    backend = SsdBackend(tmp_path / "cache")
    backend.put("teacher_latent", "ab" * 32, {"latent": torch.zeros(16, 1, 8, 8)})
    model = ["model=tiny", f"model.pretrained_model_name_or_path={tiny_path}", f"cache.dir={tmp_path / 'cache'}"]
    gc = ["action=gc", *model, f"data.path={cached_data.data}", "gc.dry_run=false", "gc.force=true"]
    assert cache_cli(compose("cache", gc)) == 0
    assert backend.exists("teacher_latent", "ab" * 32)
    clear = ["action=clear", f"cache.dir={tmp_path / 'cache'}", "cache.types=[teacher_latent]"]
    assert cache_cli(compose("cache", clear)) == 0
    assert not backend.exists("teacher_latent", "ab" * 32) and backend.stats()["pixel_latent"]["count"] == 8


@pytest.mark.usefixtures("small_conditions")
def test_the_distilled_lora_loads_in_the_diffusers_pipeline_and_gives_qie_infer_at_student_steps(
    small_cfg, cached_data, tiny_path, tmp_path
) -> None:
    from test_family_battery import pipeline_of

    shutil.copytree(cached_data.cache, tmp_path / "cache")
    cfg = small_cfg("train", *cached_data.overrides, *DISTILL, f"cache.dir={tmp_path / 'cache'}", "cache.mode=lazy",
                    "train.learning_rate=1e-2")  # fmt: skip
    lora = Path(train.run(cfg, tmp_path / "run")["lora"])
    caption = sorted((cached_data.data / "training_images").glob("*.txt"))[0]
    control, prompt = cached_data.data / "control_images" / f"{caption.stem}.png", caption.read_text().strip()
    student = dict(true_cfg_scale=1.0, num_inference_steps=2, height=64, width=64)  # DISTILL's student_steps

    pipe = pipeline_of(tiny_path)
    base = pipe(prompt=prompt, image=[Image.open(control)], generator=torch.Generator().manual_seed(3),
                output_type="np", **student).images  # fmt: skip
    pipe.load_lora_weights(str(lora.parent), weight_name=lora.name)
    expected = pipe(prompt=prompt, image=[Image.open(control)], generator=torch.Generator().manual_seed(3),
                    output_type="np", **student).images  # fmt: skip
    predictor = predictor_for(compose("infer", ["model=tiny", f"model.pretrained_model_name_or_path={tiny_path}",
                                                  f"predict.lora={lora}"]))  # fmt: skip
    mine = predictor.predict([control], prompt, output_type="np", negative_prompt=None, seed=3, **student)
    assert np.abs(expected - base).max() > 1e-6  # the distilled LoRA moves the output
    assert np.abs(mine - expected).max() <= 1e-5


def test_the_benchmarks_picture_shows_each_edit_beside_base_distilled_and_teacher(tmp_path: Path) -> None:
    """`bench_distill.picture`: a row per held-out edit, its control then each column's image of the edit's first
    seed (the images are listed edit by edit, `seeds` each)."""
    from test_bench_scripts import script

    from qie.evaluation.grid import CAPTION_HEIGHT, TITLE_HEIGHT

    controls = []
    for i, colour in enumerate([(255, 0, 0), (0, 0, 255)]):
        controls.append((tmp_path / f"c{i}.png", f"edit {i}"))
        Image.new("RGB", (8, 8), colour).save(controls[-1][0])
    seeds, shade = 2, lambda v: np.full((8, 8, 3), v, np.float32)
    columns = {"base": [shade(0.0), shade(0.1), shade(0.2), shade(0.3)], "teacher": [shade(1.0)] * 4}
    script("bench_distill").picture(tmp_path / "p.png", controls, seeds, columns)
    grid = np.asarray(Image.open(tmp_path / "p.png").convert("RGB"))
    assert grid.shape == (TITLE_HEIGHT + 2 * (128 + CAPTION_HEIGHT), 3 * 128, 3)
    second_row = TITLE_HEIGHT + 128 + CAPTION_HEIGHT + 64
    assert tuple(grid[second_row, 64]) == (0, 0, 255)  # the second edit's control
    assert tuple(grid[second_row, 128 + 64]) == (51, 51, 51)  # its first seed's base image (0.2), not the second's
    assert tuple(grid[TITLE_HEIGHT + 64, 256 + 64]) == (255, 255, 255)  # the teacher column
