"""The cache, second round: garbage collection of entries no data set uses (a dry run first, nothing outside
cache.dir touched), precompute re-encoding checksum-corrupt entries with cache.repair=true, fingerprints that
follow a swapped weight file within one process, and a NaN LoRA refused where every loader reads it."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import safetensors.torch
import torch
from helpers import CachedData

from qie.adapters.lora import read_lora
from qie.cache.memory import MemoryBackend
from qie.cache.ssd import SsdBackend
from qie.checks import compose
from qie.components import fingerprint
from qie.errors import ConfigError, ModelLoadError
from qie.models import families
from qie.stages import precompute
from qie.stages.cache_admin import run as cache_cli
from qie.types import CACHE_TYPES


@pytest.fixture
def copy(cached_data: CachedData, tmp_path: Path) -> CachedData:
    """A private copy of the shared cached data set (its cache may be changed)."""
    shutil.copytree(cached_data.root, tmp_path / "data", symlinks=True)
    root = tmp_path / "data"
    return CachedData(root, root / "train", root / "cache")


def entry_files(cache: Path) -> set[Path]:
    """The entry files: under the type folders (not the images of HF data sets nor the remembered sample keys)."""
    return {p for p in cache.rglob("*.safetensors") if p.parts[len(cache.parts)] in CACHE_TYPES}


def test_gc_lists_then_removes_only_what_no_named_data_set_uses(copy: CachedData, tiny_path: Path, capsys) -> None:
    model = ["model=tiny", f"model.pretrained_model_name_or_path={tiny_path}", f"cache.dir={copy.cache}"]
    # Three samples leave the data set; one of them lives on in a second data set.
    gone = sorted((copy.data / "training_images").glob("*.png"))[:3]
    other = copy.root / "other"
    for sub in ("training_images", "control_images"):
        (other / sub).mkdir(parents=True)
    for png in gone[:1]:
        for sub in ("training_images", "control_images"):
            shutil.copy(copy.data / sub / png.name, other / sub / png.name)
        shutil.copy(png.with_suffix(".txt"), other / "training_images" / png.with_suffix(".txt").name)
    for png in gone:
        for sub in ("training_images", "control_images"):
            (copy.data / sub / png.name).unlink()
        png.with_suffix(".txt").unlink()
    outside = copy.root / "keep_me.safetensors"
    outside.write_bytes(b"not an entry")
    (copy.cache / "pixel_latent" / "zz").mkdir()
    stray = copy.cache / "pixel_latent" / "zz" / "notes.txt"
    stray.write_text("not an entry either")
    before = entry_files(copy.cache)
    assert len(before) == 32

    with pytest.raises(ConfigError, match="action=gc needs the data set"):
        cache_cli(compose("cache", ["action=gc", f"cache.dir={copy.cache}"]))
    args = ["action=gc", *model, f"data.path={copy.data}", f"gc.keep_data=[{other}]"]
    assert cache_cli(compose("cache", args)) == 0
    out = capsys.readouterr().out
    assert "6 samples of model=tiny use 24 entries" in out
    assert "would remove 8 unused entries" in out and "add gc.dry_run=false" in out
    assert entry_files(copy.cache) == before  # a dry run removes nothing

    assert cache_cli(compose("cache", [*args, "gc.dry_run=false"])) == 0
    assert "removed 8 unused entries" in capsys.readouterr().out
    after = entry_files(copy.cache)
    assert len(after) == 24 and after < before
    assert outside.read_bytes() == b"not an entry" and stray.exists()  # nothing but entries is touched
    # What is left verifies, and training data is still fully cached: precompute has nothing to encode.
    assert SsdBackend(copy.cache).verify().corrupt == []
    summary = precompute.run(compose("precompute", model + [f"data.path={copy.data}"]), copy.root / "r")
    assert sum(s.new for s in summary.types.values()) == 0

    # Another model's keys match nothing here: refused, nothing removed.
    with pytest.raises(ConfigError, match="none of the 5 samples' entries is in"):
        cache_cli(compose("cache", ["action=gc", f"cache.dir={copy.cache}", "model=tiny", "model.dtype=float16",
                                    f"model.pretrained_model_name_or_path={tiny_path}", f"data.path={copy.data}",
                                    "gc.dry_run=false"]))  # fmt: skip
    assert entry_files(copy.cache) == after


def test_memory_backend_gc_keeps_bases_of_kept_entries() -> None:
    backend = MemoryBackend()
    backend.put("empty_prompt_embed", "base01", {"prompt_embed": torch.ones(2, 3)})
    backend.put("prompt_embed", "keep01", {"suffix": torch.ones(1, 3)}, {"base": "empty_prompt_embed/base01"})
    backend.put("prompt_embed", "drop01", {"suffix": torch.ones(1, 3)})
    found = backend.unused({"prompt_embed": {"keep01"}}, remove=True)
    assert found["prompt_embed"]["count"] == 1 and found["empty_prompt_embed"]["count"] == 0
    assert backend.exists("empty_prompt_embed", "base01") and not backend.exists("prompt_embed", "drop01")


def test_precompute_repairs_checksum_corrupt_entries_when_asked(copy: CachedData, tiny_path: Path, capsys) -> None:
    backend = SsdBackend(copy.cache)
    victim = sorted((copy.cache / "pixel_latent").rglob("*.safetensors"))[0]
    good = {k: v.clone() for k, v in safetensors.torch.load_file(str(victim)).items()}  # not a view of the file
    data = bytearray(victim.read_bytes())
    data[-5] ^= 0xFF  # one flipped byte in the tensor data: the header is whole, the checksum fails
    victim.write_bytes(bytes(data))
    assert cache_cli(compose("cache", [f"cache.dir={copy.cache}", "action=verify"])) == 1
    assert "precompute with cache.repair=true re-encodes corrupt entries" in capsys.readouterr().out
    base = ["model=tiny", f"model.pretrained_model_name_or_path={tiny_path}", *copy.overrides]
    summary = precompute.run(compose("precompute", base), copy.root / "r1")
    assert summary.types["pixel_latent"].new == 0  # without repair: judged by its header alone
    summary = precompute.run(compose("precompute", [*base, "cache.repair=true"]), copy.root / "r2")
    assert {t: s.new for t, s in summary.types.items()} == {
        "pixel_latent": 1, "control_latent": 0, "empty_prompt_embed": 0, "prompt_embed": 0,
    }  # fmt: skip
    repaired = safetensors.torch.load_file(str(victim))
    # Encoded again alone rather than in a batch of four: equal to float rounding.
    assert all(torch.allclose(repaired[k], good[k], atol=1e-5) for k in good) and backend.verify().corrupt == []


def test_fingerprints_follow_a_swapped_weight_file_in_one_process(tiny_path: Path, tmp_path: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_path / "vae", model / "vae")
    first = fingerprint.part_fingerprint(str(model), "vae")
    weights = next((model / "vae").glob("*.safetensors"))
    tensors = safetensors.torch.load_file(str(weights))
    name = next(iter(tensors))
    tensors[name] = tensors[name] + 1
    replacement = tmp_path / "new.safetensors"
    safetensors.torch.save_file(tensors, str(replacement))
    assert fingerprint.part_fingerprint(str(model), "vae") == first  # unchanged files: remembered
    shutil.move(replacement, weights)  # a notebook swaps the file
    assert fingerprint.part_fingerprint(str(model), "vae") != first


def test_a_nan_lora_is_refused_by_the_one_reader(tmp_path: Path) -> None:
    down, up = torch.zeros(4, 32), torch.zeros(32, 4)
    up[1, 2] = float("nan")
    state = {"transformer.transformer_blocks.0.attn.to_q.lora_A.weight": down,
             "transformer.transformer_blocks.0.attn.to_q.lora_B.weight": up}  # fmt: skip
    path = tmp_path / "pytorch_lora_weights.safetensors"
    safetensors.torch.save_file(state, str(path))
    with pytest.raises(ModelLoadError, match=r"holds NaN or infinite values \(first in .*to_q.lora_B.weight"):
        read_lora(tmp_path, families()["qwen_image"].lora_loader_class())
