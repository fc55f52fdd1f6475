"""Where the cached training step's time goes: cProfile over steady steps of `qie.stages.train.run`, in-process, on
the data and settings of `scripts/bench_peers.py` (32 text-to-image samples of 128², `model=tiny_t2i`, LoRA rank 16,
batch 1, the train stage's defaults otherwise).

The profiler is switched on after `--warmup` optimizer steps and off `--steps` steps later (the stage's
`on_step_end` hook), so start-up and the run's end are left out. Prints the step's median time with the profiler
off (the steps before it) and the functions taking the most time, cumulative and own. `--end` profiles instead
what runs after the last step (the last checkpoint, the exports, the report, closing the logs) until the stage
returns, with a checkpoint at the end as `bench_peers.py` runs it.

    python scripts/profile_step.py --warmup 60 --steps 200
    python scripts/profile_step.py --warmup 60 --end
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_common import header, run_in_work_dir  # noqa: E402
from bench_peers import QIE_BASE, QIE_TRAIN, prepare  # noqa: E402


def profile(args: argparse.Namespace, work: Path) -> dict:
    from qie.checks import compose
    from qie.stages import train

    data, cache = prepare(work, 32, 128)
    profiler, plain = cProfile.Profile(), []
    last = args.warmup + (0 if args.end else args.steps)

    def hook(info) -> None:  # a qie.training.loop.StepInfo
        if info.step <= args.warmup:
            plain.append(info.seconds)
        if info.step == args.warmup and not args.end:
            profiler.enable()
        elif info.step == last:
            profiler.enable() if args.end else profiler.disable()

    overrides = [*QIE_BASE, *QIE_TRAIN, f"data.path={data}", f"cache.dir={cache}", f"train.max_steps={last}"]
    checkpoints = f"train.checkpoint_every={last if args.end else 0}"
    train.run(compose("train", [*overrides, checkpoints]), work / "run", on_step_end=hook)
    profiler.disable()
    steady = plain[10:]
    print(f"\nmedian step without the profiler (steps 11-{args.warmup}): {1e3 * statistics.median(steady):.2f} ms")
    for order in ("cumulative", "tottime"):
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats(order).print_stats(args.top)
        what = "the run's end" if args.end else f"{args.steps} profiled steps"
        print(f"\n--- {what}, by {order} time ---")
        print(out.getvalue().split("\n\n", 1)[-1])
    return {"median_ms": 1e3 * statistics.median(steady)}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--warmup", type=int, default=60)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--top", type=int, default=35, help="functions listed per order")
    p.add_argument("--end", action="store_true", help="profile what runs after the last step instead")
    p.add_argument("--work", default=None)
    args = p.parse_args(argv)
    argv_shown = sys.argv[1:] if argv is None else argv
    header("the cached step, profiled (tiny_t2i)", ["scripts/profile_step.py", *argv_shown])
    return run_in_work_dir(lambda work: profile(args, work), args.work, "qie_profile_step_")


if __name__ == "__main__":
    main()
