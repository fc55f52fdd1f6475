"""qie's own sweeper plugin (`hydra_plugins/qie_search`) is found by Hydra from any folder with the README's
editable install (`pip install -e .`), not only from the checkout's root, where the folder `hydra_plugins/` lies
in the working directory: an Optuna search run from another folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.subprocess


def test_an_optuna_search_runs_from_another_folder(tiny_path: Path, cached_data, tmp_path: Path) -> None:
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
    root = Path(__file__).resolve().parents[1]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    sweep = tmp_path / "search"
    args = [
        "-m",
        "hydra/sweeper=optuna",
        "hydra.sweeper.n_trials=1",
        "train.learning_rate=tag(log,interval(1e-4,1e-2))",
        "train.max_steps=1",
        "validation.heldout_samples=2",
        "logging.report_to=none",
        f"model.pretrained_model_name_or_path={tiny_path}",
        f"hydra.sweep.dir={sweep}",
        *cached_data.overrides,
    ]
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != root]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(paths)}
    proc = subprocess.run(
        [sys.executable, "-m", "qie.train", *args], cwd=elsewhere, env=env, capture_output=True, text=True, timeout=600
    )
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-3000:]
    assert "Unknown plugin class" not in text and "Traceback" not in text
    summary = json.loads((sweep / "sweep_summary.json").read_text())
    assert summary["failed"] == [] and len(summary["jobs"]) == 1
    assert (sweep / "optimization_results.yaml").is_file()
