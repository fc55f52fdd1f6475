"""A LoRA from the difference of two transformers of one architecture (a full fine-tune, an RL checkpoint, a merged
model against its base): per linear layer, the truncated SVD of the weight change.

A linear layer's change dW (out x in) is factored as dW ~ up @ down with the `rank` largest singular values split
evenly (up = U sqrt(S), down = sqrt(S) Vh): the best rank-`rank` approximation in the Frobenius norm (Eckart-Young),
whose relative error is sqrt(sum of the dropped S^2 / sum of all S^2). The pair is stored at scale 1 (alpha = rank,
as every file qie writes: `qie.adapters.lora_files`), so every tool applies exactly up @ down.

A LoRA changes linear weights only: a changed bias, norm weight or any other parameter is not carried; each is
reported with its relative change, so a user sees what the LoRA leaves out.
"""

from __future__ import annotations

import functools
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from qie.adapters.lora_files import stamp_base, write_exports
from qie.errors import ModelLoadError
from qie.output_files import replace_file

REPORT_FILE = "extract_report.json"  # beside the files: each layer's error, what is not carried


@dataclass(frozen=True)
class LayerFit:
    """One linear layer's factored change: its rank and the relative error of the reconstruction."""

    name: str
    rank: int
    relative_error: float


@dataclass
class Extraction:
    """The extracted LoRA (peft names, `<module>.lora_A.weight` / `.lora_B.weight`, at scale 1), each layer's fit,
    the linear layers that did not change, and the changed parameters a LoRA cannot carry (name -> relative change
    ||dP|| / ||P||, with what the parameter is)."""

    rank: int
    state: dict[str, torch.Tensor] = field(default_factory=dict)
    layers: list[LayerFit] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    not_carried: dict[str, dict] = field(default_factory=dict)

    def report(self) -> dict:
        """What the extraction did, as JSON-ready data."""
        errors = [fit.relative_error for fit in self.layers]
        return {
            "rank": self.rank,
            "changed_layers": len(self.layers),
            "mean_relative_error": sum(errors) / len(errors) if errors else 0.0,
            "max_relative_error": max(errors, default=0.0),
            "layers": {fit.name: {"rank": fit.rank, "relative_error": fit.relative_error} for fit in self.layers},
            "unchanged_layers": self.unchanged,
            "not_carried": self.not_carried,
        }


def low_rank(
    change: torch.Tensor, rank: int, device: str | torch.device = "cpu", niter: int = 0
) -> tuple[torch.Tensor, ...]:
    """(down (r x in), up (out x r), relative error) of the best rank-r factoring of `change`, r = `rank` capped at
    the layer's smaller side (a larger rank would only add zeros), computed in float32 on `device`, returned on the
    CPU.

    Args:
        niter: 0: the exact SVD (`torch.linalg.svd`); else a randomized one of `niter` subspace iterations
            (`torch.svd_lowrank`, `rank` + 8 directions), far quicker on large layers; its error is measured on the
            residual.
    """
    matrix = change.to(device, torch.float32)
    randomized = niter > 0 and rank + 8 < min(matrix.shape)
    if randomized:
        u, s, v = torch.svd_lowrank(matrix, q=rank + 8, niter=niter)
        vh = v.T
    else:
        u, s, vh = torch.linalg.svd(matrix, full_matrices=False)
    kept = min(rank, s.numel())
    root = s[:kept].sqrt()
    up, down = u[:, :kept] * root, root[:, None] * vh[:kept]
    total = matrix.norm()
    if total == 0:
        error = s.new_zeros(())
    elif randomized:  # the dropped singular values are not known: the residual itself
        error = (matrix - up @ down).norm() / total
    else:  # Eckart-Young: the dropped singular values make the whole error (exact, no cancellation)
        error = s[kept:].norm() / total
    return down.cpu().contiguous(), up.cpu().contiguous(), error.cpu()


