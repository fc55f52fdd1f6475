"""Online RL side by side on the demo's shapes: held-out edit error against wall time for GRPO (without and with
its rollout levers), DiffusionNFT and AWM, from one supervised start, on the same rows without targets and the same
reward, in one run of this script on one machine.

The start: the tiny demo model trained with flow matching on the demo's recolouring set (`experiment=demo`,
`--sft-steps`), or `--sft-lora`. Every arm goes on from that LoRA (`train.init_lora`, and the reference of its KL) on
the same rows given as a manifest WITHOUT targets, scored by `qie.demo.reward.RecolourReward`:

- grpo_plain: `train/objective=grpo` as it sampled before its rollout levers (`shared_prefix=false`,
  `overlap_rewards=false`), `--grpo-steps` steps;
- grpo: the same with the levers at their defaults (the group's shared prefix taken once, rewards scored beside the
  sampling) and `--grpo-set` overrides (e.g. `train.objective.rollout_pixels=2304`), `--grpo-steps` steps;
- nft, awm: `train/objective=nft` (and `awm`) with `train.max_minutes` a quarter of grpo_plain's wall time.

Each arm saves a checkpoint every `--every` steps (NFT: every `--every-nft`); each checkpoint's LoRA is loaded into
diffusers' own `QwenImageEditPipeline` (from the tiny demo folder), which samples the `--heldout` edits (20 steps, no
CFG, seed i for edit i, the condition resized at the tiny model's area as the stages resize it), and their mean pixel
error to the targets (mean absolute, [0, 1]) is measured, against the arm's wall time to that checkpoint (its
steps' `seconds`, start-up excluded). Also per arm: the median step split into rollout (sampling and decoding),
reward (scoring) and update (the rest: replays or the flow-matching passes, backward and optimizer).

    python scripts/bench_online_rl.py [--sft-lora START] [--grpo-steps 300] [--arms grpo_plain,grpo,nft,awm]

Writes `summary.json` and `heldout.png` (the held-out edits: control, target, base, start, each arm's last) in
`--out`, and prints a table and one summary line with the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_grpo import targetless_manifest  # noqa: E402

from qie.checks import compose  # noqa: E402
from qie.demo.synthetic import make_dataset  # noqa: E402
from qie.stages import precompute, train  # noqa: E402

REWARD = "qie.demo.reward.RecolourReward"
ARMS = ("grpo_plain", "grpo", "nft", "awm")


def arm_overrides(arm: str, args: argparse.Namespace, budget_minutes: float | None, start: str) -> list[str]:
    """The objective's overrides of one arm going on from the LoRA `start` (also its KL's reference)."""
    reward = f"train.objective.reward._target_={REWARD}"
    if arm.startswith("grpo"):
        grpo = [
            "train/objective=grpo",
            f"train.objective.group_size={args.group_size}",
            f"train.objective.sampling_steps={args.sampling_steps}",
            "train.objective.train_timesteps=2",
            reward,
            f"train.max_steps={args.grpo_steps}",
            f"train.checkpoint_every={args.every}",
            f"train.learning_rate={args.lr}",
            f"train.objective.reference_lora={start}",
        ]
        if arm == "grpo_plain":
            return [*grpo, "train.objective.shared_prefix=false", "train.objective.overlap_rewards=false"]
        return [*grpo, *args.grpo_set]
    return [
        f"train/objective={arm}",
        f"train.objective.group_size={args.group_size}",
        f"train.objective.sampling_steps={args.nft_sampling_steps}",
        reward,
        "train.max_steps=100000",
        f"train.max_minutes={budget_minutes}",
        f"train.checkpoint_every={args.every_nft}",
        f"train.learning_rate={args.nft_lr}",
        f"train.objective.reference_lora={start}",
        *args.nft_set,
    ]


def pipeline(path: Path):
    """diffusers' QwenImageEditPipeline from the tiny demo folder, conditions resized at its area (64x64)."""
    from diffusers import QwenImageEditPipeline
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit

    from qie.models.processor import QwenImageProcessorNoVideo, load_processor

    full = pipeline_qwenimage_edit.calculate_dimensions
    pipeline_qwenimage_edit.calculate_dimensions = lambda _, ratio: full(64 * 64, ratio)
    processor = load_processor(path, processor_class=QwenImageProcessorNoVideo)
    pipe = QwenImageEditPipeline.from_pretrained(path, processor=processor)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def heldout_errors(pipe, held: list, lora: str | None, steps: int = 20) -> tuple[float, list]:
    """The held-out edits' mean pixel error with `lora` loaded (None: the base), and the edits."""
    from PIL import Image

    from qie.evaluation.image_metrics import to_tensor

    if lora:
        pipe.load_lora_weights(str(Path(lora).parent), weight_name=Path(lora).name)
    errors, images = [], []
    for i, sample in enumerate(held):
        control = Image.open(sample.controls[0]).convert("RGB")
        image = pipe(
            image=control,
            prompt=sample.prompt,
            true_cfg_scale=1.0,
            num_inference_steps=steps,
            generator=torch.Generator().manual_seed(i),
        ).images[0]
        target = Image.open(sample.target).convert("RGB").resize(image.size)
        errors.append(float((to_tensor(image) - to_tensor(target)).abs().mean()))
        images.append(image)
    if lora:
        pipe.unload_lora_weights()
    return statistics.fmean(errors), images


