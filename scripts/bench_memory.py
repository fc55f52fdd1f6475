"""Peak memory (RSS) of cached vs live training, and which model classes each builds (tiny model, CPU).

Each variant runs `qie.stages.train.run` in a fresh process, started by a fresh runner process that reads
`resource.getrusage(RUSAGE_CHILDREN).ru_maxrss` once its only child has exited: the peak RSS of the
training process (or of a DataLoader worker, if one were larger). Inside the training process every
constructed diffusers `ModelMixin` / transformers `PreTrainedModel` subclass is recorded, and every part
the component registry reports building (its DEBUG log records), so the report shows that cached training
never builds the text encoder or the VAE.

    python scripts/bench_memory.py --samples 16 --steps 20

The cached run's peak is held to the one recorded in `scripts/bench_memory_baseline.json` (at the default sizes):
more than 5 % above it fails the run (exit 1). `--record-baseline` writes the figure just measured there, for a
change that adds memory on purpose (say why in its commit).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_common import check_line, child_env, fmt_bytes, header, run_in_work_dir, table  # noqa: E402

SCRIPT = os.path.abspath(__file__)
BASELINE = Path(SCRIPT).with_name("bench_memory_baseline.json")
ALLOWED_GROWTH = 0.05  # the cached run's peak may exceed the recorded one by this share
ENCODER_MARKERS = ("Qwen2_5_VL", "Qwen2VL", "AutoencoderKL")


def child(args: argparse.Namespace) -> None:
    """Train once with constructor tracking; write what was built and this process's own peak RSS."""
    import logging

    import diffusers
    import transformers

    from qie.checks import compose
    from qie.stages import train

    classes: dict[str, int] = {}
    parts: list[str] = []

    def track(base: type) -> None:
        real = base.__init__

        def __init__(self, *a, **kw):
            name = f"{type(self).__module__.split('.')[0]}.{type(self).__name__}"
            classes[name] = classes.get(name, 0) + 1
            real(self, *a, **kw)

        base.__init__ = __init__

    class BuiltParts(logging.Handler):
        """Collects the parts the component registry reports building (its DEBUG records carry `part`)."""

        def emit(self, record: logging.LogRecord) -> None:
            if hasattr(record, "part"):
                parts.append(record.part)

    track(diffusers.ModelMixin)
    track(transformers.PreTrainedModel)
    registry_log = logging.getLogger("qie.components.registry")
    registry_log.setLevel(logging.DEBUG)
    registry_log.addHandler(BuiltParts())
    t0 = time.perf_counter()
    train.run(compose("train", args.overrides), Path(args.run_dir))
    out = {
        "classes": classes,
        "parts": parts,
        "self_maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
        "seconds": time.perf_counter() - t0,
    }
    Path(args.out).write_text(json.dumps(out))


def measure(args: argparse.Namespace) -> None:
    """Run the child command given after `--`, then record RUSAGE_CHILDREN's peak RSS (this runner has
    no other child)."""
    proc = subprocess.run(args.overrides, capture_output=True, text=True)
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    Path(args.out).write_text(
        json.dumps({"rc": proc.returncode, "children_maxrss_kib": peak, "tail": (proc.stdout + proc.stderr)[-4000:]})
    )


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=16, help="data set size (default 16)")
    p.add_argument("--image-size", type=int, default=64, help="synthetic image side in pixels (default 64)")
    p.add_argument("--steps", type=int, default=20, help="training steps per run (default 20)")
    p.add_argument("--modes", nargs="+", default=["cached", "live"], choices=["cached", "live", "lazy"])
    p.add_argument("--work", default=None, help="work folder (default: a temp folder, removed at the end)")
    p.add_argument("--record-baseline", action="store_true", help=f"write the cached run's peak to {BASELINE.name}")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--run-dir", help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*", help="extra Hydra overrides for the train stage (key=value)")
    args = p.parse_args(argv)
    if args.child:
        child(args)
        return {}
    if args.measure:
        measure(args)
        return {}
    header(
        "peak RSS of cached vs live training, and the model classes each builds (tiny model)",
        ["scripts/bench_memory.py", *(sys.argv[1:] if argv is None else argv)],
    )
    return run_in_work_dir(lambda work: _run(args, work), args.work, "qie_bench_mem_")