def extract_lora(
    base: torch.nn.Module, tuned: torch.nn.Module, rank: int, device: str | torch.device = "cpu", niter: int = 0
) -> Extraction:
    """The rank-`rank` LoRA that turns `base`'s linear weights into `tuned`'s, and what it leaves out (`device`,
    `niter`: where and how each layer's SVD runs, see `low_rank`).

    Raises:
        ModelLoadError: the two transformers do not have the same parameters and shapes.
    """
    base_params, tuned_params = dict(base.named_parameters()), dict(tuned.named_parameters())
    _check_same_layout(base_params, tuned_params)
    linear = {f"{name}.weight": name for name, m in base.named_modules() if isinstance(m, torch.nn.Linear)}
    kinds = {
        f"{name}.{p}": type(m).__name__ for name, m in base.named_modules() for p, _ in m.named_parameters("", False)
    }
    out = Extraction(rank)
    for key, weight in base_params.items():
        change = tuned_params[key].detach().float() - weight.detach().float()
        if key in linear:
            if not bool(change.any()):
                out.unchanged.append(linear[key])
                continue
            down, up, error = low_rank(change, rank, device, niter)
            out.state[f"{linear[key]}.lora_A.weight"] = down
            out.state[f"{linear[key]}.lora_B.weight"] = up
            out.layers.append(LayerFit(linear[key], down.shape[0], float(error)))
        elif bool(change.any()):
            size = weight.detach().float().norm()
            relative = float(change.norm() / size) if size > 0 else float("inf")
            out.not_carried[key] = {"relative_change": relative, "kind": _kind(key, kinds)}
    return out


def full_rank(base: torch.nn.Module) -> int:
    """The largest rank a linear layer of `base` has (its smaller side): a LoRA of that rank stores every layer's
    change whole, in more numbers than the change itself."""
    return max((min(m.weight.shape) for m in base.modules() if isinstance(m, torch.nn.Linear)), default=0)


def _kind(key: str, kinds: dict[str, str]) -> str:
    """What a parameter is, for the report: `bias of Linear`, `weight of RMSNorm`, ..."""
    return f"{key.rpartition('.')[2]} of {kinds.get(key, 'the model')}"


def _check_same_layout(base: dict[str, torch.Tensor], tuned: dict[str, torch.Tensor]) -> None:
    missing = sorted(set(base) ^ set(tuned))
    if missing:
        side = "the tuned" if missing[0] in base else "the base"
        raise ModelLoadError(
            f"extract.tuned is not a fine-tune of this base: {side} transformer lacks parameter "
            f"{missing[0]!r} ({len(missing)} differ): give the base it was trained from (model=...)"
        )
    for key, value in base.items():
        if value.shape != tuned[key].shape:
            raise ModelLoadError(
                f"extract.tuned is not a fine-tune of this base: parameter {key!r} has shape "
                f"{tuple(tuned[key].shape)} there and {tuple(value.shape)} in the base (model=...)"
            )


def write_extraction(
    extraction: Extraction, out: Path, loader: type, exports: Sequence[str] = (), base: Sequence[dict] | None = None
) -> list[Path]:
    """Write the LoRA as `out` (diffusers format, read by `load_lora_weights`), the files `exports` names
    ("comfyui", "kohya") beside it, all naming the fused `base` in their headers. Returns the files written."""
    modules = sorted({key.rpartition(".lora_")[0] for key in extraction.state})
    # A layer whose rank was capped at its size keeps it in the patterns; alpha = rank everywhere (scale 1).
    pattern = {fit.name: fit.rank for fit in extraction.layers if fit.rank != extraction.rank}
    metadata = {
        "r": extraction.rank,
        "lora_alpha": float(extraction.rank),
        "lora_dropout": 0.0,
        "target_modules": modules,
        "rank_pattern": pattern,
        "alpha_pattern": {name: float(rank) for name, rank in pattern.items()},
        "use_dora": False,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".qie-extract.", dir=out.parent) as folder:
        staged = Path(folder)
        loader.save_lora_weights(
            staged,
            transformer_lora_layers=extraction.state,
            weight_name=out.name,
            safe_serialization=True,
            transformer_lora_adapter_metadata=metadata,
        )
        stamp_base(staged / out.name, base)
        written = [staged / out.name, *write_exports(staged, extraction.state, exports, None, base)]
        # Each renamed onto its place: a link there is replaced, never written through.
        return [replace_file(out.parent / f.name, functools.partial(shutil.move, f), "extract.out") for f in written]