def step_split(run: Path) -> dict[str, float]:
    """The median step's seconds, rollout, reward and update (the rest), from the run's metrics.jsonl."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss" in r]
    median = {
        k: statistics.median(r.get(k, 0.0) for r in rows) for k in ("seconds", "rollout_seconds", "reward_seconds")
    }
    median["update_seconds"] = max(0.0, median["seconds"] - median["rollout_seconds"] - median["reward_seconds"])
    median["steps"] = len(rows)
    median["train_seconds"] = sum(r["seconds"] for r in rows)
    return median


def checkpoints(run: Path) -> list[tuple[int, float, str]]:
    """(step, the run's step seconds up to it, its LoRA file) of each checkpoint of `run`."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    elapsed, out, total = {}, [], 0.0
    for r in rows:
        if "loss" in r:
            total += r["seconds"]
            elapsed[r["step"]] = total
    for folder in sorted((run / "checkpoints").glob("step-*")):
        step = int(folder.name.split("-")[1])
        out.append((step, elapsed.get(step, total), str(folder / "pytorch_lora_weights.safetensors")))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sft-steps", type=int, default=300)
    parser.add_argument("--sft-lora", type=Path, default=None, help="start from this LoRA instead of training one")
    parser.add_argument("--samples", type=int, default=48)
    parser.add_argument("--heldout", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=16)
    parser.add_argument("--sampling-steps", type=int, default=10)
    parser.add_argument("--grpo-steps", type=int, default=300)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--every", type=int, default=100)
    parser.add_argument("--nft-sampling-steps", type=int, default=4)
    parser.add_argument("--nft-lr", type=float, default=1e-3)
    parser.add_argument("--every-nft", type=int, default=25)
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--budget-minutes", type=float, default=None, help="NFT/AWM's budget (default: grpo_plain/4)")
    parser.add_argument("--grpo-set", action="append", default=[], help="a further override of the grpo arm")
    parser.add_argument("--nft-set", action="append", default=[], help="a further override of the nft/awm arms")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="qie-bench-online-rl-"))
    data = make_dataset(out / "data", train=args.samples, heldout=0, seed=0) / "train"
    torch.manual_seed(0)
    base = ["model=tiny_demo", f"cache.dir={out / 'cache'}", "logging.report_to=none"]
    common = [*base, "experiment=demo", f"validation.heldout_samples={args.heldout}"]
    precompute.run(compose("precompute", [*base, f"data.path={data}"]), out / "precompute")
    start = str(args.sft_lora or "")
    if not start:
        sft = [*common, f"data.path={data}", f"train.max_steps={args.sft_steps}", "train.checkpoint_every=100000"]
        start = train.run(compose("train", sft), out / "sft")["lora"]
    rows = targetless_manifest(data)
    precompute.run(compose("precompute", [*base, f"data.path={rows}", "train/objective=grpo"]), out / "pre_rows")
    shared = [*common, f"data.path={rows}", f"train.init_lora={start}", f"data.batch_size={args.batch_size}"]
    shared += ["train.lr_scheduler.num_warmup_steps=0"]
    arms, results, budget = args.arms.split(","), {}, args.budget_minutes
    for arm in arms:
        if arm in ("nft", "awm") and budget is None:
            budget = results["grpo_plain"]["wall_seconds"] / 4 / 60
        t0, load = time.perf_counter(), os.getloadavg()[0]
        train.run(compose("train", [*shared, *arm_overrides(arm, args, budget, start)]), out / arm)
        results[arm] = {"wall_seconds": time.perf_counter() - t0, **step_split(out / arm)}
        results[arm]["load"] = [round(load, 1), round(os.getloadavg()[0], 1)]  # 1-minute load at its start and end
        print(f"{arm}: {results[arm]}", flush=True)
    report(args, out, data, start, arms, results, budget)


