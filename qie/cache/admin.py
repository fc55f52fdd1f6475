"""Cache administration (stats, clear, verify) as printable reports; `python -m qie.cache` runs them."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from qie.cache.base import CacheBackend, VerifyReport, check_types
from qie.cache.entries import MASK_OF

ACTIONS = ("stats", "clear", "verify")


@dataclass
class AdminReport:
    """The text to print and the exit status a command line should end with."""

    text: str
    exit_code: int = 0
    verify: VerifyReport | None = None

    def __str__(self) -> str:
        return self.text


def format_bytes(n: int) -> str:
    """Human-readable size in binary units: 512 B, 1.5 KiB, 2.3 GiB."""
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        value /= 1024
        if value < 1024 or unit == "PiB":
            break
    return f"{value:.1f} {unit}"


def _count(n: int) -> str:
    return f"{n:,} {'entry' if n == 1 else 'entries'}"


def _table(rows: list[tuple[str, int, int]]) -> list[str]:
    """Aligned lines of (name, entry count, bytes)."""
    name_w = max(len(r[0]) for r in rows)
    count_w = max(len(f"{r[1]:,}") for r in rows)
    return [
        f"{name:<{name_w}}  {c:>{count_w},} {'entry' if c == 1 else 'entries':<7}  {format_bytes(b):>9}"
        for name, c, b in rows
    ]


def cache_stats(backend: CacheBackend, types: Iterable[str] | None = None) -> AdminReport:
    """Entries and bytes per type, and their total, e.g. `prompt_embed  1,204 entries    2.3 GiB`."""
    stats = backend.stats(check_types(types))
    rows = [(t, s["count"], s["bytes"]) for t, s in stats.items()]
    rows.append(("total", sum(r[1] for r in rows), sum(r[2] for r in rows)))
    lines = _table(rows)
    for i, (t, _, _) in enumerate(rows):
        if t in MASK_OF:  # nothing is stored for a mask: it is all ones over its embedding's rows
            lines[i] += f"  (derived from {MASK_OF[t]}, not stored)"
    return AdminReport("\n".join([f"cache: {backend!r}", *lines]))


def clear_cache(backend: CacheBackend, types: Iterable[str] | None = None) -> AdminReport:
    """Remove the entries of `types` (all for None), reporting how many of each went."""
    removed = {t: backend.clear([t]) for t in check_types(types)}
    lines = [f"cache: {backend!r}"]
    lines += [f"{t:<{max(map(len, removed))}}  removed {_count(n)}" for t, n in removed.items()]
    lines.append(f"removed {_count(sum(removed.values()))} in all")
    return AdminReport("\n".join(lines))


def verify_cache(backend: CacheBackend, types: Iterable[str] | None = None, fix: bool = False) -> AdminReport:
    """Read every entry back; list the corrupt ones (and remove them with `fix`).

    The exit code is 1 while corrupt entries remain on disk, else 0.
    """
    report = backend.verify(check_types(types), fix=fix)
    lines = [f"cache: {backend!r}", f"checked {_count(report.checked)}: {len(report.corrupt):,} corrupt"]
    lines += [f"  {c.type} {c.key}: {c.reason}\n    {c.path}" for c in report.corrupt]
    if report.corrupt:
        if fix:
            lines.append(f"removed {_count(report.removed)}; precompute (or lazy mode) writes them again")
        if report.unfixed:
            lines.append(f"{_count(report.unfixed)} left: run again with verify.fix=true to remove them")
        lines.append("precompute with cache.repair=true re-encodes corrupt entries (it reads every entry once)")
    for folder in report.skipped:
        lines.append(f"skipped {folder}: a symlink (verify never follows links out of the cache folder)")
    if report.stale_temp:
        done = f"removed {report.temp_removed:,}" if fix else "verify.fix=true removes them"
        lines.append(f"{len(report.stale_temp):,} temp files left by interrupted writers ({done})")
    return AdminReport("\n".join(lines), exit_code=1 if report.unfixed else 0, verify=report)


def run_admin(backend: CacheBackend, action: str, types: Iterable[str] | None = None, fix: bool = False) -> AdminReport:
    """Run one admin action ("stats", "clear" or "verify") on `backend`.

    Raises:
        ValueError: for an unknown action or cache type.
    """
    if action == "stats":
        return cache_stats(backend, types)
    if action == "clear":
        return clear_cache(backend, types)
    if action == "verify":
        return verify_cache(backend, types, fix)
    raise ValueError(f"unknown cache action {action!r}: choose one of {', '.join(ACTIONS)}")
