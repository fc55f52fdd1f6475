"""A shortened demo: data, precompute, cached training, infer on held-out samples, and the report."""

from __future__ import annotations

import json
from pathlib import Path

from qie.stages import demo


def test_short_demo_learns(tmp_path: Path, small_cfg) -> None:
    cfg = small_cfg("demo", "demo.train_samples=16", "demo.heldout_samples=2", "train.max_steps=60")
    report = demo.run(cfg, tmp_path)
    on_disk = json.loads((tmp_path / "demo_report.json").read_text())
    assert on_disk == report
    assert report["train_steps"] == 60
    assert report["heldout_loss_after"] <= 0.8 * report["heldout_loss_before"]
    assert report["learned"] is True
    assert len(list((tmp_path / "predictions" / "lora").glob("*.png"))) == 2
    assert len((tmp_path / "train" / "metrics.jsonl").read_text().splitlines()) == 60
    assert Path(report["lora"]).is_file()
