"""The extract stage: a LoRA from the difference between the base transformer (the `model` group: any hub id, folder
or single file qie reads, with its `model.fuse_loras`) and a tuned one (`extract.tuned`), by SVD per linear layer
(`qie.adapters.lora_extract`); MODEL is the base's model config (the name of a `conf/model/` file).

    python -m qie.extract_lora model=MODEL extract.tuned=RUN/transformer extract.rank=64 \
        extract.out=extracted/pytorch_lora_weights.safetensors
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from omegaconf import DictConfig

from qie.adapters.lora_extract import REPORT_FILE, Extraction, extract_lora, full_rank, write_extraction
from qie.adapters.lora_files import EXPORT_FILES
from qie.checks import Checked, check
from qie.components import LoadSettings, load_parts, prepare_model
from qie.config.export import ExtractConfig
from qie.config.model import ModelConfig
from qie.errors import ConfigError, ModelLoadError, check_writable
from qie.output_files import existing_problem, inputs_problem, replace_file
from qie.stages.recipe import Recipe
from qie.stages.settings import fused_base


def run(cfg: DictConfig, run_dir: Path | None = None) -> dict:
    """Extract, write the LoRA files and `extract_report.json` beside `extract.out`, print a summary (the stage from
    code: `cfg` checked once, `qie.checks.check`, then `start`); returns the report.

    Raises:
        ConfigError: `extract.tuned` or `extract.out` unset, a rank below 1 or one that makes every layer full, an
            output that is no .safetensors file, is (or lies inside) an input, or exists (without
            `extract.overwrite=true`).
        ModelLoadError: a transformer that cannot be loaded, or a tuned one of another architecture.
    """
    return start(check(cfg), run_dir)


def start(checked: Checked, run_dir: Path | None = None) -> dict:
    """The stage's edge: the checked config's `model` and `extract` groups handed to the `ExtractRecipe`. See
    `run`."""
    return ExtractRecipe(checked.root.model, checked.root.extract).execute()


class ExtractRecipe(Recipe):
    """The extract stage: `setup()` checks the settings and where it writes (no output an input, none replaced
    unless asked), loads both transformers and caps the rank; `run()` extracts the LoRA by SVD and writes its files
    and report.

    Args:
        model: the base's model group; settings: the `extract` group.
    """

    def __init__(self, model: ModelConfig, settings: ExtractConfig) -> None:
        self.model, self.settings = model, settings

    def setup(self) -> None:
        settings = self.settings
        self.out = _check(settings, self.model)
        # Plain weights to subtract: no quantization on either side.
        model = self.model = replace(self.model, quantize="none", single_file_fp8="upcast")
        self.spec = spec = prepare_model(model)
        self.fused = fused = fused_base(model, spec)
        self.base = load_parts(
            LoadSettings.of(model), spec, ["transformer"], {"transformer": "cpu"}, fuse=fused.fuse_into
        ).transformer
        self.settings = replace(settings, rank=_capped_rank(settings.rank, full_rank(self.base)))
        tuned_model = replace(model, transformer_path=settings.tuned, fuse_loras=[], fuse_lora_scales=[])
        try:
            parts = load_parts(LoadSettings.of(tuned_model), spec, ["transformer"], {"transformer": "cpu"})
        except ModelLoadError as e:  # it is read as model.transformer_path: name the key the user set
            raise ModelLoadError(str(e).replace("model.transformer_path=", "extract.tuned=")) from None
        self.tuned = parts.transformer

    def run(self) -> dict:
        model, settings, spec, out = self.model, self.settings, self.spec, self.out
        extraction = extract_lora(self.base, self.tuned, settings.rank, settings.device, settings.niter)
        if not extraction.layers:
            raise ConfigError(
                f"extract.tuned={settings.tuned!r} has the base's linear weights (model="
                f"{model.name}): nothing to extract; is it the tuned transformer?"
            )
        exports = [name for name, wanted in (("comfyui", settings.comfyui), ("kohya", settings.kohya)) if wanted]
        written = write_extraction(extraction, out, spec.family.lora_loader_class(), exports, self.fused.record())
        report = {"base": model.pretrained_model_name_or_path, "tuned": settings.tuned, **extraction.report()}
        report["files"] = [str(p) for p in written]
        text = json.dumps(report, indent=2)
        replace_file(out.parent / REPORT_FILE, lambda tmp: tmp.write_text(text, encoding="utf-8"), "extract.out's")
        print(summary(extraction, written, out.parent / REPORT_FILE))
        return report


def _capped_rank(rank: int, full: int) -> int:
    """`extract.rank`, refused when it makes every layer full rank (`full`: the largest layer's); each layer's rank
    is capped at its own size as it is extracted, which is said once here."""
    if rank >= full:
        raise ConfigError(
            f"extract.rank={rank} makes every layer full rank (the largest linear layer's rank is {full}): a LoRA of "
            f"that rank stores more numbers than the weights' change itself; give a rank below {full}"
        )
    return rank


def _outputs(settings: ExtractConfig, out: Path) -> list[Path]:
    """The files the stage writes: the LoRA, the other tools' files beside it and the report."""
    beside = [EXPORT_FILES[name] for name in ("comfyui", "kohya") if getattr(settings, name)]
    return [out, *(out.parent / name for name in (*beside, REPORT_FILE))]


def _inputs(settings: ExtractConfig, model: ModelConfig) -> dict[str, Path | None]:
    """The local files and folders the stage reads, by the setting that names them."""
    found = {"extract.tuned": Path(settings.tuned).expanduser()}
    for key in ("pretrained_model_name_or_path", "transformer_path"):
        value = getattr(model, key)
        found[f"model.{key}"] = Path(value).expanduser() if value else None
    found.update({f"model.fuse_loras[{i}]": Path(f).expanduser() for i, f in enumerate(model.fuse_loras)})
    return found


def _check(settings: ExtractConfig, model: ModelConfig) -> Path:
    """The output file, its folder writable, none of its files an input, none there already unless replaced on
    purpose (`extract.overwrite`); the settings that cannot work named."""
    if not settings.tuned:
        raise ConfigError(
            "extract.tuned is not set: give the tuned transformer, a diffusers folder (a full "
            "fine-tune's RUN/transformer) or a .safetensors file"
        )
    if not settings.out:
        raise ConfigError(
            "extract.out is not set: give the LoRA file to write, e.g. "
            "extract.out=extracted/pytorch_lora_weights.safetensors"
        )
    out = Path(settings.out).expanduser()
    if out.suffix != ".safetensors":
        raise ConfigError(f"extract.out={settings.out!r} is not a .safetensors file name: end it in .safetensors")
    outputs = _outputs(settings, out)
    if problem := inputs_problem(outputs, _inputs(settings, model), "extract.out"):
        raise ConfigError(problem)
    if not settings.overwrite and (problem := existing_problem(outputs, "extract.out", "extract.overwrite")):
        raise ConfigError(problem)
    check_writable(out.parent, "extract.out's folder")
    return out


def summary(extraction: Extraction, written: list[Path], report: Path) -> str:
    """The lines the stage prints: the fit, what a LoRA cannot carry, the files."""
    r = extraction.report()
    worst = max(extraction.layers, key=lambda fit: fit.relative_error)
    lines = [
        f"qie: extracted a rank-{extraction.rank} LoRA from {r['changed_layers']} changed linear layers "
        f"({len(extraction.unchanged)} unchanged); relative error of each layer's reconstruction: mean "
        f"{r['mean_relative_error']:.4g}, worst {worst.relative_error:.4g} ({worst.name})",
    ]
    capped = [fit for fit in extraction.layers if fit.rank < extraction.rank]
    if capped:
        lines.append(
            f"qie: extract.rank={extraction.rank} is above the size of {len(capped)} of the changed layers: each of "
            f"those keeps its full rank (from {min(f.rank for f in capped)} to {max(f.rank for f in capped)}), "
            "recorded in the file's rank pattern"
        )
    if extraction.not_carried:
        name, worst_change = max(extraction.not_carried.items(), key=lambda kv: kv[1]["relative_change"])
        lines.append(
            f"qie: not carried by a LoRA: {len(extraction.not_carried)} changed parameter(s) that are no linear "
            f"weight (biases, norms, ...), the largest relative change {worst_change['relative_change']:.3g} in "
            f"{name} ({worst_change['kind']})"
        )
    lines += [
        f"qie: each layer's error and what is not carried: {report}",
        "qie: wrote " + ", ".join(map(str, written)),
    ]
    return "\n".join(lines)
