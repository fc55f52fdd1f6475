"""The processes of a several-process run (torchrun, `accelerate launch`): whether the launcher started as many as
asked, and leaving the process group at the end."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import Any


def launch_problem(num_processes: int, env: Mapping[str, str] | None = None) -> str | None:
    """Why this run has fewer processes than its launcher was asked for, or None.

    `accelerate launch --num_processes N` on a machine without GPUs runs the script once, as one process
    (its simple launcher sets MASTER_ADDR for N > 1, but starts no others and sets no WORLD_SIZE).
    """
    env = os.environ if env is None else env
    world = int(env.get("WORLD_SIZE") or 0)
    if world > num_processes:
        return f"the launcher started {world} processes, but this run joined {num_processes}"
    if num_processes == 1 and "MASTER_ADDR" in env and "ACCELERATE_MIXED_PRECISION" in env and not world:
        return "accelerate launch was asked for several processes but started one (it does so without GPUs)"
    return None


def elastic_problem(env: Mapping[str, str] | None = None) -> str | None:
    """Why torchrun's elastic restarts of this run would fail, or None: `--max-restarts` above 0 without
    `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`, where a restarted process may read its peer's address of the attempt
    before from the rendezvous' shared store and wait for it until the process group's timeout (pytorch#135712)."""
    env = os.environ if env is None else env
    restarts = int(env.get("TORCHELASTIC_MAX_RESTARTS") or 0)
    if restarts <= 0 or env.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE") == "1":
        return None
    return (
        f"torchrun --max-restarts={restarts} needs TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment: without "
        "it a restarted process may wait for a peer of the attempt before until the timeout (pytorch#135712); set "
        "it and start again (docs/cluster.md)"
    )


def leave_process_group(state: Any) -> None:
    """Leave the process group of a several-process run (torchrun) once every process is done: gloo's threads
    torn down during interpreter exit can abort a process ("terminate called without an active exception")
    after its work is complete, and the launcher then reports the run as failed."""
    import torch.distributed as dist

    if state.num_processes > 1 and dist.is_available() and dist.is_initialized():
        state.wait_for_everyone()
        dist.destroy_process_group()


def warn_single_process(num_processes: int, module: str) -> None:
    """Print how to run several CPU processes when the launcher silently started fewer (see `launch_problem`)."""
    problem = launch_problem(num_processes)
    if problem:
        print(
            f"qie: warning: {problem}. For N processes on CPUs use\n"
            f"  torchrun --standalone --nproc_per_node N -m {module} ...\n"
            "or  accelerate launch --multi_gpu --num_processes N --num_machines 1 --mixed_precision no "
            f"--dynamo_backend no -m {module} ...",
            file=sys.stderr,
            flush=True,
        )
