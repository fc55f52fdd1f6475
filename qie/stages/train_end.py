"""How a training run saves its state and ends: the checkpoints it saves (`Checkpoints`: the state, its mode's exports,
the records resume compares, the EMA weights and what the objective keeps), and at its end the trained weights
exported, `train_result.json` and the report written, and the replicas compared (`finish`)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from qie.config.train import TrainConfig
from qie.runtime.memory import full_tensor
from qie.stages.train_extras import lora_exports
from qie.stages.train_report import refresh_report
from qie.training import checkpoint as ckpt
from qie.training.ema import Ema, export_ema, write_ema
from qie.training.loop import TrainState
from qie.training.modes import TrainMode
from qie.training.objective_state import write_kept

RESULT_FILE = "train_result.json"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Checkpoints:
    """How the run saves a checkpoint: the state with its mode's exports, the records resume compares, the EMA
    weights, the run's id in its output store; the run's report refreshed but at the last step (written by
    `finish`, with the run's result)."""

    state: TrainState
    run_dir: Path
    mode: TrainMode
    train: TrainConfig
    records: tuple[dict, dict]
    ema: Ema | None
    run_id: str | None = None  # the run's id in its output store (`run.output_url`), recorded in each checkpoint
    kept: Mapping[str, Mapping[str, torch.Tensor]] = dataclasses.field(default_factory=dict)  # `ObjectiveContext.keep`

    def save(self, step: int, consumed: int) -> Path:
        state, ema, mode, train = self.state, self.ema, self.mode, self.train
        info = {
            "step": step,
            "batches_consumed": consumed,
            "num_processes": state.accelerator.num_processes,
            "model": self.records[0],
            "data": self.records[1],
            **({"run": self.run_id} if self.run_id is not None else {}),
        }
        exports, model = lora_exports(train), state.accelerator.unwrap_model(state.model)

        def extra(folder: Path) -> None:
            write_kept(folder, self.kept)
            if ema is not None:
                write_ema(ema, folder, model, exports, mode.base)

        folder = ckpt.save_checkpoint(
            state, self.run_dir, state=info, mode=mode, exports=exports, keep=train.checkpoints_total_limit, extra=extra
        )
        if step < train.max_steps:
            refresh_report(self.run_dir, state.accelerator)
        return folder


def finish(
    state: TrainState, mode: TrainMode, run_dir: Path, result: dict, exports: tuple[str, ...], ema: Ema | None = None
) -> None:
    """Check the replicas agree, export the trained weights and write train_result.json (main process)."""
    accelerator = state.accelerator
    result["param_checksums"] = _gather_checksums(accelerator, state.params)
    result["ranks_agree"] = all(c == result["param_checksums"][0] for c in result["param_checksums"])
    key, path = mode.export(accelerator.unwrap_model(state.model), run_dir, exports, write=accelerator.is_main_process)
    if accelerator.is_main_process:
        result[key] = str(path)
        if ema is not None:  # beside the raw LoRA: lora/ema/
            model = accelerator.unwrap_model(state.model)
            result["ema_lora"] = str(export_ema(ema, path.parent, model, exports, mode.base))
        (run_dir / RESULT_FILE).write_text(json.dumps(result, indent=2))
        report = refresh_report(run_dir, accelerator)
        if not result["ranks_agree"]:
            print(f"qie: warning: the processes' weights differ at the end: {result['param_checksums']}")
        how = f"stopped by signal {result['signal']}" if result["stopped_by_signal"] else "trained"
        how = "stopped by an error" if result.get("error") else how
        if result.get("stopped_by_time"):
            how = "stopped by the time budget (train.max_minutes)"
        last = f"last loss {result['loss']:.4g}" if result["losses"] else "no step left (train.max_steps reached)"
        print(f"qie: {how} at step {result['step']}, {last}; weights: {path}")
        if result["stopped_by_signal"] or result.get("stopped_by_time"):
            print(f"qie: continue with train.resume=latest hydra.run.dir={run_dir}")
        print(f"qie: metrics {run_dir / 'metrics.jsonl'}, TensorBoard: tensorboard --logdir {run_dir / 'tensorboard'}")
        if report is not None:
            print(f"qie: report {report}")
    # Free the DDP wrapper while the process group is still registered: a gloo group whose last owner is
    # DDP's reducer is destroyed holding the GIL, which deadlocks with gloo's threads (pytorch#56297). A single
    # process has no group: its collector pass over every object (half a second) is not needed.
    state.model = None
    if accelerator.num_processes > 1:
        accelerator.free_memory()
    accelerator.end_training()


def _gather_checksums(accelerator: Any, params: list[torch.nn.Parameter]) -> list[list[float]]:
    """Per process, the sum and the sum of squares of the trained weights: equal when replicas agree."""
    trained = [full_tensor(p.detach()).double() for p in params if p.requires_grad]
    local = torch.stack([torch.stack([p.sum(), p.pow(2).sum()]) for p in trained]).sum(0)
    gathered = accelerator.gather(local.to(accelerator.device).unsqueeze(0))
    return gathered.cpu().tolist()


__all__ = ["RESULT_FILE", "Checkpoints", "finish"]
