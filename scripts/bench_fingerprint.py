"""Fingerprinting a weight file: the whole file hashed (xxh3_128, `qie.components.fingerprint.weight_hasher`),
from disk (pages evicted first with posix_fadvise DONTNEED) and from the page cache, then the warm lookup
(one stat against the index). The time for 16 GB (a Qwen2.5-VL-7B text encoder in bf16) is extrapolated
from the measured rate when `--gb` is smaller.

    python scripts/bench_fingerprint.py --gb 4
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_common import header, run_in_work_dir  # noqa: E402

from qie.components.fingerprint import weight_hasher  # noqa: E402

CHUNK = 64 << 20


def write(path: Path, gib: float) -> int:
    block = os.urandom(CHUNK)
    total = int(gib * 2**30)
    with open(path, "wb") as f:
        written = 0
        while written < total:
            n = min(CHUNK, total - written)
            f.write(block[:n])
            written += n
        f.flush()
        os.fsync(f.fileno())
    return total


def evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def timed_hash(path: Path, index: Path) -> tuple[float, str, int]:
    hasher = weight_hasher(index)
    t0 = time.perf_counter()
    digest = hasher.hash(path)
    seconds = time.perf_counter() - t0
    hasher.save()
    return seconds, digest, hasher.files_read


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gb", type=float, default=4.0, help="file size in GiB (default 4)")
    p.add_argument("--work", default=None, help="work folder (default: a temp folder, removed)")
    args = p.parse_args(argv)
    command = ["scripts/bench_fingerprint.py", *(sys.argv[1:] if argv is None else argv)]
    header("fingerprint of a weight file (whole file, xxh3_128)", command)
    return run_in_work_dir(lambda work: _run(args, work), args.work, "qie_bench_fp_")


def _run(args: argparse.Namespace, work: Path) -> dict:
    path, index = work / "model.safetensors", work / "weight_hashes.json"
    size = write(path, args.gb)
    evict(path)
    cold, digest, _ = timed_hash(path, work / "cold.json")
    warm, again, _ = timed_hash(path, index)  # the file is in the page cache now
    lookup, known, read = timed_hash(path, index)  # the index remembers it: one stat
    assert digest == again == known and read == 0
    gib = size / 2**30
    rows = {"from disk": cold, "from the page cache": warm}
    for name, seconds in rows.items():
        rate = gib / seconds
        print(f"{name}: {gib:.1f} GiB in {seconds:.2f} s = {rate:.2f} GiB/s -> 16 GiB in {16 / rate:.1f} s")
    print(f"unchanged file, remembered by (path, size, mtime_ns, ctime_ns, inode): {lookup * 1e3:.3f} ms")
    return {"gib": gib, "cold_s": cold, "warm_s": warm, "lookup_s": lookup}


if __name__ == "__main__":
    main()
