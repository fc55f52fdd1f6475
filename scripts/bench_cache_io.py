"""Cache read per sample on Qwen-Image-Edit shapes: the ssd backend vs `.pt` + torch.load vs a raw read.

Per sample it writes the six cache types at the shapes of a 1024x1024 Edit sample (latents 16x1x128x128
for the target and the control, prompt embeddings ~1,300x3,584 and empty-prompt embeddings ~1,290x3,584
in bf16 that share their first 1,285 rows (the image tokens before the instruction), their int64 masks) in
two formats:

- ssd:  `qie.cache.entries.write_entries` over `SsdBackend` (one safetensors file per stored entry, bf16,
        unpadded, the shared prefix stored once with the empty-prompt entry, masks derived), read with
        `read_entries` (what training's cached source reads: the prompt comes back as prefix + suffix views);
- ssd verified: the same with `verify_reads=True` (each entry's xxh3 checksum checked on read);
- .pt:  one `torch.save` file per type in fp16 (the format common in existing fine-tuning tools), read
        with `torch.load(weights_only=True)`;
- raw:  `open(path, "rb").read()` of the very safetensors files the ssd backend reads (bytes only).

Bytes on disk are also compared with 3 instructions per control image (one control latent and one
empty-prompt entry serve three samples in the ssd format; the .pt format stores every type per sample).

All reads are warm (the files sit in the page cache: dropping it needs root): one untimed pass of each
variant first, then `--rounds` timed passes in rotating order; per-sample time = median pass / samples.
Each format is timed three ways: the read alone; the read, then one byte of every 4 KiB page of what it
returned touched; the read, then every tensor copied (as collate does). The ssd backend maps big files
instead of reading them, so its read alone defers the page-cache copy to first use; the targets are
judged on "read + touch", which pays for that.

    python scripts/bench_cache_io.py --samples 64 --rounds 5
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_common import fmt_bytes, header, median, table, target_line  # noqa: E402

from qie.cache.base import decode  # noqa: E402
from qie.cache.entries import STORED_TYPES, read_entries, write_entries  # noqa: E402
from qie.cache.keys import entry_key  # noqa: E402
from qie.cache.ssd import MMAP_MIN_BYTES, SsdBackend, read_file  # noqa: E402
from qie.stages.precompute_work import OPTIONAL_TYPES  # noqa: E402

# What an Edit sample stores (the benchmark's sample): no layers, no rejected result.
EDIT_TYPES = [t for t in STORED_TYPES if t not in OPTIONAL_TYPES]
# The six entry types of the layout before the shared prefix (what `sample_tensors` makes).
WHOLE_TYPES = (
    "pixel_latent",
    "control_latent",
    "prompt_embed",
    "prompt_embeds_mask",
    "empty_prompt_embed",
    "empty_prompt_embeds_mask",
)


def sample_tensors(i: int, group: int, args: argparse.Namespace, g: torch.Generator) -> dict[str, dict]:
    """The six entries of sample `i` (control-image set `group`) as the Encoder produces them (bf16 values,
    int64 masks); the prompt and empty-prompt embeddings of one control-image set share their prefix."""
    c, h, w = args.latent_channels, args.latent_size, args.latent_size

    def rnd(*shape: int, seed: int | None = None) -> torch.Tensor:
        gen = g if seed is None else torch.Generator().manual_seed(seed)
        return torch.randn(*shape, generator=gen, dtype=torch.float32).to(torch.bfloat16)

    # Lengths vary a little per sample, as real prompts do; what depends on the control images only is
    # drawn from the control-image set's own seed.
    n_prefix = args.prefix_tokens + group % 3
    prefix = rnd(n_prefix, args.dim, seed=group)
    empty = torch.cat([prefix, rnd(args.empty_tokens - args.prefix_tokens, args.dim, seed=10**6 + group)])
    prompt = torch.cat([prefix, rnd(args.prompt_tokens - args.prefix_tokens + i % 7, args.dim)])
    return {
        "pixel_latent": {"latent": rnd(c, 1, h, w)},
        "control_latent": {"0": rnd(c, 1, h, w, seed=2 * 10**6 + group)},
        "prompt_embed": {"embed": prompt},
        "prompt_embeds_mask": {"mask": torch.ones(len(prompt), dtype=torch.long)},
        "empty_prompt_embed": {"embed": empty},
        "empty_prompt_embeds_mask": {"mask": torch.ones(len(empty), dtype=torch.long)},
    }


def sample_keys(i: int, group: int) -> dict[str, str]:
    """Keys as training computes them: the control-image set decides the control and empty-prompt keys."""
    keys = {
        "pixel_latent": entry_key("pixel_latent", {"sample": i}),
        "control_latent": entry_key("control_latent", {"controls": group}),
        "prompt_embed": entry_key("prompt_embed", {"controls": group, "sample": i}),
        "empty_prompt_embed": entry_key("empty_prompt_embed", {"controls": group}),
    }
    return keys


def write_sample(backend, pt_root: Path, i: int, group: int, args, g, whole=None) -> tuple[dict[str, str], list[str]]:
    """Write sample `i` in both formats (and, to `whole`, as six whole entries: the layout before the shared
    prefix); returns its ssd keys and its .pt files."""
    keys = sample_keys(i, group)
    entries = sample_tensors(i, group, args, g)
    write_entries(backend, keys, {t: entries[t] for t in EDIT_TYPES})
    for type, tensors in entries.items() if whole is not None else ():
        whole.put(type, entry_key(type, {"sample": i}), tensors)
    folder = pt_root / f"{i:06d}"
    folder.mkdir(parents=True, exist_ok=True)
    pts = []
    for type, tensors in entries.items():
        path = str(folder / f"{type}.pt")
        torch.save(to_pt(tensors), path)
        pts.append(path)
    return keys, pts


class Reading:
    """`backend`'s entries read whole into memory and decoded, as `get` did before it mapped files."""

    def __init__(self, backend: SsdBackend) -> None:
        self.backend = backend

    def get(self, type: str, key: str):
        return decode(read_file(self.backend.path(type, key)), type)


