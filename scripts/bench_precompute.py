"""Precompute throughput: batched vs one sample at a time, and 2 processes vs 1 (tiny model, CPU).

Each run is the real CLI (`python -m qie.precompute`, or `torchrun --standalone --nproc_per_node 2 -m
qie.precompute` for two processes; `accelerate launch --cpu` would silently run one) into a fresh cache
folder, with `qie.stages.precompute._encode_batch` wrapped to log when each batch starts and ends. Every
process runs with OMP_NUM_THREADS=1 (`--threads`), so one process uses one core and two use both.

Reported per run: the wall time of the whole command (Python start, imports, model load included), the
encode phase (first batch start to last batch end, over all processes) and the steady phase (end of each
process's first batch to the last batch end, samples of first batches left out). Ratios use the encode
phase; the others are shown beside it. Runs are interleaved over `--repeats` and the best taken
(other jobs on a shared machine only ever add time).

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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_common import child_env, header, run_in_work_dir, table, target_line  # noqa: E402

SCRIPT = os.path.abspath(__file__)


def child(out_dir: str, overrides: list[str]) -> None:
    """Run `python -m qie.precompute` in this process with batch timings logged to out_dir/rank<N>.json."""
    import qie.stages.precompute as stage

    batches: list[tuple[float, float, int, float]] = []
    real = stage._encode_batch

    def timed(encoder, batch, *rest, **kw):
        t0, c0 = time.time(), time.process_time()
        out = real(encoder, batch, *rest, **kw)
        batches.append((t0, time.time(), len(batch), time.process_time() - c0))
        return out

    stage._encode_batch = timed
    from qie.precompute import main

    rank = os.environ.get("RANK", "0")
    sys.argv = ["qie.precompute", *overrides]
    try:
        main()
    finally:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"batches": batches}))


def run_once(work: Path, data: Path, name: str, batch_size: int, procs: int, threads: int, rep: int) -> dict:
    out = work / f"timings_{name}_{rep}"
    cache = work / f"cache_{name}_{rep}"
    for p in (out, cache):
        shutil.rmtree(p, ignore_errors=True)
    out.mkdir(parents=True)
    overrides = [
        f"data.path={data}",
        f"cache.dir={cache}",
        f"precompute.batch_size={batch_size}",
        f"hydra.run.dir={work / f'run_{name}_{rep}'}",
    ]
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
    ranks = [json.loads(p.read_text())["batches"] for p in sorted(out.glob("rank*.json"))]
    if len(ranks) != procs:
        raise SystemExit(f"expected timings from {procs} processes, got {len(ranks)}: {' '.join(cmd)}")
    samples = [sum(b[2] for b in r) for r in ranks]
    first_start = min(r[0][0] for r in ranks if r)
    first_end = min(r[0][1] for r in ranks if r)
    last_end = max(r[-1][1] for r in ranks if r)
    steady_samples = sum(samples) - sum(r[0][2] for r in ranks if r)
    cpu = sum(b[3] for r in ranks for b in r)
    return {
        "cores": cpu / (last_end - first_start),
        "wall": t1 - t0,
        "encode": last_end - first_start,
        "steady": last_end - first_end,
        "startup": first_start - t0,
        "samples": sum(samples),
        "per_process": samples,
        "steady_samples": steady_samples,
        "cmd": " ".join(["OMP_NUM_THREADS=" + str(threads), *cmd[:1], *cmd[1:]]),
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
    from qie.components import model_source
    from qie.config import compose
    from qie.demo.synthetic import make_dataset

    data = work / "ds" / "train"
    if not data.is_dir():
        make_dataset(work / "ds", args.samples, 0, size=args.image_size)
    model_source(compose("precompute").model)  # build the tiny model once, outside the timed runs
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
    phases = ("wall", "encode", "steady", "startup")
    med = {name: {k: min(r[k] for r in rs) for k in phases} for name, rs in results.items()}
    rows = []
    for name, rs in results.items():
        m, r0 = med[name], rs[0]
        rows.append(
            [
                name,
                r0["samples"],
                "/".join(str(n) for n in r0["per_process"]),
                f"{m['wall']:.1f}",
                f"{m['startup']:.1f}",
                f"{m['encode']:.1f}",
                f"{r0['samples'] / m['encode']:.2f}",
                f"{r0['steady_samples'] / m['steady']:.2f}",
                f"{r0['samples'] / m['wall']:.2f}",
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
                "start-up",
                "encode phase",
                "rate (encode)",
                "rate (steady)",
                "rate (wall)",
                "CPU cores used",
            ],
            rows,
        )
    )
    print(
        "CPU cores used: the processes' CPU time in the encode phase / its wall time; below ~1.9 for two\n"
        "processes means other jobs on this shared machine took part of the second core during the run."
    )
    print("commands:")
    for name, rs in results.items():
        print(f"  {name}: {rs[0]['cmd']}")
    one, batched, two = list(runs)
    print()
    ok = [
        target_line("precompute: batched vs one at a time", med[one]["encode"] / med[batched]["encode"], ">=", 2),
        target_line("precompute: 2 processes vs 1", med[batched]["encode"] / med[two]["encode"], ">=", 1.8),
    ]
    print(
        f"same ratios on wall time (start-up included): batched {med[one]['wall'] / med[batched]['wall']:.3g}x, "
        f"2 processes {med[batched]['wall'] / med[two]['wall']:.3g}x; on the steady phase: batched "
        f"{rate(results, batched, 'steady') / rate(results, one, 'steady'):.3g}x, 2 processes "
        f"{rate(results, two, 'steady') / rate(results, batched, 'steady'):.3g}x"
    )
    return {"best": med, "results": results, "passed": all(ok)}


def rate(results: dict[str, list[dict]], name: str, phase: str) -> float:
    rs = results[name]
    return rs[0][f"{phase}_samples" if phase == "steady" else "samples"] / min(r[phase] for r in rs)


if __name__ == "__main__":
    main()
