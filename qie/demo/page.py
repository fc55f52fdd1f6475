"""The demo's page, `report.html` in its run folder: the report of its training run (`qie.reporting.run_report`)
with the demo's own section first: its picture of the held-out samples and the measures of `demo_report.json`."""

from __future__ import annotations

from pathlib import Path

from qie.reporting.page import picture, section, table
from qie.reporting.run_files import REPORT
from qie.reporting.run_report import write_report

# The demo's measures shown on the page, in this order (those a kind of data set does not have are left out).
SHOWN = (
    "learned",
    "train_steps",
    "heldout_loss_before",
    "heldout_loss_after",
    "heldout_loss_drop",
    "pixel_error_base",
    "pixel_error_lora",
    "pixel_error_drop",
    "pixel_error_unedited",
    "latent_error_base",
    "latent_error_lora",
    "latent_error_drop",
    "vae_psnr_db",
)


def write_demo_page(run_dir: Path, report: dict) -> Path:
    """Write `run_dir/report.html` from the training run in `run_dir/train` and the demo's `report`; its path."""
    rows = [(key.replace("_", " "), report[key]) for key in SHOWN if key in report]
    shown = section(
        "Demo: the base model and the LoRA on the held-out samples",
        picture(Path(report["demo_image"]), "demo picture", size=2048),
        table(["measure", "value"], rows),
    )
    return write_report(run_dir / "train", run_dir / REPORT, [shown], f"qie demo {run_dir.name}")
