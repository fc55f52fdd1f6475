"""Outputs that never overwrite inputs and never write through links: `qie.extract_lora` refuses an output that is
or lies inside an input, and an existing file unless `extract.overwrite=true`; its rank is capped per layer at the
layer's size (said once) and a rank that makes every layer full is refused; `qie.export` refuses a non-empty folder
unless `export.overwrite=true`, then replaces links instead of writing through them; every exported file has the
user's usual mode; a report that cannot be written names itself and leaves no temporary file."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from qie.checks import compose
from qie.errors import ConfigError


@pytest.fixture
def umask() -> Iterator[int]:
    """A umask other than the usual 022 while the test runs: exported files must follow it."""
    previous = os.umask(0o027)
    try:
        yield 0o027
    finally:
        os.umask(previous)


def files_of(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# --- qie.extract_lora --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tuned(tiny_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny transformer with every linear layer changed (the 16-wide ones too), as a diffusers folder."""
    from diffusers import QwenImageTransformer2DModel

    model = QwenImageTransformer2DModel.from_pretrained(tiny_path / "transformer")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight += 0.01 * torch.randn(module.weight.shape, generator=gen)
    out = tmp_path_factory.mktemp("tuned") / "transformer"
    model.save_pretrained(out)
    return out


def extract(tuned: Path, out: Path | str, *more: str) -> dict:
    from qie.stages import extract_lora

    cfg = compose("extract_lora", ["model=tiny", f"extract.tuned={tuned}", f"extract.out={out}", *more])
    return extract_lora.run(cfg)


def test_an_output_that_is_or_lies_inside_an_input_is_refused(tiny_path: Path, tuned: Path, tmp_path: Path) -> None:
    weights = tuned / "diffusion_pytorch_model.safetensors"
    before = weights.read_bytes()
    cases = {
        weights: f"extract.out: {weights} lies inside extract.tuned ({tuned})",
        tuned / "lora.safetensors": f"extract.out: {tuned / 'lora.safetensors'} lies inside extract.tuned ({tuned})",
        tiny_path / "transformer" / "x.safetensors": f"extract.out: {tiny_path / 'transformer' / 'x.safetensors'} lies "
        f"inside model.pretrained_model_name_or_path ({tiny_path})",
    }
    for out, message in cases.items():
        with pytest.raises(ConfigError) as info:
            extract(tuned, out, "extract.rank=4", "extract.overwrite=true")
        assert str(info.value).startswith(message) and "choose another extract.out" in str(info.value)
    assert weights.read_bytes() == before and not (tuned / "lora.safetensors").exists()
    # The tuned model given as one file, the ComfyUI file written beside the output: that file is an input too.
    single = tmp_path / "comfyui_lora.safetensors"
    single.write_bytes(before)
    with pytest.raises(ConfigError, match=f"extract.out: {single} is extract.tuned"):
        extract(single, tmp_path / "lora.safetensors", "extract.rank=4", "extract.overwrite=true")
    assert single.read_bytes() == before


def test_an_existing_output_is_replaced_only_when_asked_and_a_link_is_not_written_through(
    tuned: Path, tmp_path: Path, capsys: pytest.CaptureFixture, umask: int
) -> None:
    out_dir = tmp_path / "extracted"
    out_dir.mkdir()
    victim = tmp_path / "elsewhere.safetensors"
    victim.write_bytes(b"not mine to overwrite")
    (out_dir / "lora.safetensors").symlink_to(victim)
    with pytest.raises(ConfigError) as info:
        extract(tuned, out_dir / "lora.safetensors", "extract.rank=20")
    assert str(info.value) == (
        f"extract.out: {out_dir / 'lora.safetensors'} exists already: set extract.overwrite=true to replace it, or "
        "choose another extract.out"
    )
    report = extract(tuned, out_dir / "lora.safetensors", "extract.rank=20", "extract.overwrite=true")
    assert victim.read_bytes() == b"not mine to overwrite"  # the link replaced by the file, not written through
    written = out_dir / "lora.safetensors"
    assert not written.is_symlink() and written.stat().st_size > 1000
    names = {p.name for p in out_dir.iterdir()}
    assert names == {"lora.safetensors", "comfyui_lora.safetensors", "kohya_lora.safetensors", "extract_report.json"}
    for path in out_dir.iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask, path
    # Rank 20 above the three 16-wide layers' size: each keeps its full rank, said once, no zero padding.
    printed = capsys.readouterr().out
    assert printed.count("extract.rank=20 is above the size of 3 of the changed layers") == 1
    assert {fit["rank"] for fit in report["layers"].values()} == {16, 20}
    from safetensors import safe_open

    with safe_open(str(written), "pt") as f:
        shapes = {k: f.get_slice(k).get_shape() for k in f.keys()}
    assert max(shape[0] for k, shape in shapes.items() if "lora_A" in k) == 20
    assert sorted({shape[0] for k, shape in shapes.items() if "lora_A" in k}) == [16, 20]


@pytest.mark.parametrize("rank", [48, 100000])
def test_a_rank_that_makes_every_layer_full_is_refused_before_anything_is_written(
    tuned: Path, tmp_path: Path, rank: int
) -> None:
    """The probe's rank 100000 wrote 6.6 GB of zeros; now one line, nothing written."""
    out = tmp_path / "x" / "lora.safetensors"
    with pytest.raises(ConfigError) as info:
        extract(tuned, out, f"extract.rank={rank}")
    assert str(info.value) == (
        f"extract.rank={rank} makes every layer full rank (the largest linear layer's rank is 48): a LoRA of that "
        "rank stores more numbers than the weights' change itself; give a rank below 48"
    )
    assert not out.parent.exists() or not list(out.parent.iterdir())


