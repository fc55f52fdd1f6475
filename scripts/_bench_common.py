"""Helpers the bench_* scripts share: machine line, tables, target lines, timers.

Machines here are noisy (other jobs share the cores), so the scripts interleave the variants they
compare, repeat them, and report ratios of medians (or minimums) measured within one run; absolute
times are not comparable across runs.
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def machine() -> str:
    """One line naming the machine: cores, memory, CPU, Python, torch and whether CUDA is there."""
    try:
        import torch

        torch_line = f"torch {torch.__version__}, CUDA {'yes' if torch.cuda.is_available() else 'no'}"
    except ImportError:  # pragma: no cover - torch is a dependency
        torch_line = "torch missing"
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
        mem_s = f"{mem:.0f} GiB RAM"
    except (ValueError, OSError, AttributeError):
        mem_s = "RAM unknown"
    try:
        load = "load avg " + " ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        load = "load avg unknown"
    return (
        f"machine: {os.cpu_count()} cores, {mem_s}, {platform.machine()} {platform.system()}, "
        f"Python {platform.python_version()}, {torch_line}, {load}"
    )


def header(title: str, argv: Sequence[str] | None = None) -> None:
    """Print the title, the command line that produced the output and the machine."""
    args = " ".join(sys.argv if argv is None else argv)
    os.environ.setdefault("TQDM_DISABLE", "1")  # progress bars of the stages the scripts run in-process
    print(f"== {title}")
    print(f"command: python {args}")
    print(machine())


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A plain aligned text table (first column left-aligned, the rest right-aligned)."""
    cells = [[str(h) for h in headers]] + [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(r: list[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))

    sep = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), sep] + [line(r) for r in cells[1:]])


def _fmt(c: object) -> str:
    if isinstance(c, float):
        if c == 0 or abs(c) >= 100:
            return f"{c:,.1f}"
        if abs(c) >= 1:
            return f"{c:.2f}"
        return f"{c:.3g}"
    if isinstance(c, int):
        return f"{c:,}"
    return str(c)


def target_line(name: str, value: float, op: str, target: float, unit: str = "x") -> bool:
    """Print `name = 4.1x (target >= 3x) PASS` and return whether the target is met."""
    ok = value >= target if op == ">=" else value <= target
    print(f"{name} = {value:.3g}{unit} (target {op} {target:g}{unit}) {'PASS' if ok else 'FAIL'}")
    return ok


def check_line(name: str, ok: bool, detail: str = "") -> bool:
    """Print a yes/no target line: `name: detail PASS`."""
    print(f"{name}: {detail} {'PASS' if ok else 'FAIL'}".replace("  ", " "))
    return ok


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def timed(fn: Callable[[], object]) -> float:
    """Seconds one call of `fn` takes (perf_counter)."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def fmt_ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms"


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"  # pragma: no cover


def child_env(threads: int | None = None, **extra: str) -> dict[str, str]:
    """The environment for a child process: this one's, with the repo importable, optionally pinning
    torch/OpenMP threads, and without tqdm noise."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(REPO), env.get("PYTHONPATH", "")] if p)
    env.setdefault("TQDM_DISABLE", "1")
    env.setdefault("HYDRA_FULL_ERROR", "1")
    if threads is not None:
        for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
            env[k] = str(threads)
    env.update(extra)
    return env


def run_in_work_dir(run: Callable[[Path], dict], work: str | None, prefix: str) -> dict:
    """Run `run(folder)` in `work`, or in a temporary folder that is removed afterwards."""
    import shutil
    import tempfile

    folder = Path(work) if work else Path(tempfile.mkdtemp(prefix=prefix))
    folder.mkdir(parents=True, exist_ok=True)
    try:
        return run(folder)
    finally:
        if not work:
            shutil.rmtree(folder, ignore_errors=True)
