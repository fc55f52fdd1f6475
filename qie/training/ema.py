"""An exponential moving average (EMA) of the trained weights, updated after optimizer steps.

`train.ema.decay` d: every `train.ema.every` steps, ema = d * ema + (1 - d) * weights. The average lives in
float32 on the weights' device, or on the CPU with `train.ema.cpu` (no accelerator memory, a copy per update).
It is saved in checkpoints (`state/ema.safetensors`), so a resumed run continues it exactly, and exported as
its own LoRA (`lora/ema/`). Validation can sample with it (`validation.use_ema`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch

from qie.errors import ModelLoadError

EMA_FILE = "ema.safetensors"


class Ema:
    """The EMA of `params` (the trained parameters, in the optimizer's order)."""

    def __init__(self, params: Sequence[torch.nn.Parameter], decay: float, every: int = 1, cpu: bool = False) -> None:
        self.params, self.decay, self.every = list(params), float(decay), max(1, int(every))
        self.shadow = [p.detach().float().to("cpu" if cpu else p.device, copy=True) for p in self.params]

    @torch.no_grad()
    def update(self, step: int) -> None:
        """Move the average towards the weights, on every `every`-th optimizer step."""
        if step % self.every:
            return
        for s, p in zip(self.shadow, self.params):
            s.lerp_(p.detach().to(s.device, torch.float32), 1.0 - self.decay)

    def state(self) -> dict[str, torch.Tensor]:
        """The average as named tensors (for a checkpoint)."""
        return {f"{i:05d}": s.detach().cpu().contiguous() for i, s in enumerate(self.shadow)}

    def load(self, state: dict[str, torch.Tensor], file: Path) -> None:
        """Put a saved average back (resume).

        Raises:
            ModelLoadError: the file holds an average of other weights.
        """
        if len(state) != len(self.shadow):
            raise ModelLoadError(f"{file} holds {len(state)} averaged tensors, this run trains {len(self.shadow)}")
        for i, s in enumerate(self.shadow):
            saved = state[f"{i:05d}"]
            if saved.shape != s.shape:
                raise ModelLoadError(f"{file}: tensor {i} has shape {tuple(saved.shape)}, expected {tuple(s.shape)}")
            s.copy_(saved)

    @contextmanager
    def applied(self) -> Iterator[None]:
        """Within the block, the parameters hold the average (for exporting and sampling); restored after."""
        with torch.no_grad():
            kept = [p.detach().clone() for p in self.params]
            for s, p in zip(self.shadow, self.params):
                p.copy_(s.to(p.device, p.dtype))
        try:
            yield
        finally:
            with torch.no_grad():
                for k, p in zip(kept, self.params):
                    p.copy_(k)


def export_ema(
    ema: Ema, folder: Path, transformer: torch.nn.Module, exports: Sequence[str], base: Sequence[dict] | None = None
) -> Path:
    """Write the average as LoRA files in `folder/ema/` (main process), naming the fused `base` it was trained on
    (`save_lora`); returns the diffusers file."""
    from qie.adapters.lora import save_lora

    with ema.applied():
        return save_lora(transformer, folder / "ema", exports, base=base)


def write_ema(
    ema: Ema, folder: Path, transformer: torch.nn.Module, exports: Sequence[str], base: Sequence[dict] | None = None
) -> Path:
    """Write the average into a checkpoint folder: `state/ema.safetensors` (to resume) and its LoRA files in
    `ema/` (main process). Returns the EMA LoRA file."""
    from safetensors.torch import save_file

    (folder / "state").mkdir(parents=True, exist_ok=True)
    save_file(ema.state(), str(folder / "state" / EMA_FILE))
    return export_ema(ema, folder, transformer, exports, base)


def resume_ema(ema: Ema, checkpoint: Path, inexact: bool) -> None:
    """Put the average saved in `checkpoint` back.

    Raises:
        ModelLoadError: the checkpoint has no average (unless `inexact`: the average then starts from the weights).
    """
    from safetensors.torch import load_file

    file = checkpoint / "state" / EMA_FILE
    if not file.is_file():
        if inexact:
            print(f"qie: warning: {checkpoint} holds no EMA: it starts again from the resumed weights")
            ema.shadow = [p.detach().float().to(s.device, copy=True) for s, p in zip(ema.shadow, ema.params)]
            return
        raise ModelLoadError(
            f"{checkpoint} holds no {EMA_FILE} (trained without train.ema): resume with "
            "train.resume_inexact=true to start the EMA from its weights"
        )
    ema.load(load_file(str(file)), file)
