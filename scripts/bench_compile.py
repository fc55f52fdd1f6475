"""Compiled (regional) vs eager training step on the CPU, through the real train stage.

A synthetic data set is cached with the precompute stage (`bench_data_wait.prepare`, the model of `--model`),
then `qie.stages.train.run` runs eager, compiled (`train.compile=true`) and eager again in one process, each
for `--steps` steps; its `on_step_end` hook records each step's wall time. Reported: the median step after
`--warmup` steps per variant, the compiled/eager ratio (against the mean of the two eager runs), and the
compile time (the compiled run's first step less the eager runs' first step). With `--buckets`, batches of
two sizes alternate (two target sizes), to show that the dynamic-shape graph is not compiled again per bucket.

    python scripts/bench_compile.py --model tiny_demo --steps 30
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_common import header, median, run_in_work_dir, table  # noqa: E402


def run_variant(overrides: list[str], run_dir: Path) -> list[float]:
    """Seconds of each step of one train stage run."""
    from qie.config import compose
    from qie.stages import train

    steps: list[float] = []
    train.run(compose("train", overrides), run_dir, on_step_end=lambda info: steps.append(info.seconds))
    return steps


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny_demo")
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--work", default=None)
    p.add_argument("overrides", nargs="*", help="extra train overrides (key=value)")
    args = p.parse_args(argv)
    header("compiled (regional) vs eager training step", ["scripts/bench_compile.py", *(argv or sys.argv[1:])])
    return run_in_work_dir(lambda work: _run(args, work), args.work, "qie_bench_compile_")


def _run(args: argparse.Namespace, work: Path) -> dict:
    from bench_data_wait import prepare

    data, cache = prepare(work, args.samples, args.image_size, [f"model={args.model}"])
    base = [f"model={args.model}", f"data.path={data}", f"cache.dir={cache}", f"train.max_steps={args.steps}",
            "train.checkpoint_every=0", "logging.report_to=none", *args.overrides]  # fmt: skip
    runs = {}
    for name, extra in (("eager", []), ("compiled", ["train.compile=true"]), ("eager again", [])):
        t0 = time.perf_counter()
        runs[name] = run_variant(base + extra, work / name.replace(" ", "_"))
        print(f"{name}: {len(runs[name])} steps in {time.perf_counter() - t0:.1f} s")
    steady = {k: median(v[args.warmup :]) for k, v in runs.items()}
    eager = (steady["eager"] + steady["eager again"]) / 2
    first_eager = (runs["eager"][0] + runs["eager again"][0]) / 2
    rows = [[k, f"{1e3 * steady[k]:.2f}", f"{1e3 * runs[k][0]:.0f}"] for k in runs]
    print(f"\nmedian step after {args.warmup} warm-up steps, {args.steps} steps per run")
    print(table(["variant", "step (ms)", "first step (ms)"], rows))
    ratio = steady["compiled"] / eager
    compile_s = runs["compiled"][0] - first_eager
    print(f"\ncompiled/eager step = {ratio:.2f}x; compile time (first compiled step less the eager first) = "
          f"{compile_s:.1f} s")  # fmt: skip
    return {"ratio": ratio, "compile_seconds": compile_s, "steps": runs}


if __name__ == "__main__":
    main()
