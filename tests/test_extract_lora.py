"""LoRA extraction (`python -m qie.extract_lora`): the SVD of each linear layer's change, loaded by diffusers'
`load_lora_weights`, brings the base's output most of the way to the tuned model's; what a LoRA cannot carry is
reported."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import tiny_pipeline

from qie.checks import compose
from qie.errors import ConfigError, ModelLoadError
from qie.stages import extract_lora


def tuned_transformer(tiny_path: Path, out: Path) -> dict[str, float]:
    """The tiny base transformer with a rank-2 change in every block's linear layers, a changed bias and a changed
    norm weight, saved as a diffusers folder `out`; returns the changed non-linear parameters and their sizes."""
    from diffusers import QwenImageTransformer2DModel

    model = QwenImageTransformer2DModel.from_pretrained(tiny_path / "transformer")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and name.startswith("transformer_blocks."):
                rows, cols = module.weight.shape
                module.weight += 0.05 * torch.randn(rows, 2, generator=gen) @ torch.randn(2, cols, generator=gen)
        model.transformer_blocks[0].attn.to_q.bias += 0.01
        model.transformer_blocks[0].attn.norm_q.weight += 0.01
    model.save_pretrained(out)
    return {"transformer_blocks.0.attn.to_q.bias": 0.01, "transformer_blocks.0.attn.norm_q.weight": 0.01}


def transformer_output(transformer: torch.nn.Module) -> torch.Tensor:
    """The transformer's prediction on fixed inputs (16 image tokens, 5 text tokens)."""
    gen = torch.Generator().manual_seed(1)
    inputs = {
        "hidden_states": torch.randn(1, 16, 16, generator=gen),
        "encoder_hidden_states": torch.randn(1, 5, 16, generator=gen),
        "timestep": torch.tensor([0.5]),
        "img_shapes": [[(1, 4, 4)]],
        "return_dict": False,
    }
    with torch.no_grad():
        return transformer(**inputs)[0]


def test_extracted_lora_moves_the_base_to_the_tuned_model(tiny_path: Path, tmp_path: Path, capsys) -> None:
    from diffusers import QwenImageEditPipeline, QwenImageTransformer2DModel

    changed = tuned_transformer(tiny_path, tmp_path / "run" / "transformer")
    out = tmp_path / "extracted" / "pytorch_lora_weights.safetensors"
    cfg = compose(
        "extract_lora", ["model=tiny", f"extract.tuned={tmp_path / 'run'}", "extract.rank=4", f"extract.out={out}"]
    )
    report = extract_lora.run(cfg)

    # Rank 2 changes at rank 4: every layer reconstructed to float32 rounding; 28 block layers changed, 6 not.
    assert report["changed_layers"] == 28 and len(report["unchanged_layers"]) == 6
    assert report["max_relative_error"] < 1e-5
    assert sorted(report["not_carried"]) == sorted(changed)
    assert report["not_carried"]["transformer_blocks.0.attn.norm_q.weight"]["kind"] == "weight of RMSNorm"
    assert json.loads((out.parent / "extract_report.json").read_text())["layers"] == report["layers"]
    assert {p.name for p in out.parent.iterdir()} == {
        out.name,
        "comfyui_lora.safetensors",
        "kohya_lora.safetensors",
        "extract_report.json",
    }
    printed = capsys.readouterr().out
    assert "not carried by a LoRA: 2 changed parameter(s)" in printed
    assert "transformer_blocks.0.attn.to_q.bias (bias of Linear)" in printed

    tuned = transformer_output(QwenImageTransformer2DModel.from_pretrained(tmp_path / "run" / "transformer"))
    pipe = tiny_pipeline(QwenImageEditPipeline, tiny_path)
    base = transformer_output(pipe.transformer)
    pipe.load_lora_weights(str(out.parent), weight_name=out.name)
    with_lora = transformer_output(pipe.transformer)
    # What is left is the bias and norm change alone: the LoRA closes all but a few thousandths of the gap.
    ratio = float((with_lora - tuned).norm() / (base - tuned).norm())
    assert ratio < 0.02, ratio  # measured 0.0042

    # Exported, its card says how it was made.
    from qie.stages import export

    export.run(
        compose(
            "export", [f"export.run_dir={tmp_path / 'run'}", f"export.out={tmp_path / 'shared'}", f"export.lora={out}"]
        )
    )
    card = (tmp_path / "shared" / "README.md").read_text()
    assert "extracted at rank 4" in card and "2 changed parameters a LoRA cannot carry" in card
    assert (tmp_path / "shared" / "extract_report.json").read_text() == (out.parent / "extract_report.json").read_text()


def test_extract_names_what_is_missing_or_does_not_fit(tiny_path: Path, tmp_path: Path) -> None:
    from diffusers import QwenImageTransformer2DModel

    out = f"extract.out={tmp_path / 'x.safetensors'}"
    with pytest.raises(ConfigError, match="extract.tuned is not set"):
        extract_lora.run(compose("extract_lora", ["model=tiny", out]))
    with pytest.raises(ConfigError, match="extract.out=.* is not a .safetensors file"):
        extract_lora.run(compose("extract_lora", ["model=tiny", f"extract.tuned={tiny_path}", "extract.out=a.pt"]))
    with pytest.raises(ModelLoadError, match="extract.tuned=.*nowhere' does not exist"):
        extract_lora.run(compose("extract_lora", ["model=tiny", f"extract.tuned={tmp_path / 'nowhere'}", out]))
    # Nothing changed: the base itself as the tuned model.
    with pytest.raises(ConfigError, match="has the base's linear weights"):
        extract_lora.run(compose("extract_lora", ["model=tiny", f"extract.tuned={tiny_path}", out]))
    with pytest.raises(ModelLoadError, match="not a fine-tune of this base"):
        config = dict(QwenImageTransformer2DModel.load_config(tiny_path / "transformer"), num_layers=1)
        QwenImageTransformer2DModel.from_config(config).save_pretrained(tmp_path / "other")
        extract_lora.run(compose("extract_lora", ["model=tiny", f"extract.tuned={tmp_path / 'other'}", out]))


@pytest.mark.parametrize("niter", [0, 4])
def test_each_layers_error_is_that_of_its_reconstruction(niter: int) -> None:
    """The exact SVD and the randomized one (`extract.niter`) report the relative error the factors really have."""
    from qie.adapters.lora_extract import low_rank

    gen = torch.Generator().manual_seed(3)
    change = torch.randn(200, 3, generator=gen) @ torch.randn(3, 120, generator=gen)
    change += 0.05 * torch.randn(200, 120, generator=gen)
    down, up, error = low_rank(change, 3, niter=niter)
    assert down.shape == (3, 120) and up.shape == (200, 3)
    real = float((change - up @ down).norm() / change.norm())
    assert abs(float(error) - real) < 1e-4 and 0.01 < real < 0.2
    exact = low_rank(change, 3)[2]
    assert abs(float(error) - float(exact)) < 1e-3  # the randomized SVD finds the same best factors
    # A layer narrower than the rank keeps its own full rank (no zeros padded up to the rank), exact.
    down, up, error = low_rank(change[:, :2], 3)
    assert down.shape == (2, 2) and up.shape == (200, 2)
    assert torch.allclose(up @ down, change[:, :2], atol=1e-5) and float(error) < 1e-6
