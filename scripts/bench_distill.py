"""Distillation on the demo's shapes: does `train/objective=distill` bring a few-step student close to its teacher?

The tiny demo model (`model=tiny_demo`) trains a LoRA with distillation on the demo's recolouring set
(`qie.demo.synthetic`): the teacher is the base sampling with `--teacher-steps` steps and true CFG at
`--teacher-cfg` against the empty prompt, the student the base with the LoRA at `--student-steps` steps without CFG;
teacher outputs are filled on first use (`cache.mode=lazy`). Then, on held-out edits (never trained on) and
`--seeds` seeds each, `qie.infer`'s pipeline (`build_predictor`) makes the teacher's image and the student-steps image
of the base and of the distilled LoRA; the script prints the mean absolute pixel error (0..1) of each student-steps
image against the teacher's, their ratio (target: the LoRA at most half the base's) and the seconds per image of the
teacher and of the student (encoding, sampling and decoding, one image at a time). `distill_edits.png` shows each
held-out edit (seed 0) side by side: the control image, the base and the distilled LoRA at `--student-steps`, and the
teacher.

With `--sft-steps N` the base first learns the edits: a flow-matching LoRA of N steps (the demo's settings) is fused
into it (`model.fuse_loras`) for the teacher, the student and every image, so the teacher makes the edits and the
picture shows whether the few-step student makes them too (the random tiny base makes the same blur of every edit).

    python scripts/bench_distill.py [--steps 200] [--samples 32] [--heldout 8] [--sft-steps 0] [--out DIR]

Prints one line per measure and a summary line; writes `summary.json` and `distill_edits.png` in the output folder.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

from qie.checks import compose
from qie.components import prepare_model
from qie.config import typed
from qie.demo.synthetic import make_dataset
from qie.evaluation.grid import captioned_grid
from qie.stages import precompute, train
from qie.stages.infer import Predictor, build_predictor


def _predictor(cfg) -> Predictor:
    """The infer stage's Predictor for a composed infer config."""
    model = typed(cfg.model)
    return build_predictor(model, typed(cfg.predict), prepare_model(model))


def heldout_edits(folder: Path) -> list[tuple[Path, str]]:
    """(control image, instruction) of each sample of a split written by `make_dataset`."""
    out = []
    for caption in sorted((folder / "training_images").glob("*.txt")):
        out.append((folder / "control_images" / caption.with_suffix(".png").name, caption.read_text().strip()))
    return out


def images(predictor, edits: list[tuple[Path, str]], seeds: int, **options) -> tuple[list[np.ndarray], float]:
    """Each edit's image for each seed under `options`, and the seconds per image."""
    out, t0 = [], time.perf_counter()
    for control, prompt in edits:
        for seed in range(seeds):
            out.append(predictor.predict([control], prompt, output_type="np", seed=seed, **options)[0])
    return out, (time.perf_counter() - t0) / max(len(out), 1)


def error(images: list[np.ndarray], reference: list[np.ndarray]) -> float:
    """Mean absolute pixel difference (0..1) of each image to its reference."""
    return float(np.mean([np.abs(a - b).mean() for a, b in zip(images, reference)]))


