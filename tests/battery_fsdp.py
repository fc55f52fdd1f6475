"""The battery's two-process cases (`train.fsdp=true`, online RL) for every family in ONE pair of processes (a
process start costs seconds):

    torchrun --standalone --nproc_per_node 2 tests/battery_fsdp.py JOBS.json RESULTS.json

JOBS.json lists {"key", "overrides", "run_dir"}; each is trained in turn through the train stage, and the main
process writes {key: {"losses", "ranks_agree", "lora", "steps"} or {"error"}} to RESULTS.json ("steps": the lines of
the run's metrics.jsonl that hold a loss). A job that fails is recorded and the next one runs. Used by
tests/test_family_battery.py.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path


def train_one(job: dict) -> dict:
    from qie.checks import compose
    from qie.stages import train

    run_dir = Path(job["run_dir"])
    result = train.run(compose("train", job["overrides"]), run_dir)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines() if (run_dir / "metrics.jsonl").is_file() else []
    steps = [r for r in map(json.loads, lines) if "loss" in r]
    return {
        "losses": result["losses"],
        "ranks_agree": result["ranks_agree"],
        "lora": result.get("lora"),
        "steps": steps,
    }


def main(jobs_file: str, results_file: str) -> None:
    import torch.distributed as dist
    from accelerate.state import AcceleratorState, PartialState

    # Each run would end the process group (`Accelerator.end_training`); joining a new one in the same
    # processes hangs under torchrun, so the group is kept for all runs and ended once at the end.
    PartialState.destroy_process_group = lambda self, group=None: None
    results = {}
    for job in json.loads(Path(jobs_file).read_text()):
        try:
            results[job["key"]] = train_one(job)
        except Exception as e:  # recorded per job: the test names the family and the error
            results[job["key"]] = {"error": f"{type(e).__name__}: {e}".splitlines()[0]}
            traceback.print_exc()
        # The next run's Accelerator starts from fresh settings (FSDP plugin, mixed precision), as in a new process.
        AcceleratorState._reset_state()
        if os.environ.get("RANK", "0") == "0":
            Path(results_file).write_text(json.dumps(results, indent=2))
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:3])
