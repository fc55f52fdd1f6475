"""Schemas of the stages that share a run's result: the Hub-ready export folder and LoRA extraction."""

from dataclasses import dataclass, field

from qie.config.model import ModelConfig
from qie.config.ranges import at_least


@dataclass
class ExportConfig:
    # The run folder to export (`python -m qie.export RUN_DIR OUT` sets both) and the folder to write.
    run_dir: str | None = None
    out: str | None = None
    # A LoRA file or folder of the run to export instead of its final `lora/` (a checkpoint, `lora/ema`).
    lora: str | None = None
    # Upload the folder to this Hub model repo (created if missing) with huggingface_hub's upload API.
    push_to_hub: str | None = None
    private: bool = False
    # The card's `license` field: the license you give the LoRA (Qwen-Image's weights are Apache-2.0).
    license: str = "apache-2.0"
    # At most this many sample edits (the run's last validation images) go into the folder and the card.
    samples: int = 8
    # Write into an `out` folder that holds files already (files of the export's names are replaced, a link among
    # them replaced by the file, never written through); by default such a folder is refused.
    overwrite: bool = False
    # The card's `base_model` (a Hub id) for a run whose model is a local folder that is not a Hugging Face cache
    # snapshot (`.../models--Org--Name/snapshots/...`, read as Org/Name); null: read from the run.
    base_model: str | None = None

    def problem(self) -> str | None:
        """`samples` from 0."""
        return at_least("export", [("samples", self.samples, 0)])


@dataclass
class ExportRoot:
    export: ExportConfig = field(default_factory=ExportConfig)


@dataclass
class ExtractConfig:
    # The tuned transformer: a diffusers model folder (a full fine-tune's RUN/transformer) or a single file.
    tuned: str | None = None
    rank: int = 32
    # The diffusers-format LoRA file to write; the ComfyUI and kohya files go beside it.
    out: str | None = None
    comfyui: bool = True
    kohya: bool = True
    # Where the SVDs run ("cpu", "cuda", ...); the weights stay on the CPU between layers.
    device: str = "cpu"
    # 0: each layer's exact SVD; N > 0: a randomized SVD of N subspace iterations (torch.svd_lowrank), far quicker on
    # a real model's large layers, its error reported the same way.
    niter: int = 0
    # Replace an `out` file that exists already (by default refused: it may be another extraction's, or an input).
    overwrite: bool = False

    def problem(self) -> str | None:
        """`rank` from 1, `niter` from 0."""
        return at_least("extract", [("rank", self.rank, 1), ("niter", self.niter, 0)])


@dataclass
class ExtractRoot:
    # The base: any model qie reads (hub id, folder, single file via model.transformer_path, model.fuse_loras).
    model: ModelConfig = field(default_factory=ModelConfig)
    extract: ExtractConfig = field(default_factory=ExtractConfig)
