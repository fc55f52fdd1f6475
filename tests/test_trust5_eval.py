"""`qie.eval`: `cache.mode=cached` refuses rows the cache lacks instead of encoding them (as the guide says), and a
LoRA is named by the end of its path that tells it from the others (the final `lora` beside a checkpoint's
`step-000100`, not `lora_pytorch_lora_weights` beside `pytorch_lora_weights`)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from helpers import small_config

from qie.errors import CacheMissError


def test_cached_mode_refuses_a_miss_and_encodes_nothing(cached_data, tmp_path: Path) -> None:
    from qie.demo.synthetic import make_dataset
    from qie.stages import evaluation

    rows = make_dataset(tmp_path / "rows", train=0, heldout=2, size=64, seed=99) / "heldout"
    cache = tmp_path / "cache"
    shutil.copytree(cached_data.cache, cache)  # holds the training samples' entries, not these rows'

    def entries() -> list[Path]:
        return sorted(p.relative_to(cache) for p in cache.rglob("*.safetensors") if "state" not in p.parts)

    before = entries()
    cfg = small_config(
        "eval",
        f"data.path={rows}",
        f"cache.dir={cache}",
        "cache.mode=cached",
        "~eval.rewards.judge_instruction",
        "~eval.rewards.judge_preservation",
    )
    with pytest.raises(CacheMissError) as info:
        evaluation.run(cfg, tmp_path / "eval")
    assert "has no cached" in str(info.value) and "python -m qie.precompute" in str(info.value)
    assert entries() == before  # nothing encoded


def test_loras_are_named_by_what_tells_them_apart() -> None:
    from qie.stages.evaluation import run_names

    final, step = Path("/r/a/lora/pytorch_lora_weights.safetensors"), Path("/r/a/checkpoints/step-000100")
    assert run_names([None, final, step / "pytorch_lora_weights.safetensors"]) == ["base", "lora", "step-000100"]
    other = Path("/r/b/lora/pytorch_lora_weights.safetensors")
    assert run_names([final, other, Path("/x/my_style.safetensors")]) == ["a/lora", "b/lora", "my_style"]
    names = run_names([final, final.with_name("comfyui_lora.safetensors")])
    assert names == ["pytorch_lora_weights", "comfyui_lora"]
