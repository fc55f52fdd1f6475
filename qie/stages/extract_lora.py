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

from qie.adapters.lora_extract import REPORT_FILE, Extraction, extract_lora, write_extraction
from qie.components import LoadSettings, load_parts, prepare_model
from qie.config import typed, validate
from qie.config.export import ExtractConfig
from qie.errors import ConfigError, ModelLoadError, check_writable
from qie.stages.settings import fused_base


def run(cfg: DictConfig, run_dir: Path | None = None) -> dict:
    """Extract, write the LoRA files and `extract_report.json` beside `extract.out`, print a summary; returns the
    report. The stage's edge: the one place that reads `cfg`.

    Raises:
        ConfigError: `extract.tuned` or `extract.out` unset, a rank below 1, an output that is no .safetensors file.
        ModelLoadError: a transformer that cannot be loaded, or a tuned one of another architecture.
    """
    validate(cfg)
    model, settings = typed(cfg.model), typed(cfg.extract)
    out = _check(settings)
    # Plain weights to subtract: no quantization on either side.
    model = replace(model, quantize="none", single_file_fp8="upcast")
    spec = prepare_model(model)
    fused = fused_base(model, spec)
    base = load_parts(
        LoadSettings.of(model), spec, ["transformer"], {"transformer": "cpu"}, fuse=fused.fuse_into
    ).transformer
    tuned_model = replace(model, transformer_path=settings.tuned, fuse_loras=[], fuse_lora_scales=[])
    try:
        tuned = load_parts(LoadSettings.of(tuned_model), spec, ["transformer"], {"transformer": "cpu"}).transformer
    except ModelLoadError as e:  # it is read as model.transformer_path: name the key the user set
        raise ModelLoadError(str(e).replace("model.transformer_path=", "extract.tuned=")) from None
    extraction = extract_lora(base, tuned, settings.rank, settings.device, settings.niter)
    if not extraction.layers:
        raise ConfigError(
            f"extract.tuned={settings.tuned!r} has the base's linear weights (model="
            f"{model.name}): nothing to extract; is it the tuned transformer?"
        )
    exports = [name for name in ("comfyui", "kohya") if getattr(settings, name)]
    written = write_extraction(extraction, out, spec.family.lora_loader_class(), exports, fused.record())
    report = {"base": model.pretrained_model_name_or_path, "tuned": settings.tuned, **extraction.report()}
    report["files"] = [str(p) for p in written]
    (out.parent / REPORT_FILE).write_text(json.dumps(report, indent=2), encoding="utf-8")
    print(summary(extraction, written, out.parent / REPORT_FILE))
    return report


def _check(settings: ExtractConfig) -> Path:
    """The output file, its folder writable; the settings that cannot work named."""
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
