"""What is trained: a LoRA on the frozen transformer, or the whole transformer. A small strategy the train
stage picks once from `train.mode`; nothing else compares mode names."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import safetensors.torch
import torch

from qie.adapters.lora import LORA_FILE, add_lora, continue_lora, dead_modules, lora_state_dict, save_lora
from qie.components.quantize import is_quantized
from qie.errors import ConfigError
from qie.runtime.memory import full_state_dict


@dataclass(frozen=True, kw_only=True)
class LoraMode:
    """Train a LoRA adapter; checkpoints and the result hold the adapter only."""

    rank: int = 16
    alpha: int = 16
    target_modules: list[str] = field(default_factory=lambda: ["to_q", "to_k", "to_v", "to_out.0"])
    dropout: float = 0.0
    init: str = "true"
    # A LoRA file to go on training (`train.init_lora`): it sets the rank, alpha and modules.
    init_lora: str | None = None
    adapter: str = "lora"  # "lora", "loha" or "lokr"
    use_dora: bool = False
    # The LoRAs fused into the base it trains on (`FusedBase.record()`; empty: the plain base), named in the header
    # of every LoRA file written (`qie.adapters.lora_files.recorded_base`).
    base: tuple[dict, ...] = ()
    lora = True
    # A checkpoint keeps the trained weights only: the frozen base is loaded again on resume.
    saves_whole_model = False

    def trainable(self, transformer: torch.nn.Module) -> list[torch.nn.Parameter]:
        """Add the adapter (or load `init_lora`); returns its parameters (what the optimizer trains)."""
        if self.init_lora:
            return continue_lora(transformer, self.init_lora)
        return add_lora(
            transformer,
            rank=self.rank,
            alpha=self.alpha,
            target_modules=list(self.target_modules),
            dropout=self.dropout,
            init=self.init,
            adapter=self.adapter,
            use_dora=self.use_dora,
        )

    def export(
        self, transformer: torch.nn.Module, run_dir: Path, exports: Sequence[str] = (), write: bool = True
    ) -> tuple[str, Path]:
        """Write the trained weights (when `write`; every process calls it), with the other tools' files
        `exports` names; returns (result key, path)."""
        state = lora_state_dict(transformer)  # gathers sharded weights: a collective under FSDP
        folder = run_dir / "lora"
        written = save_lora(transformer, folder, exports, state=state, base=self.base) if write else folder / LORA_FILE
        return "lora", written

    def checkpoint_weights(self, transformer: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The weights a checkpoint keeps: the adapter's (gathered: a collective under FSDP, every process)."""
        return lora_state_dict(transformer)

    def write_checkpoint(
        self, transformer: torch.nn.Module, folder: Path, exports: Sequence[str], weights: dict, state_file: Path | None
    ) -> None:
        """Write the adapter into a checkpoint `folder` as a LoRA file (with the other tools' files `exports`
        names), and into `state_file` for resuming (None: the sharded state was written instead)."""
        save_lora(transformer, folder, exports, state=weights, base=self.base)
        if state_file is not None:
            safetensors.torch.save_file(weights, str(state_file))


@dataclass(frozen=True)
class FullMode:
    """Train every transformer weight that reaches the loss; the result is a diffusers model folder."""

    lora = False
    saves_whole_model = True
    base = None  # its result is a whole transformer, the fused LoRAs in it: no LoRA file names a base

    def trainable(self, transformer: torch.nn.Module) -> list[torch.nn.Parameter]:
        """Unfreeze the transformer (but modules whose output never reaches the loss).

        Raises:
            ConfigError: the transformer's weights are quantized.
        """
        if is_quantized(transformer):
            raise ConfigError("train.mode=full cannot train quantized weights: set model.quantize=none")
        transformer.requires_grad_(True)
        for name in dead_modules(transformer):
            transformer.get_submodule(name).requires_grad_(False)
        return [p for p in transformer.parameters() if p.requires_grad]

    def export(
        self, transformer: torch.nn.Module, run_dir: Path, exports: Sequence[str] = (), write: bool = True
    ) -> tuple[str, Path]:
        state = full_state_dict(transformer)  # gathers sharded weights: a collective under FSDP
        folder = run_dir / "transformer"
        if write and state is None:
            transformer.save_pretrained(folder)
        elif write:  # the same files as save_pretrained's, from the gathered weights
            from huggingface_hub import save_torch_state_dict

            transformer.save_config(folder)
            # FSDP2 made the model's class a subclass named FSDP<name>: loaders need the model's own name.
            config = json.loads((folder / "config.json").read_text())
            config["_class_name"] = config["_class_name"].removeprefix("FSDP")
            (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
            save_torch_state_dict(state, folder, filename_pattern="diffusion_pytorch_model{suffix}.safetensors")
        return "transformer", folder

    def checkpoint_weights(self, transformer: torch.nn.Module) -> None:
        """Nothing gathered ahead: the whole model is saved from itself (or from the sharded state)."""
        return None

    def write_checkpoint(
        self, transformer: torch.nn.Module, folder: Path, exports: Sequence[str], weights: None, state_file: Path | None
    ) -> None:
        """Write the whole transformer into `state_file` for resuming (None: the sharded state was written)."""
        if state_file is not None:
            safetensors.torch.save_model(transformer, str(state_file))


TrainMode = LoraMode | FullMode
