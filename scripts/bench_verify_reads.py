"""What checking every cache entry's checksum on read (`cache.verify_reads=true`) costs next to a training step.

Three measures, the variants interleaved within one run:
- reading one sample's entries from the ssd cache (tiny model, 64 px samples), with and without the checksum;
- a whole tiny cached training step (the loop's own step time, `seconds` in metrics.jsonl), both ways;
- the checksum alone over one Edit 1024² sample's bytes (9.95 MiB, benchmarks §8), to scale the cost to a real
  model (whose step takes seconds on a GPU; not measurable here).

    python scripts/bench_verify_reads.py --rounds 5 --steps 12
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_common import REPO, fmt_ms, header, median, timed  # noqa: E402

sys.path.insert(0, str(REPO))


def build(root: Path) -> list[str]:
    """A cached tiny data set under `root`; returns the train overrides pointing at it."""
    from qie.checks import compose
    from qie.components.tiny import default_tiny_path, ensure_tiny_model
    from qie.demo.synthetic import make_dataset
    from qie.stages import precompute

    model = ensure_tiny_model(default_tiny_path("edit"), "edit")
    make_dataset(root, train=8, heldout=0, size=64)
    base = [f"model.pretrained_model_name_or_path={model}", f"data.path={root / 'train'}",
            f"cache.dir={root / 'cache'}"]  # fmt: skip
    precompute.run(compose("precompute", base), root / "precompute_run")
    return base + ["data.num_workers=0", "logging.report_to=none", "logging.log_images=false"]


def read_times(cache: Path, rounds: int) -> dict[bool, float]:
    """Median seconds to read every entry of the cache once, per sample, without and with the checksum."""
    from qie.cache.ssd import SsdBackend

    entries = [(p.parent.parent.name, p.stem) for p in cache.glob("*/??/*.safetensors")]
    samples = len({key for type, key in entries if type == "pixel_latent"})
    backends = {False: SsdBackend(cache), True: SsdBackend(cache, verify_reads=True)}
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(rounds):
        for verify, backend in backends.items():
            times[verify].append(timed(lambda b=backend: [b.get(t, k) for t, k in entries]) / samples)
    return {verify: median(ts) for verify, ts in times.items()}


def step_times(base: list[str], work: Path, steps: int, rounds: int) -> dict[bool, float]:
    """Median seconds of a cached training step (the first of each run left out), without and with the checksum."""
    from qie.checks import compose
    from qie.stages import train

    times: dict[bool, list[float]] = {False: [], True: []}
    for r in range(rounds):
        for verify in (False, True):
            run = work / f"run{r}_{int(verify)}"
            cfg = compose("train", base + [f"train.max_steps={steps}", "train.checkpoint_every=0",
                                           f"cache.verify_reads={str(verify).lower()}"])  # fmt: skip
            train.run(cfg, run)
            rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
            times[verify] += [row["seconds"] for row in rows if "seconds" in row][1:]
    return {verify: median(ts) for verify, ts in times.items()}


def real_size_checksum(rounds: int) -> float:
    """Median seconds of the checksum of one Edit 1024² sample's stored bytes (9.95 MiB of bf16)."""
    import torch

    from qie.cache.codec import checksum

    tensors = {"embed": torch.randn(int(9.95 * 2**20) // 2, dtype=torch.bfloat16)}
    return median([timed(lambda: checksum(tensors)) for _ in range(max(rounds, 5))])


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args(argv)
    header("cache.verify_reads: checksum on every read, next to a training step", argv)
    with tempfile.TemporaryDirectory(prefix="bench_verify_") as tmp:
        work = Path(tmp)
        base = build(work)
        t0 = time.perf_counter()
        reads = read_times(work / "cache", args.rounds * 4)
        steps = step_times(base, work, args.steps, args.rounds)
        big = real_size_checksum(args.rounds)
    extra = reads[True] - reads[False]
    result = {"read_ms": reads[False] * 1e3, "read_verified_ms": reads[True] * 1e3, "step_ms": steps[False] * 1e3,
              "step_verified_ms": steps[True] * 1e3, "checksum_ms_per_sample": extra * 1e3,
              "checksum_share_of_step": extra / steps[False], "checksum_10mib_ms": big * 1e3}  # fmt: skip
    print(f"tiny sample read: {fmt_ms(reads[False])} plain, {fmt_ms(reads[True])} verified "
          f"(+{fmt_ms(extra)} per sample)")  # fmt: skip
    print(f"tiny cached step (batch 1): {fmt_ms(steps[False])} plain, {fmt_ms(steps[True])} verified "
          f"(median of {args.rounds} x {args.steps - 1} steps each)")  # fmt: skip
    print(f"checksum per sample / tiny step: {100 * result['checksum_share_of_step']:.2f} %")
    print(f"checksum of one Edit 1024^2 sample (9.95 MiB): {fmt_ms(big)}")
    print(f"({time.perf_counter() - t0:.0f} s)")
    return result


if __name__ == "__main__":
    main()