def picture(path: Path, edits: list[tuple[Path, str]], seeds: int, columns: dict[str, list[np.ndarray]]) -> None:
    """Each edit's control image and, for its first seed, each column's image, a row per edit."""
    rows = [[Image.open(control).convert("RGB")] for control, _ in edits]
    for images in columns.values():
        for row, image in zip(rows, images[::seeds]):
            row.append(Image.fromarray((np.clip(image, 0, 1) * 255).round().astype(np.uint8)))
    captioned_grid(rows, [prompt for _, prompt in edits], ["control", *columns]).save(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--samples", type=int, default=32, help="training samples")
    parser.add_argument("--heldout", type=int, default=8, help="held-out edits measured")
    parser.add_argument("--seeds", type=int, default=2, help="noise seeds per sample (training and measure)")
    parser.add_argument("--student-steps", type=int, default=4)
    parser.add_argument("--teacher-steps", type=int, default=20)
    parser.add_argument("--teacher-cfg", type=float, default=4.0)
    parser.add_argument("--learning-rate", type=float, default=3e-3)
    parser.add_argument("--sft-steps", type=int, default=0, help="a flow-matching LoRA fused into the base first")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="qie-bench-distill-"))
    root = make_dataset(out / "data", train=args.samples, heldout=args.heldout, seed=0)
    base = ["model=tiny_demo", f"cache.dir={out / 'cache'}"]
    precompute.run(compose("precompute", [*base, f"data.path={root / 'train'}"]), out / "precompute")
    model = ["model=tiny_demo"]
    if args.sft_steps:
        sft = train.run(compose("train", [*base, f"data.path={root / 'train'}", "experiment=demo",
                                          f"train.max_steps={args.sft_steps}", "train.checkpoint_every=100000",
                                          "logging.report_to=none"]), out / "sft")  # fmt: skip
        model.append(f"model.fuse_loras=[{sft['lora']}]")
        base.append(model[-1])
    distill = [
        f"train.objective.student_steps={args.student_steps}",
        f"train.objective.teacher_steps={args.teacher_steps}",
        f"train.objective.teacher_cfg={args.teacher_cfg}",
        f"train.objective.seeds={args.seeds}",
    ]
    overrides = [*base, f"data.path={root / 'train'}", "experiment=demo", "train/objective=distill", *distill,
                 "cache.mode=lazy", f"train.max_steps={args.steps}", f"train.learning_rate={args.learning_rate}",
                 f"train.lr_scheduler.num_warmup_steps={max(args.steps // 10, 1)}", "train.checkpoint_every=100000",
                 "logging.report_to=none"]  # fmt: skip
    t0 = time.perf_counter()
    result = train.run(compose("train", overrides), out / "run")
    train_seconds = time.perf_counter() - t0

    edits = heldout_edits(root / "heldout")
    plain = _predictor(compose("infer", model))
    distilled = _predictor(compose("infer", [*model, f"predict.lora={result['lora']}"]))
    teacher, teacher_s = images(plain, edits, args.seeds, negative_prompt="", true_cfg_scale=args.teacher_cfg,
                                num_inference_steps=args.teacher_steps)  # fmt: skip
    student = dict(negative_prompt=None, true_cfg_scale=1.0, num_inference_steps=args.student_steps)
    base_images, base_s = images(plain, edits, args.seeds, **student)
    lora_images, lora_s = images(distilled, edits, args.seeds, **student)
    summary = {
        "samples": args.samples, "heldout": len(edits), "seeds": args.seeds, "steps": args.steps,
        "student_steps": args.student_steps, "teacher_steps": args.teacher_steps, "teacher_cfg": args.teacher_cfg,
        "sft_steps": args.sft_steps,
        "error_base": error(base_images, teacher), "error_lora": error(lora_images, teacher),
        "seconds_per_image_teacher": teacher_s, "seconds_per_image_base": base_s, "seconds_per_image_lora": lora_s,
        "first_loss": result["losses"][0], "last_loss": result["losses"][-1], "train_seconds": round(train_seconds, 1),
    }  # fmt: skip
    summary["error_ratio"] = summary["error_lora"] / summary["error_base"]
    steps = f"{args.student_steps} steps"
    picture(out / "distill_edits.png", edits, args.seeds, {f"base, {steps}": base_images,
            f"distilled, {steps}": lora_images, f"teacher, {args.teacher_steps}": teacher})  # fmt: skip
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"teacher ({args.teacher_steps} steps, cfg {args.teacher_cfg}): {teacher_s:.3f} s/image")
    print(
        f"base at {args.student_steps} steps, cfg 1: pixel error to the teacher {summary['error_base']:.4f}, "
        f"{base_s:.3f} s/image"
    )
    print(
        f"distilled LoRA at {args.student_steps} steps, cfg 1: pixel error to the teacher "
        f"{summary['error_lora']:.4f}, {lora_s:.3f} s/image"
    )
    print(
        f"error ratio {summary['error_ratio']:.3f} (target <= 0.5) after {args.steps} steps, loss "
        f"{summary['first_loss']:.5f} -> {summary['last_loss']:.5f} ({train_seconds:.0f} s); {out}"
    )


if __name__ == "__main__":
    main()