def _run(args: argparse.Namespace, work: Path) -> dict:
    from qie.checks import compose
    from qie.demo.synthetic import make_dataset
    from qie.stages import precompute

    data, cache = work / "ds" / "train", work / "cache"
    if not data.is_dir():
        make_dataset(work / "ds", args.samples, 0, size=args.image_size)
    # Fill the cache (and build the tiny model) here, so no measured process builds anything but training.
    precompute.run(compose("precompute", [f"data.path={data}", f"cache.dir={cache}"]), work / "precompute_run")

    results = {}
    for mode in args.modes:
        run_dir, out, measured = work / f"train_{mode}", work / f"built_{mode}.json", work / f"rss_{mode}.json"
        shutil.rmtree(run_dir, ignore_errors=True)
        overrides = [
            f"data.path={data}",
            f"cache.dir={cache}",
            f"cache.mode={mode}",
            f"train.max_steps={args.steps}",
            "train.checkpoint_every=0",
            *args.overrides,
        ]
        train_cmd = [sys.executable, SCRIPT, "--child", "--out", str(out), "--run-dir", str(run_dir), "--", *overrides]
        runner = [sys.executable, SCRIPT, "--measure", "--out", str(measured), "--", *train_cmd]
        subprocess.run(runner, env=child_env(), check=True)
        m = json.loads(measured.read_text())
        if m["rc"]:
            print(m["tail"])
            raise SystemExit(f"training run failed ({m['rc']}): {' '.join(train_cmd)}")
        results[mode] = {**json.loads(out.read_text()), **m}

    rows = []
    for mode, r in results.items():
        rows.append(
            [
                mode,
                fmt_bytes(r["children_maxrss_kib"] * 1024),
                fmt_bytes(r["self_maxrss_kib"] * 1024),
                ", ".join(dict.fromkeys(r["parts"])),
                f"{r['seconds']:.1f}",
            ]
        )
    print(f"\n{args.steps} steps on {args.samples} samples per mode, each in a fresh process")
    print(
        table(
            ["mode", "peak RSS (RUSAGE_CHILDREN)", "training process alone", "parts built", "run s"],
            rows,
        )
    )
    print("\nmodel classes constructed (diffusers ModelMixin / transformers PreTrainedModel subclasses, count):")
    for mode, r in results.items():
        print(f"  {mode}: " + ", ".join(f"{k} x{v}" for k, v in r["classes"].items()))
    print()
    ok = True
    if "cached" in results:
        r = results["cached"]
        encoders = [c for c in r["classes"] if any(m in c for m in ENCODER_MARKERS)]
        extra = sorted(set(r["parts"]) - {"transformer", "scheduler"})
        ok &= check_line(
            "cached training builds neither the text encoder nor the VAE",
            not encoders and not extra,
            f"parts {sorted(set(r['parts']))}, encoder classes {encoders or 'none'}",
        )
    if "cached" in results and "live" in results:
        c, live = results["cached"]["children_maxrss_kib"], results["live"]["children_maxrss_kib"]
        print(f"peak RSS: cached / live = {c / live:.3f} ({fmt_bytes(c * 1024)} vs {fmt_bytes(live * 1024)})")
    if "cached" in results:
        ok &= against_baseline(results["cached"]["children_maxrss_kib"] / 1024, args)
    return {"results": results, "passed": ok}


def against_baseline(peak_mib: float, args: argparse.Namespace) -> bool:
    """The cached run's peak against the recorded one (at the default sizes only); with `--record-baseline`, write
    it instead."""
    defaults = (args.samples, args.image_size, args.steps, args.overrides) == (16, 64, 20, [])
    if args.record_baseline:
        import subprocess as sp

        commit = sp.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True, cwd=BASELINE.parent)
        record = {"cached_peak_mib": round(peak_mib, 1), "commit": commit.stdout.strip(), "when": time.strftime("%F")}
        BASELINE.write_text(json.dumps(record, indent=2) + "\n")
        print(f"recorded {peak_mib:.1f} MiB in {BASELINE}")
        return True
    if not defaults or not BASELINE.is_file():
        print(f"no baseline to compare with ({'other sizes' if not defaults else f'no {BASELINE.name}'})")
        return True
    recorded = json.loads(BASELINE.read_text())
    limit = recorded["cached_peak_mib"] * (1 + ALLOWED_GROWTH)
    return check_line(
        f"cached peak within {ALLOWED_GROWTH:.0%} of the recorded {recorded['cached_peak_mib']} MiB "
        f"({recorded['commit']})",
        peak_mib <= limit,
        f"{peak_mib:.1f} MiB, limit {limit:.1f} MiB",
    )


if __name__ == "__main__":
    sys.exit(0 if main().get("passed", True) else 1)
