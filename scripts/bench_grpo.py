"""Online RL on the demo's shapes: does `train/objective=grpo` improve edits from a reward alone, without targets?

The recipe users run: the tiny demo model first learns the edits with flow matching on the demo's recolouring set
(`--sft-steps`, the demo's settings); then GRPO goes on from that LoRA (`train.init_lora`) on the same rows given
as a manifest WITHOUT targets (controls and instructions only), scored by the demo's reward
(`qie.demo.reward.RecolourReward`: the instruction's colour inside the control's shape, the control kept outside).
The held-out edits (`validation.heldout_samples`, the same ids in both runs) are sampled with each LoRA as
`qie.infer` samples them, and their pixel error to their targets (mean absolute, [0, 1]) and their reward measured.

    python scripts/bench_grpo.py [--sft-steps 300] [--steps 100] [--samples 48] [--heldout 16] [--out DIR]

Prints the reward curve, the times and one summary line with the ratios; writes `summary.json` and `heldout.png`
(the held-out edits of the base model, the start and the GRPO LoRA beside their controls and targets) in the output
folder. `--grpo-lora` scores a GRPO LoRA trained before (its run's metrics.jsonl beside its `lora/` folder).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from qie.checks import compose
from qie.demo.reward import RecolourReward
from qie.demo.synthetic import make_dataset
from qie.stages import precompute, train

REWARD = "qie.demo.reward.RecolourReward"


def targetless_manifest(data: Path) -> Path:
    """`rows.jsonl` beside the folder data set `data`: each sample's control and instruction, its id the folder's
    (so the same samples are held out), no target."""
    rows = []
    for control in sorted((data / "control_images").glob("*.png")):
        prompt = (data / "training_images" / f"{control.stem}.txt").read_text(encoding="utf-8").strip()
        rows.append({"id": control.stem, "controls": [f"control_images/{control.name}"], "prompt": prompt})
    manifest = data / "rows.jsonl"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return manifest


def heldout_scores(
    data: Path, heldout: int, loras: dict[str, str], steps: int, picture: Path | None = None
) -> dict[str, dict[str, float]]:
    """Per LoRA, the held-out edits' mean pixel error to their targets and mean reward (seed i for edit i); with
    `picture`, a grid of the held-out edits there (control, target, then each LoRA's edit, a row per edit)."""
    from qie.components import prepare_model
    from qie.config import typed
    from qie.data.scan import scan_folder
    from qie.evaluation.grid import captioned_grid
    from qie.evaluation.image_metrics import to_tensor
    from qie.models.sampling import SamplingOptions
    from qie.stages.heldout import split_heldout
    from qie.stages.infer import build_predictor

    _, held = split_heldout(scan_folder(data, require_target=True).samples, heldout)
    cfg = compose("infer", ["model=tiny_demo"])
    predictor = build_predictor(typed(cfg.model), typed(cfg.predict), prepare_model(typed(cfg.model)))
    options = SamplingOptions(true_cfg_scale=1.0, num_inference_steps=steps)
    reward, out = RecolourReward(), {}
    rows = [[Image.open(s.controls[0]).convert("RGB"), Image.open(s.target).convert("RGB")] for s in held]
    for name, lora in loras.items():
        if lora:
            predictor.load_lora(lora)
        errors, rewards = [], []
        for i, sample in enumerate(held):
            image = predictor.predict(list(sample.controls), sample.prompt, options, seed=i)[0].convert("RGB")
            target = Image.open(sample.target).convert("RGB").resize(image.size)
            edit, control = to_tensor(image), to_tensor(Image.open(sample.controls[0]), image.size)
            errors.append(float((edit - to_tensor(target)).abs().mean()))
            rewards.append(float(reward(edit[None], [[control]], [sample.prompt])[0]))
            rows[i].append(image)
        out[name] = {"pixel_error": statistics.fmean(errors), "reward": statistics.fmean(rewards)}
    if picture is not None:
        titles = ["control", "target", *(PICTURE_TITLES.get(name, name) for name in loras)]
        captioned_grid(rows, [s.prompt for s in held], titles, tile=96).save(picture)
    return out


PICTURE_TITLES = {"base": "base model", "sft": "start (flow matching)", "grpo": "GRPO"}


def report(args: argparse.Namespace, out: Path, scores: dict, curve: list, seconds: tuple[float, float]) -> None:
    """Write `summary.json` and print the held-out scores and the summary line (`seconds`: the two runs')."""
    sft_seconds, seconds = seconds
    per_step = seconds / args.steps
    summary = {
        "samples": args.samples,
        "heldout": args.heldout,
        "sft_steps": args.sft_steps,
        "steps": args.steps,
        "batch_size": args.batch_size,
        "group_size": args.group_size,
        "sampling_steps": args.sampling_steps,
        "train_timesteps": args.train_timesteps,
        "lr": args.lr,
        "kl_weight": args.kl_weight,
        "overrides": args.set,
        "sft_seconds": round(sft_seconds, 1),
        "grpo_seconds": round(seconds, 1),
        "seconds_per_step": round(per_step, 3),
        "seconds_per_rollout": round(per_step / args.batch_size, 3),
        "heldout_scores": scores,
        "reward_curve": curve,
        "pixel_error_ratio": scores["grpo"]["pixel_error"] / scores["sft"]["pixel_error"],
        "reward_first_10": float(np.mean([v for _, v in curve[:10]])),
        "reward_last_10": float(np.mean([v for _, v in curve[-10:]])),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    for name, s in scores.items():
        print(f"held-out {name}: pixel error {s['pixel_error']:.4f}, reward {s['reward']:.4f}")
    print(
        f"pixel error grpo/sft {summary['pixel_error_ratio']:.3f}; held-out reward "
        f"{scores['sft']['reward']:.4f} -> {scores['grpo']['reward']:.4f}; training reward "
        f"{summary['reward_first_10']:.4f} -> {summary['reward_last_10']:.4f}; {per_step:.2f} s/step, "
        f"{summary['seconds_per_rollout']:.2f} s per rollout of {args.group_size} edits ({out})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sft-steps", type=int, default=300)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--samples", type=int, default=48, help="edits in all, the held-out ones included")
    parser.add_argument("--heldout", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--sampling-steps", type=int, default=10)
    parser.add_argument("--train-timesteps", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--kl-weight", type=float, default=0.04)
    parser.add_argument("--sft-lora", type=Path, default=None, help="start from this LoRA instead of training one")
    parser.add_argument("--grpo-lora", type=Path, default=None, help="score this GRPO LoRA instead of training one")
    parser.add_argument("--set", action="append", default=[], help="a further override of the GRPO run (KEY=VALUE)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="qie-bench-grpo-"))
    data = make_dataset(out / "data", train=args.samples, heldout=0, seed=0) / "train"
    torch.manual_seed(0)
    base = ["model=tiny_demo", f"cache.dir={out / 'cache'}", "logging.report_to=none"]
    common = [*base, "experiment=demo", f"validation.heldout_samples={args.heldout}", "train.checkpoint_every=100000"]
    precompute.run(compose("precompute", [*base, f"data.path={data}"]), out / "precompute")
    sft_seconds, sft_lora = 0.0, str(args.sft_lora or "")
    if not args.sft_lora:
        t0 = time.perf_counter()
        sft_run = compose("train", [*common, f"data.path={data}", f"train.max_steps={args.sft_steps}"])
        sft_lora = train.run(sft_run, out / "sft")["lora"]
        sft_seconds = time.perf_counter() - t0

    rows = targetless_manifest(data)
    grpo = [
        "train/objective=grpo",
        f"train.objective.group_size={args.group_size}",
        f"train.objective.sampling_steps={args.sampling_steps}",
        f"train.objective.kl_weight={args.kl_weight}",
        f"train.objective.train_timesteps={args.train_timesteps}",
        f"train.objective.reward._target_={REWARD}",
    ]
    precompute.run(compose("precompute", [*base, f"data.path={rows}", *grpo]), out / "precompute_rows")
    overrides = [
        *common,
        *grpo,
        f"data.path={rows}",
        f"train.init_lora={sft_lora}",
        f"train.objective.reference_lora={sft_lora}",
        f"train.max_steps={args.steps}",
        f"data.batch_size={args.batch_size}",
        f"train.learning_rate={args.lr}",
        "train.lr_scheduler.num_warmup_steps=0",
        *args.set,
    ]
    t0 = time.perf_counter()
    lora = str(args.grpo_lora) if args.grpo_lora else train.run(compose("train", overrides), out / "grpo")["lora"]
    seconds = time.perf_counter() - t0
    metrics = Path(lora).parent.parent / "metrics.jsonl"  # <run>/lora/<file>
    logged = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.is_file() else []
    curve = [(r["step"], r["reward_mean"]) for r in logged if "reward_mean" in r]
    for step, value in curve[:: max(1, len(curve) // 10)]:
        print(f"step {step:5d}  reward_mean {value:.4f}")
    loras = {"base": "", "sft": sft_lora, "grpo": lora}
    scores = heldout_scores(data, args.heldout, loras, 20, out / "heldout.png")
    report(args, out, scores, curve, (sft_seconds, seconds))


if __name__ == "__main__":
    main()
