"""The record a training run keeps of how it was run (`run_info.json` in the run folder): the command that
reproduces it, its resolved config and its environment (versions, device, processes). Its report reads it; it is
written when the run starts, since a report rebuilt later must not describe the machine that rebuilds it."""

from __future__ import annotations

import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

RUN_INFO = "run_info.json"
PACKAGES = ("qie", "torch", "diffusers", "transformers", "peft", "accelerate", "safetensors", "hydra-core")


def environment(device: str, processes: int, mixed_precision: str) -> dict[str, Any]:
    """Versions of Python and the packages a run depends on, the platform, and the device the run trains on."""
    from importlib import metadata  # a tenth of a second: only when a run records its environment

    import torch

    versions = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "not installed"
    hardware = {
        "device": device,
        "processes": processes,
        "mixed_precision": mixed_precision,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }
    if torch.cuda.is_available():
        hardware["gpu"] = torch.cuda.get_device_name()
        hardware["cuda"] = torch.version.cuda
    return {"versions": versions, "platform": platform.platform(), "executable": sys.executable, **hardware}


def write_run_info(run_dir: Path, command: str, config: dict, env: dict[str, Any]) -> Path:
    """Write `run_dir/run_info.json` (atomically); its path."""
    path = run_dir / RUN_INFO
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps({"command": command, "config": config, "environment": env}, indent=2, default=str))
    os.replace(tmp, path)
    return path
