"""Precompute throughput: batched vs one sample at a time, and 2 processes vs 1 (tiny model, CPU).

Each run is a fresh process calling the precompute stage (`qie.stages.precompute.run`), or two under
`torchrun --standalone --nproc_per_node 2` (`accelerate launch --cpu` would silently run one), into a
fresh cache folder. Every process runs with OMP_NUM_THREADS=1 (`--threads`), so one process uses one core
and two use both.

A batch's entries are written once it is encoded, so the entry files' modification times mark when
batches end. Reported per run: the wall time of the whole command (Python start, imports, model load
included), the time to the first entry written (start-up and the first batch), and the steady phase: the
first entry written to the last, over all processes, the samples of each process's first batch left out.
Ratios use the steady rate; wall-time ratios are shown beside it. Runs are interleaved over `--repeats`
and the best taken (other jobs on a shared machine only ever add time).

    python scripts/bench_precompute.py --samples 128 --repeats 1
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from qie.config import typed

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_common import child_env, header, run_in_work_dir, table, target_line  # noqa: E402

SCRIPT = os.path.abspath(__file__)


def child(out_dir: str, overrides: list[str]) -> None:
    """Run the precompute stage in this process (one of torchrun's, or alone); its times and share go to
    out_dir/rank<N>.json."""
    from qie.checks import compose
    from qie.stages import precompute

    rank = int(os.environ.get("RANK", "0"))
    cfg = compose("precompute", overrides)
    t0, c0 = time.time(), time.process_time()
    summary = precompute.run(cfg, Path(out_dir) / "run")
    (mine,) = [p for p in summary.processes if p["process"] == rank]
    info = {"start": t0, "end": time.time(), "cpu": time.process_time() - c0, "samples": mine["samples"]}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(info))


def entry_times(cache: Path) -> list[float]:
    """Modification times of the cache's entry files, sorted."""
    return sorted(p.stat().st_mtime for p in cache.rglob("*.safetensors"))


def run_once(work: Path, data: Path, name: str, batch_size: int, procs: int, threads: int, rep: int) -> dict:
    out = work / f"timings_{name}_{rep}"
    cache = work / f"cache_{name}_{rep}"
    for p in (out, cache):
        shutil.rmtree(p, ignore_errors=True)
    out.mkdir(parents=True)
    overrides = [f"data.path={data}", f"cache.dir={cache}", f"precompute.batch_size={batch_size}"]
    if procs == 1:
        launcher = [sys.executable]
    else:
        torchrun = shutil.which("torchrun") or str(Path(sys.executable).with_name("torchrun"))
        launcher = [torchrun, "--standalone", f"--nproc_per_node={procs}"]
    cmd = [*launcher, SCRIPT, "--child", str(out), "--", *overrides]
    t0 = time.time()
    proc = subprocess.run(cmd, env=child_env(threads), capture_output=True, text=True)
    t1 = time.time()
    if proc.returncode:
        print(proc.stdout[-3000:], proc.stderr[-3000:], sep="\n")
        raise SystemExit(f"precompute run failed ({proc.returncode}): {' '.join(cmd)}")
    ranks = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    if len(ranks) != procs:
        raise SystemExit(f"expected timings from {procs} processes, got {len(ranks)}: {' '.join(cmd)}")
    written = entry_times(cache)
    if not written:
        raise SystemExit(f"no cache entries were written: {' '.join(cmd)}")
    samples = [r["samples"] for r in ranks]
    steady_samples = sum(samples) - sum(min(batch_size, n) for n in samples)
    return {
        "cores": sum(r["cpu"] for r in ranks) / (max(r["end"] for r in ranks) - min(r["start"] for r in ranks)),
        "wall": t1 - t0,
        "steady": written[-1] - written[0],
        "first_entry": written[0] - t0,
        "samples": sum(samples),
        "per_process": samples,
        "steady_samples": steady_samples,
        "cmd": " ".join(["OMP_NUM_THREADS=" + str(threads), *cmd]),
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=128, help="data set size (default 128)")
    p.add_argument("--image-size", type=int, default=64, help="synthetic image side in pixels (default 64)")
    p.add_argument("--batch-size", type=int, default=8, help="the batched run's precompute.batch_size (default 8)")
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of every process (default 1)")
    p.add_argument("--repeats", type=int, default=1, help="interleaved repetitions of each run (default 1)")
    p.add_argument("--work", default=None, help="work folder (default: a temp folder, removed at the end)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(args.child, args.overrides)
        return {}
    header(
        "precompute throughput: batched vs one at a time, 2 processes vs 1 (tiny model, CPU)",
        ["scripts/bench_precompute.py", *(sys.argv[1:] if argv is None else argv)],
    )
    return run_in_work_dir(lambda work: _run(args, work), args.work, "qie_bench_pre_")


def _run(args: argparse.Namespace, work: Path) -> dict:
    from qie.checks import compose
    from qie.components import prepare_model
    from qie.demo.synthetic import make_dataset

    data = work / "ds" / "train"
    if not data.is_dir():
        make_dataset(work / "ds", args.samples, 0, size=args.image_size)
    prepare_model(typed(compose("precompute").model))  # build the tiny model once, outside the timed runs
    runs = {
        "1 process, batch 1": (1, 1),
        f"1 process, batch {args.batch_size}": (args.batch_size, 1),
        f"2 processes, batch {args.batch_size}": (args.batch_size, 2),
    }
    results: dict[str, list[dict]] = {name: [] for name in runs}
    for rep in range(args.repeats):
        for i, (name, (bs, procs)) in enumerate(runs.items()):
            results[name].append(run_once(work, data, f"r{i}", bs, procs, args.threads, rep))

    # Best of the repeats: on a shared machine other jobs only ever add time.
    phases = ("wall", "steady", "first_entry")
    best = {name: {k: min(r[k] for r in rs) for k in phases} for name, rs in results.items()}
    rows = []
    for name, rs in results.items():
        b, r0 = best[name], rs[0]
        rows.append(
            [
                name,
                r0["samples"],
                "/".join(str(n) for n in r0["per_process"]),
                f"{b['wall']:.1f}",
                f"{b['first_entry']:.1f}",
                f"{b['steady']:.1f}",
                f"{rate(results, name, 'steady'):.2f}",
                f"{rate(results, name, 'wall'):.2f}",
                f"{max(r['cores'] for r in rs):.2f}",
            ]
        )
    print(
        f"\n{args.samples} samples of {args.image_size}x{args.image_size} px, OMP_NUM_THREADS={args.threads} per "
        f"process, best of {args.repeats} interleaved run(s); times in s, rates in samples/s"
    )
    print(
        table(
            [
                "run",
                "samples",
                "per process",
                "wall",
                "to first entry",
                "steady phase",
                "rate (steady)",
                "rate (wall)",
                "CPU cores used",
            ],
            rows,
        )
    )
    print(
        "steady phase: first entry file written to the last (each process's first batch left out of its rate).\n"
        "CPU cores used: the processes' CPU time in the stage / the stage's wall time (model load included)."
    )
    print("commands:")
    for name, rs in results.items():
        print(f"  {name}: {rs[0]['cmd']}")
    one, batched, two = list(runs)
    print()
    steady = {name: rate(results, name, "steady") for name in runs}
    ok = [
        target_line("precompute: batched vs one at a time", steady[batched] / steady[one], ">=", 2),
        target_line("precompute: 2 processes vs 1", steady[two] / steady[batched], ">=", 1.8),
    ]
    wall = {name: rate(results, name, "wall") for name in runs}
    print(
        f"same ratios on wall time (start-up included): batched {wall[batched] / wall[one]:.3g}x, "
        f"2 processes {wall[two] / wall[batched]:.3g}x"
    )
    return {"best": best, "results": results, "passed": all(ok)}


def rate(results: dict[str, list[dict]], name: str, phase: str) -> float:
    """Samples per second of the best run: steady samples over the steady phase, or all over the wall time."""
    rs = results[name]
    return rs[0]["steady_samples" if phase == "steady" else "samples"] / min(r[phase] for r in rs)


if __name__ == "__main__":
    main()
