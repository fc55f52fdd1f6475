"""Data wait as a share of a cached training step, measured through the real train stage.

It writes a synthetic data set, fills the cache with the precompute stage (tiny model), then runs
`qie.stages.train.run` in a fresh process per variant with an `on_step_end` hook that records each step's
`StepInfo`: the time the loop waited for the step's batch (`data_seconds`) against the step's wall time
(`seconds`, wait included). The first `--warmup` steps (worker start, first-touch costs) are reported apart
from the steady state the target is judged on. `--prefetch-thread off` sets `data.prefetch=0`.

    python scripts/bench_data_wait.py --samples 32 --steps 100
    python scripts/bench_data_wait.py --workers 0 1 2 --repeats 2      # compare loader worker counts
    python scripts/bench_data_wait.py --backend remote --latency-ms 20 --steps 100   # a bucket, 20 ms per request
    python scripts/bench_data_wait.py --backend remote --latency-ms 20 --step-ms 100  # ... under a 100 ms step

`--backend remote` uploads the cache into a bucket of an S3 server it starts on 127.0.0.1 (moto's; the dev extra)
and trains with `cache=remote` and a fresh node-local copy per run (the first epoch fetches every entry);
`--latency-ms` makes the server hold every request that many milliseconds before answering. `--step-ms N` makes
each step last at least N ms (the hook sleeps out the rest, as the host waits on a device that computes): the
tiny model's own step is far shorter than a real one, and the read-ahead overlaps the step it is given. The target
is a wait under 2 % of the step on a local disk, under 5 % with `--backend remote`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_common import child_env, header, median, table, target_line  # noqa: E402

TARGET = 0.02
REMOTE_TARGET = 0.05


def prepare(work: Path, samples: int, image_size: int, overrides: list[str] = ()) -> tuple[Path, Path]:
    """A synthetic data set and a cache filled by the precompute stage (skipped when already there);
    `overrides` pick another model."""
    from qie.checks import compose
    from qie.demo.synthetic import make_dataset
    from qie.stages import precompute

    data = work / "ds" / "train"
    cache = work / "cache"
    if not data.is_dir():
        make_dataset(work / "ds", samples, 0, size=image_size)
    cfg = compose("precompute", [f"data.path={data}", f"cache.dir={cache}", "precompute.batch_size=8", *overrides])
    t0 = time.perf_counter()
    precompute.run(cfg, work / "precompute_run")
    print(f"precompute: {time.perf_counter() - t0:.1f} s")
    return data, cache


def measure(overrides: list[str], run_dir: Path, step_s: float = 0.0) -> dict:
    """Run the train stage once in this process; per step, the data wait and the wall time (seconds), each step
    lasting at least `step_s` (slept out after it ends, counted in its time)."""
    from qie.checks import compose
    from qie.stages import train

    waits: list[float] = []
    steps: list[float] = []

    def record(info) -> None:  # a qie.training.loop.StepInfo
        pad = max(0.0, step_s - info.seconds)
        if pad:
            time.sleep(pad)
        waits.append(info.data_seconds)
        steps.append(info.seconds + pad)

    cfg = compose("train", overrides)
    t0 = time.perf_counter()
    train.run(cfg, run_dir, on_step_end=record)
    return {"waits": waits, "steps": steps, "total": time.perf_counter() - t0}


def child(args: argparse.Namespace) -> None:
    """Run `measure` for the overrides after `--`; write the timings as JSON to args.out."""
    Path(args.out).write_text(json.dumps(measure(args.overrides, Path(args.run_dir), args.step_ms / 1e3)))


def _remote(args: argparse.Namespace, cache: Path) -> tuple:
    """(server, function of a run's name -> its train overrides) for `--backend remote`; (None, no overrides)."""
    if args.backend != "remote":
        return None, lambda run: []
    import _bench_remote

    server, endpoint = _bench_remote.start_server()
    url = _bench_remote.upload(cache, endpoint, "wait", ("pixel_latent", "control_latent", "prompt_embed",
                                                         "empty_prompt_embed"))  # fmt: skip
    server.latency = args.latency_ms / 1e3  # from now on the server holds every request that long
    return server, lambda run: _bench_remote.overrides(url, endpoint, cache.parent / f"copy_{run}")


def summarise(waits: list[float], steps: list[float], warmup: int) -> dict:
    """Per-step wait and step time, the first `warmup` steps apart."""
    w, s = waits[warmup:], steps[warmup:]
    return {
        "steps": len(s),
        "step_ms": 1e3 * sum(s) / len(s),
        "step_median_ms": 1e3 * median(s),
        "wait_ms": 1e3 * sum(w) / len(w),
        "wait_median_ms": 1e3 * median(w),
        "wait_max_ms": 1e3 * max(w),
        "share": sum(w) / sum(s),
        "warmup_wait_s": sum(waits[:warmup]),
        "warmup_step_s": sum(steps[:warmup]),
        "share_all": sum(waits) / sum(steps),
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=32, help="data set size (default 32)")
    p.add_argument("--image-size", type=int, default=64, help="synthetic image side in pixels (default 64)")
    p.add_argument("--steps", type=int, default=100, help="training steps per run (default 100)")
    p.add_argument("--warmup", type=int, default=10, help="first steps left out of the steady state (default 10)")
    p.add_argument("--batch-size", type=int, default=1, help="data.batch_size (default 1)")
    p.add_argument(
        "--workers", type=int, nargs="+", default=[None], help="data.num_workers values to compare (default: config's)"
    )
    p.add_argument(
        "--prefetch-thread",
        nargs="+",
        choices=["on", "off"],
        default=["on"],
        help="with (data.prefetch as configured) / without (data.prefetch=0) the loader's prefetch thread",
    )
    p.add_argument("--repeats", type=int, default=1, help="runs per variant, interleaved (default 1)")
    p.add_argument("--backend", choices=["ssd", "remote"], default="ssd", help="where training reads the cache")
    p.add_argument("--latency-ms", type=float, default=0.0, help="added to every remote request (--backend remote)")
    p.add_argument("--step-ms", type=float, default=0.0, help="each step lasts at least this long (default: as is)")
    p.add_argument("--threads", type=int, default=None, help="OMP/torch threads of the training process")
    p.add_argument("--work", default=None, help="work folder, reused when it holds a data set (default: temp)")
    p.add_argument("--keep", action="store_true", help="keep the work folder")
    p.add_argument("overrides", nargs="*", help="extra Hydra overrides for the train stage (key=value)")
    # child mode (internal)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--run-dir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(args)
        return {}
    header(
        "data wait as a share of a cached training step (real train stage, tiny model)",
        ["scripts/bench_data_wait.py", *(sys.argv[1:] if argv is None else argv)],
    )
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="qie_bench_wait_"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        return _run(args, work)
    finally:
        if not args.keep and not args.work:
            shutil.rmtree(work, ignore_errors=True)


def _run(args: argparse.Namespace, work: Path) -> dict:
    data, cache = prepare(work, args.samples, args.image_size)
    server, where = _remote(args, cache)
    variants = [(w, t) for w in dict.fromkeys(args.workers) for t in dict.fromkeys(args.prefetch_thread)]
    results: dict[tuple, list[dict]] = {v: [] for v in variants}
    for r in range(args.repeats):
        for v in variants:
            w, thread = v
            run_dir = work / f"train_w{w}_{thread}_{r}"
            shutil.rmtree(run_dir, ignore_errors=True)
            shutil.rmtree(cache.parent / f"copy_{run_dir.name}", ignore_errors=True)
            out = work / f"timings_w{w}_{thread}_{r}.json"
            overrides = [
                f"data.path={data}",
                f"cache.dir={cache}",
                f"train.max_steps={args.steps}",
                f"data.batch_size={args.batch_size}",
                "train.checkpoint_every=0",
                *([f"data.num_workers={w}"] if w is not None else []),
                *(["data.prefetch=0"] if thread == "off" else []),
                *where(run_dir.name),
                *args.overrides,
            ]
            cmd = [sys.executable, os.path.abspath(__file__), "--child", "--out", str(out), "--run-dir", str(run_dir),
                   "--latency-ms", str(args.latency_ms), "--step-ms", str(args.step_ms), "--",
                   *overrides]  # fmt: skip
            proc = subprocess.run(cmd, env=child_env(args.threads), capture_output=True, text=True)
            if proc.returncode:
                print(proc.stdout[-3000:], proc.stderr[-3000:], sep="\n")
                raise SystemExit(f"training run failed ({proc.returncode}): {' '.join(cmd)}")
            t = json.loads(out.read_text())
            res = summarise(t["waits"], t["steps"], args.warmup)
            res["total_s"] = t["total"]
            results[v].append(res)
    if server is not None:
        server.stop()
    return _report(args, results, server is not None)


def _report(args: argparse.Namespace, results: dict[tuple, list[dict]], remote: bool) -> dict:
    """Print the table and target lines of the runs' summaries; returns them with whether the targets passed."""
    rows, best = [], {}
    for v, runs in results.items():
        for i, res in enumerate(runs):
            rows.append(
                [
                    f"{label(v)} run {i + 1}",
                    res["steps"],
                    f"{res['step_ms']:.2f}",
                    f"{res['step_median_ms']:.2f}",
                    f"{res['wait_ms']:.3f}",
                    f"{res['wait_median_ms']:.3f}",
                    f"{res['wait_max_ms']:.2f}",
                    f"{100 * res['share']:.2f}%",
                    f"{res['warmup_wait_s']:.2f} / {res['warmup_step_s']:.2f}",
                    f"{100 * res['share_all']:.1f}%",
                ]
            )
        best[v] = median([res["share"] for res in runs])
    where = f"; cache in a bucket, {args.latency_ms:g} ms added per request" if remote else ""
    where += f"; each step at least {args.step_ms:g} ms" if args.step_ms else ""
    print(
        f"\n{args.steps} steps per run, batch size {args.batch_size}; steady state = steps after the first "
        f"{args.warmup}; times in ms unless marked{where}"
    )
    print(
        table(
            [
                "variant",
                "steps",
                "step mean",
                "step median",
                "wait mean",
                "wait median",
                "wait max",
                "wait share",
                "warm-up wait / step (s)",
                "share incl. warm-up",
            ],
            rows,
        )
    )
    print()
    ok, target = True, REMOTE_TARGET if remote else TARGET
    for v, share in best.items():
        ok &= target_line(f"data wait share of a cached step ({label(v)})", 100 * share, "<=", 100 * target, unit="%")
    return {
        "shares": {label(k): v for k, v in best.items()},
        "results": {label(k): v for k, v in results.items()},
        "passed": ok,
    }


def label(variant: tuple) -> str:
    workers, thread = variant
    return f"workers={'config' if workers is None else workers}, prefetch thread {thread}"


if __name__ == "__main__":
    main()
