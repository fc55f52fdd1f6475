"""A base transformer with LoRAs fused into its weights (`model.fuse_loras`).

A LoRA trained on a base with a few-step LoRA (Lightning) fused in keeps its effect when the result samples at 4 or
8 steps. Each file is read as `predict.lora` is (any format qie reads), loaded with diffusers' `load_lora_adapter`
(`qie.adapters.lora.load_lora`), fused at its scale with the model's own `fuse_lora` and unloaded, one file after
another, once the transformer is loaded and before it is quantized or placed: `qie.components.build_parts` calls
`FusedBase.fuse_into` there, for every stage that builds a transformer (training and its validation, inference, the
merge). The base is named by the files' content fingerprints and scales: training records them (the checkpoints'
`trainer_state.json` and every LoRA file's header, `qie.adapters.lora_files.recorded_base`); inference compares a
LoRA's record with its own `model.fuse_loras` and refuses another base unless told (`check_lora_base`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qie.adapters.lora_files import recorded_base
from qie.errors import ConfigError, ModelLoadError


@dataclass(frozen=True)
class FusedLora:
    """One LoRA fused into the base: its file, its scale and a digest of the file's bytes."""

    file: Path
    scale: float
    fingerprint: str

    def record(self) -> dict:
        return {"file": self.file.name, "fingerprint": self.fingerprint, "scale": self.scale}


@dataclass(frozen=True)
class FusedBase:
    """The LoRAs fused into the transformer, in order; none: the plain base."""

    loras: tuple[FusedLora, ...] = ()

    @classmethod
    def of(cls, files: Sequence[str], scales: Sequence[float], loader: type) -> FusedBase:
        """Read and fingerprint `files` (`model.fuse_loras`), fused at `scales` (`model.fuse_lora_scales`; none
        given: 1.0 each), before any model is built.

        Args:
            loader: the family's diffusers LoRA loader (`ModelFamily.lora_loader_class()`), which reads the formats.

        Raises:
            ConfigError: not one scale per file.
            ModelLoadError: a file that is missing, unreadable or holds no transformer weights, naming its key.
        """
        from qie.adapters.lora import check_lora_file
        from qie.components.fingerprint import weight_hasher

        scales = list(scales) or [1.0] * len(files)
        if len(scales) != len(files):
            raise ConfigError(
                f"model.fuse_lora_scales has {len(scales)} entries and model.fuse_loras {len(files)}: "
                "give one scale per file, or none (each file fused at 1.0)"
            )
        hasher = weight_hasher()
        loras = []
        for i, (path, scale) in enumerate(zip(files, scales)):
            try:
                file = check_lora_file(path, loader)
            except ModelLoadError as e:
                raise ModelLoadError(f"model.fuse_loras[{i}]: {e}") from None
            loras.append(FusedLora(file, float(scale), hasher.hash(file)))
        try:
            hasher.save()
        except OSError:  # only a speed-up: a read-only QIE_HOME costs a re-hash next time
            pass
        return cls(tuple(loras))

    def fuse_into(self, transformer: Any) -> None:
        """Fuse each LoRA into `transformer`'s weights at its scale (diffusers' `fuse_lora`) and unload it.

        Raises:
            ModelLoadError: quantized weights, or a LoRA that does not fit the transformer (naming its key, the file
                and the module).
        """
        from qie.adapters.lora import load_lora, merge_lora
        from qie.components.quantize import is_quantized

        if self.loras and is_quantized(transformer):
            raise ModelLoadError(
                "model.fuse_loras fuses into plain weights, but this transformer's are quantized as "
                "they load: use model.quantize=none, fp8, int8 or int4 (fused first)"
            )
        for i, lora in enumerate(self.loras):
            try:
                load_lora(transformer, lora.file, lora.scale, adapter_name=f"fused_{i}")
            except ModelLoadError as e:
                raise ModelLoadError(f"model.fuse_loras[{i}]: {e}") from None
            merge_lora(transformer)  # fuses the one loaded adapter at its scale, then removes its layers

    def record(self) -> list[dict]:
        """What training records of this base: per LoRA its file name, fingerprint and scale."""
        return [lora.record() for lora in self.loras]


def describe(record: Sequence[dict]) -> str:
    """A fused base's record in words: "the plain base" or "a base fused with a.safetensors at 1.0 (3f2a9c1d0b4e)"."""
    if not record:
        return "the plain base (no model.fuse_loras)"
    loras = ", ".join(f"{r.get('file')} at {r.get('scale')} ({str(r.get('fingerprint'))[:12]})" for r in record)
    return f"a base fused with {loras}"


def _identity(record: Sequence[dict]) -> list[tuple[str, float]]:
    return sorted((str(r.get("fingerprint")), float(r.get("scale", 1.0))) for r in record)


def check_lora_base(path: str | Path, base: FusedBase, allow_other: bool = False) -> str | None:
    """Compare the fused base the LoRA at `path` was trained on (its header's record) with `base`.

    A LoRA that names no base (another tool's, or one from before qie kept the record) passes.

    Returns:
        None when they agree; a warning to print when they differ and `allow_other` (`predict.allow_other_base`).

    Raises:
        ConfigError: the bases differ (and not `allow_other`), naming both and what to set.
    """
    from qie.adapters.lora import lora_file

    file = lora_file(path)
    trained = recorded_base(file)
    if trained is None or _identity(trained) == _identity(base.record()):
        return None
    detail = f"LoRA {str(file)!r} was trained on {describe(trained)}, but this run uses {describe(base.record())}"
    if allow_other:
        return f"{detail}; using it anyway (predict.allow_other_base=true)"
    how = (
        "give the same model.fuse_loras (and model.fuse_lora_scales): qie fuses only the files you give"
        if trained
        else "leave model.fuse_loras empty"
    )
    raise ConfigError(f"{detail}: {how}, or set predict.allow_other_base=true to use it on this base")
