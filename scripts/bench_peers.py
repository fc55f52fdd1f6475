"""The cached training step side by side: qie at its defaults against peers, same tiny model and data.

Data: 32 text-to-image samples of 128² (noise images, one caption each), the tiny text-to-image Qwen-Image
(`model=tiny_t2i`), LoRA rank 16, batch 1, fp32, 80 steps. qie fills its cache with `python -m qie.precompute`
once, then each variant runs `python -m qie.train` as a user would (a fresh process; TensorBoard and
metrics.jsonl on, checkpoint at the end), interleaved with the others `--repeats` times. Per run it reports
the median step after `--warmup` steps (qie: the `seconds` of metrics.jsonl, the loop's wall time per step),
the time from process start to the first step's metrics line, and the peak resident memory of the whole
process tree (sampled every 20 ms from /proc).

A peer is run only when its script is given: `--diffusers-example PATH` takes diffusers'
`examples/dreambooth/train_dreambooth_lora_qwen_image.py` from a diffusers checkout (not shipped here), run on
the same tiny model folder and images with its own per-step timing read from its progress bar.

    python scripts/bench_peers.py --repeats 3
    python scripts/bench_peers.py --diffusers-example $DIFFUSERS/examples/dreambooth/train_dreambooth_lora_qwen_image.py
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_common import REPO, child_env, header, median, run_in_work_dir, table  # noqa: E402

QIE_BASE = ["model=tiny_t2i", "data.target_pixels=16384", "data.multiple_of=16"]
QIE_TRAIN = ["train.lora.rank=16", "train.lora.alpha=16", "data.batch_size=1"]


def prepare(work: Path, samples: int, size: int) -> tuple[Path, Path]:
    """The data set (text to image: training_images/ only) and qie's cache of it."""
    import numpy as np
    from PIL import Image

    from qie.config import compose
    from qie.stages import precompute

    data, cache = work / "ds", work / "cache"
    images = data / "training_images"
    if not images.is_dir():
        images.mkdir(parents=True)
        rng = np.random.default_rng(0)
        for i in range(samples):
            pixels = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(images / f"{i:03d}.png")
            (images / f"{i:03d}.txt").write_text(f"a noise picture number {i}\n")
    cfg = compose("precompute", [*QIE_BASE, f"data.path={data}", f"cache.dir={cache}"])
    precompute.run(cfg, work / "precompute_run")
    return data, cache


def watch(cmd: list[str], env: dict, first_step: Path | None, log: Path, cwd: str | None = None) -> dict:
    """Run `cmd`; its wall time, the time until `first_step` exists, and the process tree's peak RSS."""
    t0 = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=cwd)
        peak, first = 0, None
        while proc.poll() is None:
            peak = max(peak, tree_rss(proc.pid))
            if first is None and first_step is not None and first_step.exists() and first_step.stat().st_size:
                first = time.perf_counter() - t0
            time.sleep(0.02)
    if proc.returncode:
        raise SystemExit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{log.read_text()[-3000:]}")
    return {"wall": time.perf_counter() - t0, "first step": first, "peak rss": peak}


def tree_rss(pid: int) -> int:
    """Resident bytes of `pid` and every descendant (from /proc)."""
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(entry))
        rss[int(entry)] = int(fields[21]) * os.sysconf("SC_PAGE_SIZE")
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        total += rss.get(p, 0)
        todo += children.get(p, [])
    return total


def run_qie(
    work: Path, data: Path, cache: Path, steps: int, extra: list[str], tag: str, repo: str | None = None
) -> dict:
    run_dir = work / f"run_{tag}"
    if run_dir.exists():
        import shutil

        shutil.rmtree(run_dir)
    metrics = run_dir / "metrics.jsonl"
    cmd = [sys.executable, "-m", "qie.train", *QIE_BASE, *QIE_TRAIN, f"data.path={data}", f"cache.dir={cache}",
           f"train.max_steps={steps}", f"train.checkpoint_every={steps}", f"hydra.run.dir={run_dir}",
           *extra]  # fmt: skip
    env = child_env()
    if repo:  # another qie checkout (an earlier version, for a before/after comparison); `-m` reads the cwd first
        env["PYTHONPATH"] = repo
    out = watch(cmd, env, metrics, work / f"{tag}.log", cwd=repo or str(REPO))
    out["steps"] = [json.loads(line)["seconds"] for line in metrics.read_text().splitlines()]
    return out


