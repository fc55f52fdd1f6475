"""A small speed-and-memory gate on the tiny models, run by hand before a change lands (not in CI's timed tests).

Five figures, each from fresh processes as a user runs them:

- import to error: `python -m qie.train` with a typo (`train.max_step=5`), an out-of-range value
  (`train.max_steps=-5`) and a bad choice (`cache=nvme`), each until it exits (median of `--error-runs`; the slowest
  of the three is the figure), beside `python -c "import hydra, omegaconf"` (the floor: an entry point cannot
  answer before Hydra is imported);
- start to first step, the cached step (median after 10 warm-up steps) and the peak RSS of the process tree:
  one `python -m qie.train` of `--steps` steps on `--samples` text-to-image samples of 128² (`model=tiny_t2i`,
  LoRA rank 16, batch 1: the set-up of `scripts/bench_peers.py`), timed by its step clock;
- precompute throughput: `python -m qie.precompute` of the same samples into a fresh cache, samples per second
  from the first entry written to the last (start-up left out: the steady rate).

Each run appends one JSON line (the figures, the commit, the machine and its load averages) to `--record`
(default `$QIE_HOME/bench_gate.jsonl`) and compares it with the last line recorded there: a figure worse than the
last by more than its allowance fails the gate (exit 1): peak memory 5 %, times and throughput 25 % (timings on a
shared machine move by more than memory does; compare lines taken at similar load).

    python scripts/bench_gate.py                 # measure, compare with the last line, record
    python scripts/bench_gate.py --no-record     # measure and compare only
    python scripts/bench_gate.py --errors-only /path/to/an/older/checkout   # the mistakes alone, in that checkout
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_common import REPO, child_env, header, run_in_work_dir, table  # noqa: E402
from bench_peers import QIE_BASE, prepare, run_qie  # noqa: E402

# How much worse than the last recorded line a figure may be, and which way is worse.
ALLOWANCE = {
    "error_s": (0.25, "higher"),
    "first_step_s": (0.25, "higher"),
    "step_ms": (0.25, "higher"),
    "peak_mib": (0.05, "higher"),
    "precompute_per_s": (0.25, "lower"),
}


# A Hydra typo, an out-of-range value and a bad choice: each is answered with one line and exit 2.
MISTAKES = {"typo": "train.max_step=5", "range": "train.max_steps=-5", "choice": "cache=nvme"}


def error_time(runs: int, repo: Path = REPO) -> dict:
    """Median wall time of each mistake on the command line of `repo`'s `python -m qie.train` (start to exit), and
    of importing Hydra and OmegaConf alone; the slowest mistake as `error_s`."""
    cmds = {name: [sys.executable, "-m", "qie.train", arg] for name, arg in MISTAKES.items()}
    cmds["floor"] = [sys.executable, "-c", "import hydra, omegaconf"]
    times: dict[str, list[float]] = {name: [] for name in cmds}
    env = child_env()
    env.pop("HYDRA_FULL_ERROR", None)  # the user's view: the one-line answer, not Hydra's trace
    env["PYTHONPATH"] = str(repo)
    for _ in range(runs):  # interleaved: load changes hit all alike
        for name, cmd in cmds.items():
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=str(repo))
            times[name].append(time.perf_counter() - t0)
            if name != "floor" and proc.returncode not in (1, 2):  # 1: Hydra's own report, in checkouts before
                raise SystemExit(f"no refusal from {' '.join(cmd)} ({proc.returncode}): {proc.stderr[-2000:]}")
    out = {f"{name}_s": statistics.median(ts) for name, ts in times.items()}
    out["error_s"] = max(out[f"{name}_s"] for name in MISTAKES)
    out["error_vs_hydra"] = out["error_s"] / out["floor_s"]
    return out


def precompute_rate(work: Path, data: Path) -> float:
    """Samples per second of `python -m qie.precompute` into a fresh cache: first entry written to the last."""
    cache, run_dir = work / "gate_cache", work / "gate_precompute"
    for folder in (cache, run_dir):
        subprocess.run(["rm", "-rf", str(folder)], check=True)
    cmd = [sys.executable, "-m", "qie.precompute", *QIE_BASE, f"data.path={data}", f"cache.dir={cache}",
           f"hydra.run.dir={run_dir}"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=child_env(), cwd=str(REPO))
    if proc.returncode:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    written = sorted(p.stat().st_mtime for p in (cache / "pixel_latent").rglob("*.safetensors"))
    samples = len(written)
    return (samples - 1) / max(written[-1] - written[0], 1e-6)


def measure(args: argparse.Namespace, work: Path) -> dict:
    data, cache = prepare(work, args.samples, 128)
    figures = error_time(args.error_runs)
    run = run_qie(work, data, cache, args.steps, [], "gate")
    steps = run["steps"][10:]
    figures |= {
        "first_step_s": run["first step"],
        "step_ms": 1e3 * statistics.median(steps),
        "peak_mib": run["peak rss"] / 2**20,
        "precompute_per_s": precompute_rate(work, data),
    }
    return figures


def compare(now: dict, last: dict | None) -> bool:
    """Print each figure beside the last recorded one; False when one is worse than its allowance."""
    rows, ok = [], True
    for key, (allowed, worse) in ALLOWANCE.items():
        before = None if last is None else last["figures"].get(key)
        if before is None:
            rows.append([key, f"{now[key]:.4g}", "-", "-", "first record"])
            continue
        ratio = now[key] / before
        bad = ratio > 1 + allowed if worse == "higher" else ratio < 1 - allowed
        ok &= not bad
        verdict = f"FAIL (allowed {allowed:.0%} {worse})" if bad else "ok"
        rows.append([key, f"{now[key]:.4g}", f"{before:.4g}", f"{ratio:.3f}x", verdict])
    print(table(["figure", "now", "last recorded", "now / last", "verdict"], rows))
    if last is not None:
        print(f"last recorded: {last['when']} at {last['commit']}, load average {last['load']}")
    return ok


def commit() -> str:
    out = subprocess.run(["git", "-C", str(REPO), "describe", "--always", "--dirty"], capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=32)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--error-runs", type=int, default=5)
    p.add_argument("--record", type=Path, default=None, help="the JSON-lines file (default $QIE_HOME/bench_gate.jsonl)")
    p.add_argument("--no-record", action="store_true", help="compare only; append nothing")
    p.add_argument("--work", default=None)
    p.add_argument(
        "--errors-only",
        type=Path,
        default=None,
        metavar="REPO",
        help="time the mistakes only, in the qie checkout REPO (this one: .), and record nothing",
    )
    args = p.parse_args(argv)
    if args.errors_only is not None:
        figures = error_time(args.error_runs, args.errors_only.resolve())
        print(table(["figure", "median s"], [[k, f"{v:.3f}"] for k, v in figures.items()]))
        print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        return 0
    header("speed-and-memory gate (tiny models)", ["scripts/bench_gate.py", *(sys.argv[1:] if argv is None else argv)])
    from qie.config import qie_home

    record = args.record or qie_home() / "bench_gate.jsonl"
    load_before = os.getloadavg()
    figures = run_in_work_dir(lambda work: measure(args, work), args.work, "qie_bench_gate_")
    line = {
        "when": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "commit": commit(),
        "load": [round(x, 2) for x in (*load_before, *os.getloadavg())],  # 1/5/15 min, before and after
        "cores": os.cpu_count(),
        "figures": {k: round(v, 4) for k, v in figures.items()},
    }
    lines = record.read_text().splitlines() if record.is_file() else []
    last = json.loads(lines[-1]) if lines else None
    ok = compare(line["figures"], last)
    print(f"slowest mistake to its answer / import hydra, omegaconf: {figures['error_vs_hydra']:.2f}x")
    if not args.no_record:
        record.parent.mkdir(parents=True, exist_ok=True)
        with record.open("a") as out:
            out.write(json.dumps(line) + "\n")
        print(f"recorded in {record}")
    print("gate: PASS" if ok else "gate: FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
