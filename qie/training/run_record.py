"""What a checkpoint records of the run that wrote it, so a resume under another model or data set is refused.

`trainer_state.json` holds a `model` record (the model's name, variant and pipeline, a fingerprint of its
transformer checkpoint and what training changes of it: full weights or a LoRA of some rank, alpha, targets)
and a `data` record (how many samples, and a digest of their ids in order, which the resumable batch order
depends on). The transformer fingerprint hashes its config and the names and sizes of its weight files: a
stat per file, so a resume costs no read of a 40 GB checkpoint, yet another model or another size of it
differs. A base with LoRAs fused into it (`model.fuse_loras`) adds `fused_loras`: per file its name, a digest of
its bytes and its scale (`qie.adapters.fused_base`), so a resume on another fused base is refused too.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from qie.errors import ConfigError


def transformer_fingerprint(source: str, transformer_path: str | None, revision: str | None) -> str:
    """A digest of the transformer's config and weight files' names and sizes (a hub id: its config and revision)."""
    from qie.components import transformer_folder
    from qie.components.fingerprint import part_folder

    if transformer_path:
        folder = Path(transformer_folder(transformer_path))
    else:
        folder = part_folder(source, "transformer", revision)
    digest = hashlib.sha256(str(revision or "").encode() if not Path(source).is_dir() else b"")
    for path in sorted(folder.iterdir()) if folder.is_dir() else [folder] if folder.is_file() else []:
        if path.is_file() and not path.name.startswith("."):
            digest.update(path.name.encode() + b"\0")
            digest.update(path.read_bytes() if path.suffix == ".json" else str(path.stat().st_size).encode())
    return digest.hexdigest()[:16]


def model_record(spec: Any, fingerprint: str, mode: str, lora: dict | None, fused: list[dict] | None = None) -> dict:
    """The `model` record: spec (a ModelSpec) names the model; `lora` its rank, alpha, targets, init (or None);
    `fused` the LoRAs fused into its base (`FusedBase.record()`; none: no key, as records written before it)."""
    record = {
        "name": spec.name,
        "variant": str(spec.variant),
        "pipeline": spec.pipeline_class,
        "transformer": fingerprint,
        "mode": mode,
        "lora": lora,
    }
    return {**record, "fused_loras": fused} if fused else record


def data_record(ids: Sequence[str]) -> dict:
    """The `data` record: the number of samples and a digest of their ids, in training order."""
    return {"samples": len(ids), "digest": hashlib.sha256(json.dumps(list(ids)).encode()).hexdigest()[:16]}


def differences(saved: dict, now: dict, what: str) -> list[str]:
    """`what.key: saved -> now` for each key of the record that differs."""
    if not saved:  # a checkpoint written before records were kept
        return []
    return [
        f"{what}.{k}: {saved.get(k)!r} -> {now.get(k)!r}"
        for k in sorted(set(saved) | set(now))
        if saved.get(k) != now.get(k)
    ]


def check_resume(state: dict, folder: Path, model: dict, data: dict, inexact: bool) -> str | None:
    """Compare a checkpoint's records with this run's; returns a warning to print when `inexact` allows a mismatch.

    Raises:
        ConfigError: the checkpoint was trained on another model or data set (unless `inexact`).
    """
    found = differences(state.get("model", {}), model, "model") + differences(state.get("data", {}), data, "data")
    if not found:
        return None
    detail = "; ".join(found)
    if not inexact:
        raise ConfigError(
            f"checkpoint {folder} was trained on another model or data set ({detail}): resume it with the "
            "model and data.path it was trained on, or set train.resume_inexact=true to continue anyway"
        )
    return f"{folder} was trained on another model or data set ({detail}); resuming anyway (train.resume_inexact=true)"