def report(args, out: Path, data: Path, start: str, arms: list, results: dict, budget: float | None) -> None:
    """Score every checkpoint of every arm with diffusers' pipeline, print the table, write the summary and picture."""
    from qie.components import prepare_model
    from qie.config import typed
    from qie.data.scan import scan_folder
    from qie.evaluation.grid import captioned_grid
    from qie.stages.heldout import split_heldout

    _, held = split_heldout(scan_folder(data, require_target=True).samples, args.heldout)
    model = typed(compose("infer", ["model=tiny_demo"]).model)
    prepare_model(model)
    pipe = pipeline(Path(str(model.pretrained_model_name_or_path)))
    base_error, base_images = heldout_errors(pipe, held, None)
    start_error, start_images = heldout_errors(pipe, held, start)
    columns, curves = [base_images, start_images], {}
    for arm in arms:
        curve = []
        for step, seconds, lora in checkpoints(out / arm):
            error, images = heldout_errors(pipe, held, lora)
            curve.append({"step": step, "train_seconds": round(seconds, 1), "pixel_error": error})
        curves[arm] = curve
        columns.append(images)
    from PIL import Image

    picture = [[Image.open(s.controls[0]).convert("RGB"), Image.open(s.target).convert("RGB")] for s in held]
    for i, row in enumerate(picture):
        row.extend(column[i] for column in columns)
    titles = ["control", "target", "base model", "start (flow matching)", *arms]
    captioned_grid(picture, [s.prompt for s in held], titles, tile=96).save(out / "heldout.png")
    summary = {"args": {k: str(v) for k, v in vars(args).items()}, "budget_minutes": budget, "base": base_error}
    summary |= {"start": start_error, "arms": {a: {**results[a], "curve": curves[a]} for a in arms}}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"held-out pixel error: base {base_error:.4f}, start {start_error:.4f}")
    print("| arm | steps | train s | s/step | rollout | reward | update | last error | x start |")
    for arm in arms:
        r, last = results[arm], curves[arm][-1]["pixel_error"] if curves[arm] else float("nan")
        print(
            f"| {arm} | {r['steps']} | {r['train_seconds']:.0f} | {r['seconds']:.2f} | {r['rollout_seconds']:.2f} | "
            f"{r['reward_seconds']:.2f} | {r['update_seconds']:.2f} | {last:.4f} | {last / start_error:.3f} |"
        )
        for point in curves[arm]:
            print(f"    {arm} step {point['step']:4d} at {point['train_seconds']:7.1f} s: {point['pixel_error']:.4f}")
    print(f"summary: {out / 'summary.json'}")


if __name__ == "__main__":
    main()