def stored_files(backend, keys: list[dict[str, str]]) -> list[str]:
    """The distinct entry files of these samples (a shared entry counted once)."""
    return sorted({str(backend.path(t, k[t])) for k in keys for t in EDIT_TYPES})


def to_pt(entry: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The .pt format's content: floating tensors as fp16, the rest as they are."""
    return {k: t.half() if t.is_floating_point() else t for k, t in entry.items()}


def disk_bytes(paths: list[str]) -> tuple[int, int]:
    """(apparent bytes, allocated bytes) of the files."""
    size = blocks = 0
    for p in paths:
        st = os.stat(p)
        size += st.st_size
        blocks += st.st_blocks * 512
    return size, blocks


def touch(t: torch.Tensor) -> None:
    """Make every page of the tensor resident: read one byte per 4 KiB page."""
    t.reshape(-1).view(torch.uint8)[::4096].sum()


def copy(t: torch.Tensor) -> None:
    """Copy the tensor, as collate does (stack / pad into a new batch tensor)."""
    t.clone()


# What each timed variant does with what a read returned.
USES = {"read": None, "read + touch": touch, "read + copy": copy}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=64, help="samples written in each format (default 64)")
    p.add_argument("--rounds", type=int, default=5, help="timed passes per variant (default 5)")
    p.add_argument("--latent-size", type=int, default=128, help="latent side (1024 px / 8 = 128)")
    p.add_argument("--latent-channels", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=1300)
    p.add_argument("--empty-tokens", type=int, default=1290)
    p.add_argument("--prefix-tokens", type=int, default=1285, help="rows a prompt shares with the empty prompt")
    p.add_argument("--dim", type=int, default=3584, help="prompt embedding width (Qwen2.5-VL-7B: 3584)")
    p.add_argument(
        "--ssd-read",
        choices=["auto", "read"],
        default="auto",
        help="auto: SsdBackend.get as shipped (maps files >= MMAP_MIN_BYTES); read: the entry files read() "
        "whole and decoded as get decodes them (the read path before mapping)",
    )
    p.add_argument("--dir", default=None, help="work folder (default: a temp folder, removed at the end)")
    p.add_argument("--keep", action="store_true", help="keep the work folder")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    header(
        "cache read per sample: ssd backend vs .pt + torch.load vs raw read",
        ["scripts/bench_cache_io.py", *(sys.argv[1:] if argv is None else argv)],
    )
    work = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="qie_bench_io_"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        return _run(args, work)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


