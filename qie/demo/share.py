"""The demo's export folder (`python -m qie.export`'s, `qie.stages.export`), written beside its run as `export/`:
the LoRA in every format, a model card with the demo's numbers, its picture and the LoRA's held-out edits with
their prompts and input images."""

from __future__ import annotations

from pathlib import Path

from qie.data.scan import scan_dataset
from qie.publish.run_facts import SampleEdit, dataset_instructions, read_run
from qie.stages.export import export_folder

EXPORT_DIR = "export"
PICTURE_CAPTION = "the held-out samples as the demo shows them: the base model's outputs beside the LoRA's"
# The demo report's numbers the card shows, under the card's names.
METRICS = {
    "heldout_loss_before": "heldout_loss_before",
    "heldout_loss_after": "heldout_loss",
    "pixel_error_base": "pixel_error_base",
    "pixel_error_lora": "pixel_error_lora",
}


def export_demo(run_dir: Path, config: dict, report: dict) -> Path:
    """Write `run_dir/export/` for the demo run in `run_dir` (its training run in `train/`, trained with the
    resolved training config `config`; `report` its measures); returns the folder."""
    facts = read_run(run_dir / "train", config)
    facts.metrics.update({name: float(report[key]) for key, name in METRICS.items() if key in report})
    facts.pictures = [(Path(report["demo_image"]), PICTURE_CAPTION)]
    facts.samples = []
    for sample in scan_dataset(run_dir / "data" / "heldout").samples:
        edit = run_dir / "predictions" / "lora" / f"{sample.id}.png"  # a layered demo's are folders of layers
        if edit.is_file():
            facts.samples.append(SampleEdit(edit, sample.prompt, sample.controls[0] if sample.controls else None))
    facts.instructions = dataset_instructions(str(run_dir / "data" / "train"))
    export_folder(facts, run_dir / EXPORT_DIR)
    return run_dir / EXPORT_DIR
