"""The demo: generate a synthetic edit data set, precompute, train a LoRA from the cache, infer on the
held-out split, and report whether it learned (held-out loss and pixel error, before and after)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from omegaconf import DictConfig, OmegaConf

from qie.config import for_stage
from qie.data.images import open_image, prepare_target
from qie.data.samples import scan_dataset
from qie.demo.synthetic import make_dataset
from qie.stages import infer, precompute, train
from qie.stages.common import build_source, sampling_options
from qie.training.evaluate import heldout_loss

REQUIRED_LOSS_DROP = 0.2


def _with(cfg: DictConfig, **updates) -> DictConfig:
    out = cfg.copy()
    for key, val in updates.items():
        OmegaConf.update(out, key, val, merge=False)
    return out


def run(cfg: DictConfig, run_dir: Path) -> dict:
    """Run the demo in `run_dir`; returns the report also written to `run_dir/demo_report.json`."""
    run_dir = Path(run_dir)
    d = cfg.demo
    data_root = make_dataset(run_dir / "data", d.train_samples, d.heldout_samples, d.image_size, d.seed)
    cache_dir = str(run_dir / "cache")
    train_cfg = _with(cfg, **{"data.path": str(data_root / "train"), "cache.dir": cache_dir, "cache.mode": "cached"})
    heldout_cfg = _with(train_cfg, **{"data.path": str(data_root / "heldout")})

    for split_cfg, name in ((train_cfg, "train"), (heldout_cfg, "heldout")):
        precompute.run(for_stage(split_cfg, "precompute"), run_dir / f"precompute_{name}")

    result = train.run(train_cfg, run_dir / "train")

    heldout = scan_dataset(data_root / "heldout").samples
    source = build_source(heldout_cfg, mode="cached")
    predictor = infer.build_predictor(_with(heldout_cfg, **{"predict.lora": None}))
    options = sampling_options(cfg.predict)

    def evaluate(tag: str) -> tuple[float, float]:
        loss = heldout_loss(predictor.parts.transformer, source, heldout, seed=int(d.seed))
        errors = []
        out_dir = run_dir / "predictions" / tag
        out_dir.mkdir(parents=True, exist_ok=True)
        for i, sample in enumerate(heldout):
            image = predictor.predict(sample.controls[0], sample.prompt, options, seed=i)[0]
            image.save(out_dir / f"{sample.id}.png")
            target = prepare_target(open_image(sample.target), image.width * image.height)
            pred = np.asarray(image, dtype=np.float32) / 255.0
            errors.append(float(np.abs(pred - (target.permute(1, 2, 0).numpy() + 1) / 2).mean()))
        return loss, float(np.mean(errors))

    loss_before, error_before = evaluate("base")
    predictor.load_lora(result["lora"])
    loss_after, error_after = evaluate("lora")

    drop = (loss_before - loss_after) / loss_before
    report = {
        "heldout_loss_before": loss_before,
        "heldout_loss_after": loss_after,
        "heldout_loss_drop": drop,
        "learned": drop >= REQUIRED_LOSS_DROP,
        "pixel_error_base": error_before,
        "pixel_error_lora": error_after,
        "train_steps": result["step"],
        "lora": result["lora"],
        "metrics": str(run_dir / "train" / "metrics.jsonl"),
        "tensorboard": str(run_dir / "train" / "tensorboard"),
        "predictions": str(run_dir / "predictions"),
    }
    (run_dir / "demo_report.json").write_text(json.dumps(report, indent=2))
    print(format_report(report, run_dir))
    return report


def format_report(r: dict, run_dir: Path) -> str:
    verdict = "learned" if r["learned"] else f"did NOT reach the {REQUIRED_LOSS_DROP:.0%} drop"
    return "\n".join(
        [
            "",
            f"qie demo: {r['train_steps']} training steps from the cache; {verdict}",
            f"  held-out loss (fixed noise)  before {r['heldout_loss_before']:.4f}  after {r['heldout_loss_after']:.4f}"
            f"  ({r['heldout_loss_drop']:.0%} lower)",
            f"  held-out pixel error         base   {r['pixel_error_base']:.4f}  LoRA  {r['pixel_error_lora']:.4f}",
            f"  images:      {r['predictions']}/{{base,lora}}",
            f"  metrics:     {r['metrics']}",
            f"  TensorBoard: tensorboard --logdir {r['tensorboard']}",
            f"  report:      {run_dir / 'demo_report.json'}",
        ]
    )
