"""What a training run folder says, read for its export: the result, the LoRA, the held-out metrics and the sample
edits (the last validation images, with the prompts and input images that `qie.training.validation` records beside
them in `inputs.json`)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from qie.adapters.lora import LORA_FILE, lora_file
from qie.adapters.lora_extract import REPORT_FILE as EXTRACT_REPORT
from qie.errors import ConfigError
from qie.reporting.run_files import last_line, read_json
from qie.training.validation import INPUTS_FILE, METRICS_FILE

RESULT_FILE = "train_result.json"


@dataclass(frozen=True)
class BaseModel:
    """The model a LoRA belongs to: its hub id (None: a local folder, named by `source`), its diffusers pipeline
    class, the Hub's task (`image-to-image`, `text-to-image`), qie's name for it (`model=...`) and the LoRAs fused
    into it (`model.fuse_loras` as file, scale)."""

    source: str
    hub_id: str | None
    pipeline: str
    task: str
    name: str
    fused: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True)
class SampleEdit:
    """One sample picture: the output image, its prompt, and the input image it edited (None: text to image)."""

    image: Path
    prompt: str
    control: Path | None = None


@dataclass
class RunFacts:
    """A run as its export shows it. `config` is the run's config as plain values ({} when not recorded)."""

    run_dir: Path
    lora: Path
    config: dict
    result: dict
    metrics: dict[str, float] = field(default_factory=dict)
    samples: list[SampleEdit] = field(default_factory=list)
    # Pictures shown as they are (file, caption): the demo's comparison grid.
    pictures: list[tuple[Path, str]] = field(default_factory=list)
    instructions: list[tuple[str, int]] = field(default_factory=list)  # the data set's prompts and their counts
    # `extract_report.json` beside a LoRA made by `python -m qie.extract_lora`; None for a trained LoRA.
    extraction: dict | None = None


def read_run(run_dir: Path, config: dict, lora: str | None = None, samples: int = 8) -> RunFacts:
    """The facts of the training run in `run_dir` (`lora`: a LoRA file or folder to export instead of its `lora/`;
    at most `samples` sample edits).

    Raises:
        ConfigError: `run_dir` is missing, a full fine-tune, or holds no LoRA; `lora` names no LoRA file.
    """
    if not run_dir.is_dir():
        raise ConfigError(f"export.run_dir={str(run_dir)!r} is not a folder: give a training run's folder")
    result = read_json(run_dir / RESULT_FILE) or {}
    if lora is None and "transformer" in result and "lora" not in result:
        raise ConfigError(
            f"export.run_dir={str(run_dir)!r} is a full fine-tune (its transformer/): make a LoRA of it with "
            f"python -m qie.extract_lora extract.tuned={run_dir / 'transformer'} extract.out=FILE, then export that "
            "file with export.lora=FILE"
        )
    found = lora_file(lora) if lora is not None else run_dir / "lora" / LORA_FILE
    if not found.is_file():
        raise ConfigError(
            f"export.run_dir={str(run_dir)!r} holds no trained LoRA ({found} is missing): a run still training "
            "writes it at the end; export a checkpoint meanwhile with export.lora=RUN/checkpoints/step-NNNNNN"
        )
    facts = RunFacts(run_dir, found, config, result, heldout_metrics(run_dir, result))
    facts.samples = validation_samples(run_dir / "validation", samples)
    facts.extraction = read_json(found.parent / EXTRACT_REPORT)
    return facts


def heldout_metrics(run_dir: Path, result: dict) -> dict[str, float]:
    """The run's measured numbers: the last training loss, the held-out loss (`validation.heldout_samples`) and
    the means of the last validation metrics (`validation/metrics.jsonl`)."""
    metrics = {key: float(result[key]) for key in ("loss", "heldout_loss") if result.get(key) is not None}
    last = last_line(_validation_folder(run_dir / "validation") / METRICS_FILE)
    metrics.update({f"validation/{k}": float(v) for k, v in (last or {}).get("mean", {}).items()})
    return metrics


def validation_samples(folder: Path, count: int) -> list[SampleEdit]:
    """Up to `count` images of the last validation step (`step-NNNNNN/`; of several step counts, the largest
    count's), with the prompts and input images `inputs.json` records (empty prompts where it is missing; no input
    image where it is no longer there)."""
    folder = _validation_folder(folder)
    steps = sorted(folder.glob("step-*"))
    if not steps:
        return []
    inputs = read_json(folder / INPUTS_FILE) or {}
    out = []
    for image in sorted(steps[-1].glob("*.png"))[:count]:
        record = inputs.get(image.stem) or inputs.get(image.stem.rpartition("_")[0]) or {}
        control = Path(record["control"]) if record.get("control") else None
        shown = control if control is not None and control.is_file() else None  # moved since: shown without it
        out.append(SampleEdit(image, str(record.get("prompt", "")), shown))
    return out


def _validation_folder(folder: Path) -> Path:
    """`validation/`, or with several step counts (`validation.step_counts`) its `steps-N/` of the largest N."""
    counts = sorted(folder.glob("steps-*"), key=lambda p: int(p.name.split("-")[1]) if p.name[6:].isdigit() else 0)
    return counts[-1] if counts and not any(folder.glob("step-*")) else folder


def dataset_instructions(path: str | None, limit: int = 20) -> list[tuple[str, int]]:
    """The `limit` most common prompts of the data set at `path` (a folder or manifest) with their counts; none
    where it is not set or cannot be read here (a Hugging Face data set, a folder on another machine)."""
    from qie.data.formats import DataSource, detect_format, read_dataset
    from qie.errors import QieError

    if not path:
        return []
    try:
        if detect_format(path) == "hf":
            return []
        samples = read_dataset(DataSource(path=str(path))).samples
    except (QieError, OSError, ValueError):
        return []
    return Counter(sample.prompt for sample in samples).most_common(limit)
