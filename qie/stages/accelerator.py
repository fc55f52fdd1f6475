"""The training run's Accelerator: its processes joined, its mixed precision and seed decided once."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from qie.config.train import TrainConfig
from qie.runtime.memory import MemorySettings, enable_fsdp_on_cpu
from qie.stages.processes import warn_single_process
from qie.training.lookups import remember_package_lookups


def make_accelerator(train: TrainConfig, memory: MemorySettings, model_dtype: str, run_dir: Path) -> Any:
    """The run's Accelerator, seeded with `train.seed` (FSDP shards the family's transformer blocks, `memory`)."""
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    remember_package_lookups()
    accelerator = Accelerator(
        # Without CUDA, accelerate joins the processes of torchrun / `accelerate launch` only when told it
        # is on the CPU; otherwise each process would train alone.
        cpu=not torch.cuda.is_available(),
        mixed_precision=mixed_precision(str(train.mixed_precision), model_dtype),
        gradient_accumulation_steps=train.gradient_accumulation_steps,
        project_dir=str(run_dir),
        **memory.accelerator_kwargs(),
    )
    enable_fsdp_on_cpu(accelerator, memory)
    set_seed(train.seed)
    warn_single_process(accelerator.num_processes, "qie.train")
    return accelerator


def mixed_precision(setting: str, model_dtype: str) -> str:
    """`train.mixed_precision`, with "auto" meaning bf16 on CUDA for a bf16 model and "no" otherwise."""
    if setting == "auto":
        return "bf16" if torch.cuda.is_available() and model_dtype == "bfloat16" else "no"
    return setting