def test_an_extracted_lora_with_capped_ranks_loads_as_extracted(tiny_path: Path, tuned: Path, tmp_path: Path) -> None:
    """The file's rank pattern (the capped layers) is what diffusers reads: the loaded LoRA is the extraction."""
    from diffusers import QwenImageEditPipeline
    from helpers import tiny_pipeline

    out = tmp_path / "lora.safetensors"
    extract(tuned, out, "extract.rank=20", "extract.comfyui=false", "extract.kohya=false")
    pipe = tiny_pipeline(QwenImageEditPipeline, tiny_path)
    pipe.load_lora_weights(str(tmp_path), weight_name=out.name)
    layer = pipe.transformer.img_in  # 16 wide: rank 16 in the file, scale 1
    assert layer.r["default_0"] == 16 and layer.scaling["default_0"] == 1.0
    assert pipe.transformer.transformer_blocks[0].attn.to_q.scaling["default_0"] == 1.0


def test_a_tuned_file_that_is_no_safetensors_file_is_named_in_one_line(tmp_path: Path) -> None:
    from qie.errors import ModelLoadError

    broken = tmp_path / "tuned.safetensors"
    broken.write_bytes(b"garbage")
    with pytest.raises(ModelLoadError) as info:
        extract(broken, tmp_path / "out" / "lora.safetensors", "extract.rank=4")
    assert str(info.value).startswith(f"extract.tuned={str(broken)!r} is not a readable safetensors file (")


# --- qie.export --------------------------------------------------------------------------------------------------


@pytest.fixture
def run_folder(tmp_path: Path) -> Path:
    """A run folder holding a diffusers-format LoRA (no training: the export reads files only)."""
    run = tmp_path / "run"
    (run / "lora").mkdir(parents=True)
    gen = torch.Generator().manual_seed(0)
    state = {
        f"transformer.transformer_blocks.0.attn.{m}.lora_{ab}.weight": torch.randn(4, 8, generator=gen)
        for m in ("to_q", "to_k")
        for ab in ("A", "B")
    }
    save_file(state, str(run / "lora" / "pytorch_lora_weights.safetensors"))
    return run


def export(run: Path, out: Path, *more: str) -> dict:
    from qie.stages import export as export_stage

    return export_stage.run(compose("export", [f"export.run_dir={run}", f"export.out={out}", *more]))


def test_export_into_a_non_empty_folder_is_refused_unless_told(run_folder: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "README.md").write_text("my own notes")
    with pytest.raises(ConfigError) as info:
        export(run_folder, out)
    assert str(info.value).startswith(f"export.out={str(out)!r} holds files already (first: README.md): set ")
    assert files_of(out) == {"README.md": b"my own notes"}
    export(run_folder, out, "export.overwrite=true")
    assert "my own notes" not in (out / "README.md").read_text()


def test_export_replaces_links_and_gives_the_users_mode(run_folder: Path, tmp_path: Path, umask: int) -> None:
    """The probe's export through a link wrote into the file the link named; now the link is replaced."""
    out, outside = tmp_path / "out", tmp_path / "outside"
    out.mkdir()
    outside.mkdir()
    (outside / "victim.md").write_text("kept")
    (outside / "weights.safetensors").write_bytes(b"kept too")
    (out / "README.md").symlink_to(outside / "victim.md")
    (out / "comfyui_lora.safetensors").symlink_to(outside / "weights.safetensors")
    export(run_folder, out, "export.overwrite=true")
    assert files_of(outside) == {"victim.md": b"kept", "weights.safetensors": b"kept too"}
    for name in ("README.md", "comfyui_lora.safetensors", "kohya_lora.safetensors", "pytorch_lora_weights.safetensors"):
        path = out / name
        assert not path.is_symlink() and stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask, name
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]


def test_export_into_the_loras_own_folder_is_refused(run_folder: Path) -> None:
    lora = run_folder / "lora"
    before = files_of(lora)
    with pytest.raises(ConfigError) as info:
        export(run_folder, lora, "export.overwrite=true")
    message = str(info.value)
    assert message.startswith(f"export.out: {lora / 'pytorch_lora_weights.safetensors'} is the LoRA (") and (
        "an input of this command" in message
    )
    assert files_of(lora) == before


def test_a_lora_that_is_no_safetensors_file_is_named_in_one_line(run_folder: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken" / "pytorch_lora_weights.safetensors"
    broken.parent.mkdir()
    broken.write_bytes(b"\x00\x01 not safetensors")
    with pytest.raises(ConfigError, match="is not a readable safetensors file .*: give export.lora the"):
        export(run_folder, tmp_path / "out", f"export.lora={broken}")


# --- report.html -------------------------------------------------------------------------------------------------


def test_a_report_that_is_a_folder_is_named_and_leaves_no_temporary_file(tmp_path: Path) -> None:
    from qie.report import rebuild

    run = tmp_path / "run"
    (run / "report.html").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 0.5}\n')
    with pytest.raises(ConfigError) as info:
        rebuild(run)
    assert str(info.value) == f"the report {run / 'report.html'} is a folder: remove it or choose another path"
    assert sorted(p.name for p in run.iterdir()) == ["metrics.jsonl", "report.html"]