def run_diffusers(script: Path, work: Path, steps: int) -> dict:
    """diffusers' Qwen-Image LoRA example on the same model folder and images; step times from its tqdm bar."""
    from qie.config import qie_home

    model = qie_home() / "tiny" / "t2i-v1"
    out_dir = work / "diffusers_out"
    cmd = [sys.executable, str(script), f"--pretrained_model_name_or_path={model}",
           f"--instance_data_dir={work / 'ds' / 'training_images'}", "--instance_prompt=a noise picture",
           f"--output_dir={out_dir}", "--resolution=128", "--train_batch_size=1", "--rank=16",
           f"--max_train_steps={steps}", "--learning_rate=1e-4", "--mixed_precision=no", "--seed=0",
           f"--checkpointing_steps={steps}"]  # fmt: skip
    log = work / "diffusers.log"
    out = watch(cmd, child_env(TQDM_DISABLE="0", TQDM_MININTERVAL="0"), None, log)
    # tqdm prints "n/total [elapsed<left, x.xxit/s]" as it goes: per-step times from successive elapsed marks
    marks = [(int(m[1]), _seconds(m[2])) for m in re.finditer(r"(\d+)/\d+ \[(\d+:\d+(?::\d+)?)", log.read_text())]
    out["steps"] = [(b[1] - a[1]) / (b[0] - a[0]) for a, b in zip(marks, marks[1:]) if b[0] > a[0]]
    return out


def _seconds(text: str) -> float:
    parts = [float(p) for p in text.split(":")]
    return sum(p * 60**i for i, p in enumerate(reversed(parts)))


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=32)
    p.add_argument("--size", type=int, default=128)
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--warmup", type=int, default=10, help="steps left out of the median")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--diffusers-example", type=Path, default=None, help="train_dreambooth_lora_qwen_image.py")
    p.add_argument("--variants", nargs="*", default=["defaults", "data.num_workers=2"],
                   help="qie variants: 'defaults' or space-free override lists joined by ','")  # fmt: skip
    p.add_argument("--baseline", default=None, help="another qie checkout, run at its defaults as one more row")
    p.add_argument("--work", default=None)
    args = p.parse_args(argv)
    header("cached training step: qie at its defaults vs peers", ["scripts/bench_peers.py", *(argv or sys.argv[1:])])
    return run_in_work_dir(lambda work: _run(args, work), args.work, "qie_bench_peers_")


def _run(args: argparse.Namespace, work: Path) -> dict:
    data, cache = prepare(work, args.samples, args.size)
    variants = {v: ([] if v == "defaults" else v.split(",")) for v in args.variants}
    runs: dict[str, list[dict]] = {}
    peer = args.diffusers_example
    if peer is not None and not peer.is_file():
        print(f"skipping diffusers' example: {peer} is not a file")
        peer = None
    for r in range(args.repeats):
        for v, (name, extra) in enumerate(variants.items()):
            runs.setdefault(f"qie, {name}", []).append(run_qie(work, data, cache, args.steps, extra, f"q{v}_{r}"))
        if args.baseline:
            runs.setdefault(f"qie at {args.baseline}, defaults", []).append(
                run_qie(work, data, cache, args.steps, [], f"b{r}", args.baseline)
            )
        if peer is not None:
            runs.setdefault("diffusers' Qwen-Image LoRA example", []).append(run_diffusers(peer, work, args.steps))
    rows, summary = [], {}
    for name, rs in runs.items():
        step = median([median(r["steps"][args.warmup :]) for r in rs])
        first = [r["first step"] for r in rs if r["first step"] is not None]
        summary[name] = {"step": step, "first": median(first) if first else None,
                         "peak": max(r["peak rss"] for r in rs)}  # fmt: skip
    fastest = min(s["step"] for s in summary.values())
    base = summary[next(iter(summary))]["step"]
    for name, s in summary.items():
        first = f"{s['first']:.2f}" if s["first"] is not None else "-"
        rows.append([name, f"{1e3 * s['step']:.2f}", f"{s['step'] / base:.2f}x", f"{s['step'] / fastest:.2f}x", first,
                     f"{s['peak'] / 2**20:,.0f}"])  # fmt: skip
    print(f"\nmedian step after {args.warmup} warm-up steps, median of {args.repeats} interleaved run(s)")
    print(table(["trainer", "step (ms)", "vs first row", "vs fastest", "start to first step (s)",
                 "peak RSS of the process tree (MiB)"], rows))  # fmt: skip
    return summary


if __name__ == "__main__":
    main()