def _run(args: argparse.Namespace, work: Path) -> dict:
    if args.ssd_read == "read":
        print("ssd entries read() whole into memory and decoded (--ssd-read read: the read path before mapping)")
    else:
        print(f"ssd backend maps files of >= {fmt_bytes(MMAP_MIN_BYTES)}, reads smaller ones")
    backend = SsdBackend(work / "ssd")
    verified = SsdBackend(work / "ssd", verify_reads=True)
    reader = Reading(backend) if args.ssd_read == "read" else backend
    whole = SsdBackend(work / "ssd_whole")
    pt_root = work / "pt"
    g = torch.Generator().manual_seed(0)
    ssd_keys: list[dict[str, str]] = []
    pt_files: list[list[str]] = []
    t0 = time.perf_counter()
    for i in range(args.samples):
        keys, pts = write_sample(backend, pt_root, i, i, args, g, whole)
        ssd_keys.append(keys)
        pt_files.append(pts)
    print(f"wrote {args.samples} samples (4 stored types for ssd, 6 for .pt) in {time.perf_counter() - t0:.1f} s")
    raw_files = [[str(backend.path(t, k[t])) for t in EDIT_TYPES] for k in ssd_keys]

    def read_ssd(use, source=reader) -> None:
        for keys in ssd_keys:
            found, missing = read_entries(source, keys, EDIT_TYPES)
            assert not missing
            if use:
                for entry in found.values():
                    for x in entry.values():
                        for piece in x if isinstance(x, tuple) else (x,):
                            use(piece)

    def read_whole(use) -> None:
        for i in range(len(ssd_keys)):
            for type in WHOLE_TYPES:
                for x in whole.get(type, entry_key(type, {"sample": i})).values():
                    if use:
                        use(x)

    def read_pt(use, mmap: bool = False) -> None:
        for paths in pt_files:
            for path in paths:
                entry = torch.load(path, weights_only=True, mmap=mmap)
                if use:
                    for x in entry.values():
                        use(x)

    def read_raw(use) -> None:
        for paths in raw_files:
            for path in paths:
                with open(path, "rb") as f:
                    data = f.read()
                if use:
                    with warnings.catch_warnings():  # frombuffer of bytes: read-only, which is fine here
                        warnings.simplefilter("ignore")
                        use(torch.frombuffer(data, dtype=torch.uint8))

    ssd, pt, raw = "ssd (read_entries)", ".pt fp16 (torch.load)", "raw (open().read())"
    ssd_v = "ssd verify_reads=true"
    pt_mmap = ".pt fp16 (torch.load mmap=True) [info]"
    before = "ssd, six whole entries (layout before schema 2)"
    methods = {ssd: read_ssd, ssd_v: lambda use: read_ssd(use, verified), before: read_whole, pt: read_pt,
               raw: read_raw, pt_mmap: lambda use: read_pt(use, mmap=True)}  # fmt: skip
    variants = [(name, use) for use in USES for name in methods]
    for name, use in variants:  # warm-up pass: every file in the page cache
        methods[name](USES[use])
    times: dict[tuple[str, str], list[float]] = {v: [] for v in variants}
    for r in range(args.rounds):
        for name, use in variants[r % len(variants) :] + variants[: r % len(variants)]:
            t = time.perf_counter()
            methods[name](USES[use])
            times[(name, use)].append(time.perf_counter() - t)

    n = args.samples
    per = {v: median(ts) / n for v, ts in times.items()}
    size_ssd, alloc_ssd = disk_bytes([p for paths in raw_files for p in paths])
    size_pt, alloc_pt = disk_bytes([p for paths in pt_files for p in paths])
    print(
        f"\nwarm reads (page cache), {n} samples ({fmt_bytes(size_ssd / n)} per sample on disk in ssd), "
        f"{args.rounds} passes per variant in rotating order; ms per sample (median pass / samples)"
    )
    rows = []
    for name in methods:
        rt = per[(name, "read + touch")]
        rows.append(
            [name]
            + [f"{per[(name, use)] * 1e3:.3f}" for use in USES]
            + [
                f"{min(times[(name, 'read + touch')]) / n * 1e3:.3f}",
                f"{max(times[(name, 'read + touch')]) / n * 1e3:.3f}",
                f"{size_ssd / n / rt / 2**30:.2f}",
            ]
        )
    print(table(["format", *USES, "min (r+t)", "max (r+t)", "GiB/s (r+t)"], rows))
    print("read: the call alone (a mapped ssd read defers the page-cache copy to first use)")
    print("read + touch: then one byte of every 4 KiB page of each result made resident (targets judged here)")
    print("read + copy: then each tensor cloned, as collate's stack/pad does (the copy every format pays)")
    print("\nbytes per sample on disk (ssd: 4 stored types, prefix shared, masks derived; .pt: 6 types)")
    print(
        table(
            ["format", "apparent", "allocated"],
            [
                ["ssd safetensors bf16", fmt_bytes(size_ssd / n), fmt_bytes(alloc_ssd / n)],
                [".pt fp16", fmt_bytes(size_pt / n), fmt_bytes(alloc_pt / n)],
            ],
        )
    )
    vs_pt = per[(pt, "read + touch")] / per[(ssd, "read + touch")]
    vs_raw = per[(raw, "read + touch")] / per[(ssd, "read + touch")]
    disk = size_ssd / size_pt
    print()
    ok = [
        target_line("cache read: ssd vs .pt", vs_pt, ">=", 3),
        target_line("cache read: ssd vs raw read", vs_raw, ">=", 0.8),
        target_line("bytes per sample: ssd / .pt fp16", disk, "<=", 0.55),
    ]
    print(
        "read per sample, shared prefix vs six whole entries: "
        + ", ".join(f"{use} {per[(ssd, use)] / per[(before, use)]:.3g}x" for use in USES)
        + " (below 1: faster)"
    )
    cost = {use: per[(ssd_v, use)] / per[(ssd, use)] - 1 for use in USES}
    print(
        "verify_reads cost (each entry's checksum checked on read): "
        + ", ".join(f"{use} {100 * c:+.1f}%" for use, c in cost.items())
        + f" ({(per[(ssd_v, 'read + copy')] - per[(ssd, 'read + copy')]) * 1e3:.3f} ms per sample)"
    )
    for use in ("read", "read + copy"):
        print(
            f"{use} (info): ssd vs .pt = {per[(pt, use)] / per[(ssd, use)]:.3g}x, "
            f"ssd vs raw = {per[(raw, use)] / per[(ssd, use)]:.3g}x"
        )
    print(
        "mapped .pt (info): ssd vs torch.load(mmap=True) = "
        f"{per[(pt_mmap, 'read + touch')] / per[(ssd, 'read + touch')]:.3g}x (read + touch)"
    )
    print(
        f"bytes on disk: ssd / .pt fp16 = {disk:.3f}x ({fmt_bytes(size_ssd / n)} vs {fmt_bytes(size_pt / n)} "
        "per sample; both 2 bytes per value)"
    )
    three = three_instructions(args, work)
    return {
        "vs_pt": vs_pt,
        "vs_raw": vs_raw,
        "disk_ratio": disk,
        "disk_ratio_3_instructions": three,
        "verify_reads_cost": cost,
        "ms_per_sample": {f"{k[0]}: {k[1]}": v * 1e3 for k, v in per.items()},
        "passed": all(ok),
    }


def three_instructions(args: argparse.Namespace, work: Path) -> float:
    """Bytes on disk with 3 instructions per control image (3 samples share one control-image set)."""
    backend = SsdBackend(work / "ssd3")
    g = torch.Generator().manual_seed(1)
    keys, pts = [], []
    for i in range(max(3, args.samples // 3 * 3)):
        k, p = write_sample(backend, work / "pt3", i, i // 3, args, g)
        keys.append(k)
        pts += p
    ssd, _ = disk_bytes(stored_files(backend, keys))
    pt, _ = disk_bytes(pts)
    ratio = ssd / pt
    n = len(keys)
    print(
        f"bytes on disk, 3 instructions per control image: ssd / .pt fp16 = {ratio:.3f}x "
        f"({fmt_bytes(ssd / n)} vs {fmt_bytes(pt / n)} per sample)"
    )
    return ratio


if __name__ == "__main__":
    main()
