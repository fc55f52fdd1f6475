"""Preference training on the demo's shapes: does `train/objective=dpo` learn which of two recolourings is wanted?

Each sample of the demo's recolouring set (`qie.demo.synthetic`) becomes a preference pair: its target (the shape
in the colour the instruction names) is preferred, the same shape in another of the demo's colours is rejected.
The recipe users run: the tiny demo model first learns the edits with flow matching on the preferred targets
(`--sft-steps`, the demo's settings), then goes on from that LoRA with Flow-DPO, the same LoRA as the reference,
the loss masked to the edit region (`train.mask.source=edit`). Held-out pairs (`validation.heldout_samples`, kept
out of both runs) are measured at fixed noise every `--every` steps. The implicit-reward accuracy starts at chance
(0.5: the policy is its reference) and should end at 0.9 or above. `--sft-steps 0` runs DPO on the base alone.

    python scripts/bench_dpo.py [--sft-steps 1000] [--steps 300] [--samples 48] [--heldout 16] [--out DIR]

Prints one line per measurement and a summary line; writes `summary.json` in the output folder.
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
from qie.demo.synthetic import COLORS, make_dataset
from qie.stages import precompute, train
from qie.stages.heldout import HELDOUT_FILE


def add_rejected(root: Path) -> int:
    """Write `rejected_images/<stem>.png` for each sample of the folder `root`: its target with the shape painted
    the next colour (in sorted order) that is neither the target's nor the control's. Returns the pairs written."""
    names = sorted(COLORS)
    out = root / "rejected_images"
    out.mkdir(exist_ok=True)
    count = 0
    for caption in sorted((root / "training_images").glob("*.txt")):
        wanted = caption.read_text(encoding="utf-8").split()[-1]
        target = np.asarray(Image.open(caption.with_suffix(".png")).convert("RGB")).copy()
        control = np.asarray(Image.open(root / "control_images" / caption.with_suffix(".png").name).convert("RGB"))
        shape = (target == COLORS[wanted]).all(axis=-1)  # no anti-aliasing: the shape is exactly its colour
        before = [n for n in names if (control[shape] == COLORS[n]).all()]
        i = names.index(wanted)
        wrong = next(n for n in names[i + 1 :] + names[:i] if n not in before)
        target[shape] = COLORS[wrong]
        Image.fromarray(target).save(out / caption.with_suffix(".png").name)
        count += 1
    return count


def colour_fidelity(out: Path, data: Path, heldout: int, loras: dict[str, str]) -> dict[str, float]:
    """Edit the held-out pairs' control images with each LoRA (the demo's sampling settings) and measure, per LoRA,
    the share of them whose shape comes out nearer the preferred colour than the rejected one (the mean colour of
    the target's shape pixels). Writes `heldout_edits.png`: per pair the control, each LoRA's edit, the target."""
    from qie.components import prepare_model
    from qie.config import typed
    from qie.data.scan import scan_folder
    from qie.models.sampling import SamplingOptions
    from qie.stages.heldout import split_heldout
    from qie.stages.infer import build_predictor

    _, held = split_heldout(scan_folder(data, require_target=True).samples, heldout)
    cfg = compose("infer", ["model=tiny_demo"])
    predictor = build_predictor(typed(cfg.model), typed(cfg.predict), prepare_model(typed(cfg.model)))
    options = SamplingOptions(true_cfg_scale=1.0, num_inference_steps=20)  # the demo's sampling: no CFG
    rows, share = [], dict.fromkeys(loras, 0.0)
    for i, sample in enumerate(held):
        target = np.asarray(Image.open(sample.target).convert("RGB"), dtype=np.float32)
        rejected = np.asarray(Image.open(sample.fields["rejected"]).convert("RGB"), dtype=np.float32)
        shape = (target != rejected).any(axis=-1)
        row = [Image.open(sample.controls[0]).convert("RGB")]
        for name, lora in loras.items():
            predictor.load_lora(lora)
            image = predictor.predict(list(sample.controls), sample.prompt, options, seed=i)[0].convert("RGB")
            mean = np.asarray(image, dtype=np.float32)[shape].mean(axis=0)
            nearer = np.linalg.norm(mean - target[shape][0]) < np.linalg.norm(mean - rejected[shape][0])
            share[name] += float(nearer) / len(held)
            row.append(image)
        rows.append([*row, Image.open(sample.target).convert("RGB")])
    side = rows[0][0].width
    grid = Image.new("RGB", (side * len(rows[0]), side * len(rows)), "white")
    for r, row in enumerate(rows):
        for c, image in enumerate(row):
            grid.paste(image.resize((side, side)), (c * side, r * side))
    grid.save(out / "heldout_edits.png")
    return share


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sft-steps", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--samples", type=int, default=48, help="pairs in all, the held-out ones included")
    parser.add_argument("--heldout", type=int, default=16)
    parser.add_argument("--every", type=int, default=50, help="steps between held-out measurements")
    parser.add_argument("--beta", type=float, default=2000.0)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--sft-weight", type=float, default=0.0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="qie-bench-dpo-"))
    data = make_dataset(out / "data", train=args.samples, heldout=0, seed=0) / "train"
    pairs = add_rejected(data)
    base = ["model=tiny_demo", f"data.path={data}", f"cache.dir={out / 'cache'}"]
    precompute.run(compose("precompute", base), out / "precompute")
    common = [*base, "experiment=demo", f"validation.heldout_samples={args.heldout}", "logging.report_to=none",
              "train.checkpoint_every=100000"]  # fmt: skip
    start, loras = [], {}
    t0 = time.perf_counter()
    if args.sft_steps:  # the held-out pairs are the same: held out by their ids
        sft = train.run(compose("train", [*common, f"train.max_steps={args.sft_steps}"]), out / "sft")
        start = [f"train.init_lora={sft['lora']}", f"train.objective.reference_lora={sft['lora']}"]
        loras["flow_matching"] = sft["lora"]
        print(f"flow matching: held-out loss {sft['heldout_loss']:.4f} after {args.sft_steps} steps")
    overrides = [*common, *start, "train/objective=dpo", f"train.objective.beta={args.beta}", "train.mask.source=edit",
                 f"train.learning_rate={args.lr}", f"train.objective.sft_weight={args.sft_weight}",
                 f"train.max_steps={args.steps}", f"validation.every={args.every}", "validation.num_inference_steps=4",
                 "logging.log_images_count=1"]  # fmt: skip
    result = train.run(compose("train", overrides), out / "run")
    seconds = time.perf_counter() - t0
    follows = colour_fidelity(out, data, args.heldout, {**loras, "dpo": result["lora"]})
    lines = (out / "run" / HELDOUT_FILE).read_text().splitlines()
    measured = [json.loads(line) for line in lines]
    for r in measured:
        print(
            f"step {r['step']:5d}  held-out reward accuracy {r['heldout/reward_accuracy']:.3f}  "
            f"margin {r['heldout/reward_margin']:+.3f}  loss {r['heldout/loss']:.4f}"
        )
    summary = {"pairs": pairs, "heldout": args.heldout, "sft_steps": args.sft_steps, "steps": args.steps,
               "beta": args.beta, "lr": args.lr,
               "sft_weight": args.sft_weight,
               "accuracy_start": 0.5, "accuracy_end": result["heldout_reward_accuracy"],
               "margin_end": result["heldout_reward_margin"], "train_seconds": round(seconds, 1),
               "edits_nearer_the_preferred_colour": follows}  # fmt: skip
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    for name, share in follows.items():
        print(f"held-out edits whose shape is nearer the preferred colour than the rejected one, {name}: {share:.2f}")
    print(
        f"held-out reward accuracy 0.500 -> {summary['accuracy_end']:.3f} after {args.steps} DPO steps "
        f"({pairs - args.heldout} training pairs, {args.heldout} held out, {seconds:.0f} s in all); {out}"
    )


if __name__ == "__main__":
    main()
