"""The benchmark scripts run (tiny sizes, in-process) and print their target lines; and the speed-ups they
led to (mapped cache reads, the loader's prefetch thread, the folder scan) keep their behaviour."""

from __future__ import annotations

import ast
import importlib
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import CachedData, small_overrides

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def script(name: str):
    if str(SCRIPTS) not in sys.path:
        sys.path.insert(0, str(SCRIPTS))
    return importlib.import_module(name)


def test_cache_io_bench_prints_its_ratio_lines(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    # 300 x 512 bf16 prompt embeddings: 300 KiB files, so the mapped read path is the one measured.
    args = ["--samples", "2", "--rounds", "1", "--latent-size", "8", "--dim", "512"]
    args += ["--prompt-tokens", "300", "--empty-tokens", "290", "--prefix-tokens", "285", "--dir", str(tmp_path / "io")]
    result = script("bench_cache_io").main(args)
    out = capsys.readouterr().out
    assert "cache read: ssd vs .pt = " in out and "(target >= 3x)" in out
    assert "cache read: ssd vs raw read = " in out and "(target >= 0.8x)" in out
    assert "bytes on disk: ssd / .pt fp16 = " in out and "bytes on disk, 3 instructions per control image" in out
    assert "verify_reads cost (each entry's checksum checked on read): read " in out
    assert result["vs_pt"] > 0 and result["vs_raw"] > 0
    # the shared image-token prefix halves the bytes (at these shapes the latents weigh little)
    assert result["disk_ratio"] <= 0.55 and result["disk_ratio_3_instructions"] < result["disk_ratio"]
    assert not (tmp_path / "io").exists()  # removed unless --keep


# The GPU table's sections, their titles and the rows each prints, at the smoke run's settings below.
# (title, row names, the column of its rate: s/it, or samples/s).
GPU_TABLE_ROWS = {
    "(a) Training step": (["fp32", "fp32+gc"], 3),
    "(b) Block swap": (["fp32+gc+swap0", "fp32+gc+swap1", "fp32+gc+swap2"], 3),
    "(c) Cached vs live": (["cached", "live"], 1),
    "(d) Precompute throughput": (["1", "2"], 2),
    "(e) Compiled vs eager": (["eager", "compiled"], 1),
}


def _number(cell: str) -> float:
    return float(cell.strip().rstrip("x%").replace(",", ""))


@pytest.mark.slow  # by hand, as the scripts are run
@pytest.mark.parametrize("model", ["qwen_image_edit_2511", "qwen_image_21"])
def test_gpu_table_runs_every_section_at_tiny_size(
    model: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    # Regional compilation with torch's "eager" backend: dynamo captures the block's graph as it does on a GPU,
    # without inductor's C++ build (minutes on two busy cores).
    compile_module = torch.nn.Module.compile
    monkeypatch.setattr(
        torch.nn.Module, "compile", lambda self, *a, **k: compile_module(self, *a, **{**k, "backend": "eager"})
    )
    args = ["--model", model, "--tiny", "--steps", "1", "--warmup", "0", "--weights", "bf16", "--swaps", "0,1,45"]
    args += ["--samples", "3", "--precompute-batches", "1,2", "--out", str(tmp_path / "table.md")]
    result = script("bench_gpu").main(args)
    md = (tmp_path / "table.md").read_text(encoding="utf-8")
    assert md == result["markdown"] and md in capsys.readouterr().out
    tiny = {"qwen_image_edit_2511": "tiny_edit_2511", "qwen_image_21": "tiny_qwen_image_21"}[model]
    assert f"## GPU table: {tiny} (tiny, CPU smoke run: not a benchmark)" in md
    assert "python scripts/bench_gpu.py " + " ".join(args) in md
    assert "machine: no GPU (CPU run);" in md and "diffusers 0.42" in md
    assert "45 clamped to the model's 2 blocks" in md
    assert [line[4:] for line in md.splitlines() if line.startswith("### ")] == [
        next(t for t in bench_titles() if t.startswith(k)) for k in GPU_TABLE_ROWS
    ]
    for title, (names, rate) in GPU_TABLE_ROWS.items():
        body = md.split(f"### {title}")[1].split("### ")[0]
        rows = [[c.strip() for c in line.strip("|").split("|")] for line in body.splitlines() if line.startswith("| ")]
        assert [r[0] for r in rows[1:]] == names, title  # rows[0]: the header
        assert rows[0][rate] in ("s/it", "samples/s (steady)"), title
        for r in rows[1:]:
            assert _number(r[rate]) > 0, (title, r)  # a rate, not OOM, skipped or failed
    step = md.split("### (a)")[1]
    assert float(step.split("Model FLOPs per step: ")[1].split(" TFLOP")[0]) > 0
    assert result["flops"] > 0 and all("error" not in r for r in result["results"].values())
    swapped = result["results"]["swap/fp32+gc+swap2"]
    assert swapped["steps"] == 1 and swapped["peak_alloc_gib"] is None  # CPU: no CUDA memory to report
    # The same model and the same batch: the swapped step's loss is the unswapped one's.
    assert swapped["loss"] == pytest.approx(result["results"]["swap/fp32+gc+swap0"]["loss"], rel=1e-5)
    assert "compiled/eager step = " in md and "compile time" in md


def test_gpu_table_extrapolates_two_depths_to_the_full_model() -> None:
    """Rows at 4 and 8 blocks carried to 60: the line through them, and a swap row scaled by its step row."""
    gpu = script("bench_gpu")
    Row = gpu.Row
    rows = [
        Row("step", "bf16+gc@4", (), (("weights", "bf16"), ("checkpointing", "on"), ("depth", 4)), 4),
        Row("step", "bf16+gc@8", (), (("weights", "bf16"), ("checkpointing", "on"), ("depth", 8)), 8),
        Row("step", "fp8+gc@4", (), (("weights", "fp8"), ("checkpointing", "on"), ("depth", 4)), 4),
        Row("step", "fp8+gc@8", (), (("weights", "fp8"), ("checkpointing", "on"), ("depth", 8)), 8),
        Row(
            "swap",
            "bf16+gc+swap6@8",
            (),
            (("weights", "bf16"), ("swapped", 6), ("asked", ["75%"]), ("blocks", 8), ("depth", 8)),
            8,
        ),  # fmt: skip
    ]
    step = {"first_loss": 1.0, "loss": 0.9}
    results = {
        "step/bf16+gc@4": {**step, "s_per_it": 1.0, "peak_reserved_gib": 6.0},
        "step/bf16+gc@8": {**step, "s_per_it": 1.8, "peak_reserved_gib": 10.0},
        "step/fp8+gc@4": {**step, "first_loss": 1.01, "s_per_it": 0.8, "peak_reserved_gib": 4.0},
        "step/fp8+gc@8": {**step, "first_loss": 1.01, "s_per_it": 1.4, "peak_reserved_gib": 6.0},
        "swap/bf16+gc+swap6@8": {"s_per_it": 2.7, "peak_reserved_gib": 4.0, "block_params": 2**29, "loss": 0.9},
    }
    md = gpu.extrapolation_markdown(rows, results, [4, 8], 60, {None: 60e12}, 1000.0)
    table = {line.split(" | ")[0].lstrip("| "): [c.strip() for c in line.strip("|").split("|")]
             for line in md.splitlines() if line.startswith("| ") and not line.startswith("| config")}  # fmt: skip
    # bf16+gc: 0.2 s and 1 GiB per block -> 1.8 + 52 * 0.2 = 12.2 s, 10 + 52 = 62 GiB; MFU 60 TFLOP / 12.2 s / 1000
    assert table["bf16+gc"][1:8] == ["0.200", "12.200", "1.000", "62.000", "0.5%", "no", "first loss 1.000"]
    assert table["fp8+gc"][1:8] == ["0.150", "9.200", "0.500", "32.000", "0.7%", "no",
                                    "first loss 1.010 (+1.00% vs bf16)"]  # fmt: skip
    # swap 6 of 8 blocks: 1.5x the step; memory 4 + 52 * (1 - 0.75 * 1 GiB of bf16 weights per block) = 17 GiB
    assert table["bf16+gc+swap6@8"][1:6] == ["75%", "1.50x", "18.300", "17.000", "yes"]
    assert "Extrapolated, not measured" in md and "### (f) The full 60-block model, extrapolated from 4 and 8" in md


def bench_titles() -> list[str]:
    return list(script("bench_gpu").TITLES.values())


def test_target_line_format(capsys: pytest.CaptureFixture) -> None:
    common = script("_bench_common")
    assert common.target_line("cache read: ssd vs .pt", 4.1, ">=", 3)
    assert not common.target_line("data wait share", 2.5, "<=", 2, unit="%")
    out = capsys.readouterr().out.splitlines()
    assert out == [
        "cache read: ssd vs .pt = 4.1x (target >= 3x) PASS",
        "data wait share = 2.5% (target <= 2%) FAIL",
    ]


# Entry points: `python -m` targets, which nothing imports.
ENTRY_POINTS = {
    "qie.precompute",
    "qie.train",
    "qie.infer",
    "qie.cli",
    "qie.cache_admin",
    "qie.cache.__main__",
    "qie.demo.__main__",
}


def test_scripts_import_no_entry_point_and_patch_nothing_of_qie() -> None:
    for path in sorted(SCRIPTS.glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        from_qie: set[str] = set()  # local names bound to qie modules or to names taken from them
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    assert alias.name not in ENTRY_POINTS, f"{path.name} imports {alias.name}"
                    if alias.name.split(".")[0] == "qie":
                        from_qie.add(alias.asname or "qie")
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "qie":
                for alias in node.names:
                    name = f"{node.module}.{alias.name}"
                    assert node.module not in ENTRY_POINTS and name not in ENTRY_POINTS, f"{path.name} imports {name}"
                    from_qie.add(alias.asname or alias.name)
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else []
            for target in targets:
                while isinstance(target, (ast.Attribute, ast.Subscript)):
                    target = target.value
                    assert not (isinstance(target, ast.Name) and target.id in from_qie), (
                        f"{path.name}:{node.lineno} assigns into {target.id}, which it took from qie"
                    )


# --- ssd backend: large entries are mapped, not read ------------------------------------------------------


def test_mapped_entries_read_back_and_stay_private(tmp_path: Path) -> None:
    from qie.cache import ssd

    backend = ssd.SsdBackend(tmp_path)
    embed = torch.randn(ssd.MMAP_MIN_BYTES // 2 + 64, dtype=torch.float32).reshape(-1, 2).to(torch.bfloat16)
    backend.put("prompt_embed", "ab" * 8, {"embed": embed})
    path = backend.path("prompt_embed", "ab" * 8)
    assert path.stat().st_size >= ssd.MMAP_MIN_BYTES
    got = backend.get("prompt_embed", "ab" * 8)["embed"]
    assert torch.equal(got, embed)
    got.zero_()  # copy-on-write: the file keeps its values
    assert torch.equal(backend.get("prompt_embed", "ab" * 8)["embed"], embed)
    # A reader's tensors outlive the entry being replaced (writers replace files, never rewrite them).
    first = backend.get("prompt_embed", "ab" * 8)["embed"]
    backend.put("prompt_embed", "ab" * 8, {"embed": embed + 1})
    assert torch.equal(first, embed)
    assert torch.equal(backend.get("prompt_embed", "ab" * 8)["embed"], embed + 1)


def test_truncated_large_entry_is_a_miss(tmp_path: Path) -> None:
    from qie.cache import ssd

    backend = ssd.SsdBackend(tmp_path)
    backend.put("pixel_latent", "cd" * 8, {"latent": torch.randn(4, 1, 256, 256)})
    path = backend.path("pixel_latent", "cd" * 8)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    assert len(data) // 2 >= ssd.MMAP_MIN_BYTES
    assert backend.get("pixel_latent", "cd" * 8) is None


def test_small_and_large_files_load_the_same_bytes(tmp_path: Path) -> None:
    from qie.cache.ssd import load_file, read_file

    path = tmp_path / "f.bin"
    path.write_bytes(bytes(range(256)) * 4096)
    assert torch.equal(load_file(path, mmap_min_bytes=1), read_file(path))
    assert torch.equal(load_file(path, mmap_min_bytes=1 << 40), read_file(path))


# --- the loader's prefetch thread --------------------------------------------------------------------------


def _prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "qie-prefetch"]


def test_prefetcher_keeps_order_and_raises_errors_in_the_consumer() -> None:
    from qie.data.prefetch import Prefetcher

    assert list(Prefetcher(iter(range(50)), 3)) == list(range(50))

    def failing():
        yield 1
        raise ValueError("bad batch")

    p = Prefetcher(failing(), 2)
    assert next(p) == 1
    with pytest.raises(ValueError, match="bad batch"):
        next(p)
    with pytest.raises(StopIteration):
        next(p)


def test_prefetcher_thread_ends_when_the_consumer_drops_it() -> None:
    from qie.data.prefetch import Prefetcher

    def endless():
        n = 0
        while True:
            yield n
            n += 1

    before = len(_prefetch_threads())
    p = Prefetcher(endless(), 2)
    assert [next(p) for _ in range(5)] == [0, 1, 2, 3, 4]
    del p
    deadline = time.monotonic() + 5
    while len(_prefetch_threads()) > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(_prefetch_threads()) == before


def test_make_loader_prefetches_as_asked_and_only_sources_that_do_not_encode_are_prefetched() -> None:

    from qie.data.prefetch import Prefetcher
    from qie.embedding.sources import CachedSource, LazySource, LiveSource
    from qie.stages.train_data import loader_settings
    from qie.training.batches import EmbeddingDataset, make_loader

    class Source:
        encodes = False
        cache = None

        def get(self, samples):
            raise AssertionError("not read")

    sampler = [(0, [0])]
    assert isinstance(iter(make_loader(EmbeddingDataset([], Source()), sampler, 0, 0, prefetch=2)), Prefetcher)
    assert not isinstance(iter(make_loader(EmbeddingDataset([], Source()), sampler, 0, 0, prefetch=0)), Prefetcher)
    # The train stage prefetches (and uses loader workers) only for sources that never run encoders.
    assert (CachedSource.encodes, LazySource.encodes, LiveSource.encodes) == (False, True, True)
    data = (3, 5)  # data.num_workers, data.prefetch
    assert loader_settings(*data, Source()) == (3, 5, False)
    Source.cache = SimpleNamespace(backend=SimpleNamespace(remote_reads=True))  # a bucket: reads in parallel
    assert loader_settings(*data, Source()) == (3, 5, True)
    Source.encodes = True  # encoders stay in the training process and are not run ahead of the step
    assert loader_settings(*data, Source()) == (0, 0, False)


def test_ordered_read_ahead_reads_in_parallel_hands_out_in_order_and_raises_in_turn() -> None:
    from qie.data.prefetch import OrderedReadAhead

    started, release = [], threading.Event()

    def read(item: int) -> int:
        started.append(item)
        if item == 0:
            assert release.wait(5), "the first read was never released"
        if item == 5:
            raise ValueError("item 5 is unreadable")
        return item * 10

    stream = OrderedReadAhead(range(8), read, depth=3)
    taken = []
    taker = threading.Thread(target=lambda: taken.append(next(stream)))
    taker.start()
    deadline = time.monotonic() + 5
    while len(started) < 3 and time.monotonic() < deadline:  # the next two start while the first one waits
        time.sleep(0.01)
    assert sorted(started) == [0, 1, 2]
    release.set()
    taker.join(5)
    assert taken == [0]
    assert [next(stream) for _ in range(4)] == [10, 20, 30, 40]
    with pytest.raises(ValueError, match="item 5 is unreadable"):
        next(stream)
    stream.close()


# --- the scripts that drive the train stage, through its step hook ---------------------------------------


def test_data_wait_and_startup_benches_read_the_steps_of_a_real_run(cached_data: CachedData, tmp_path: Path) -> None:
    overrides = small_overrides("train", *cached_data.overrides, "train.max_steps=3", "data.prefetch=0")
    timings = script("bench_data_wait").measure(overrides, tmp_path / "wait", step_s=0.25)
    assert len(timings["waits"]) == len(timings["steps"]) == 3
    assert all(0 <= w <= s for w, s in zip(timings["waits"], timings["steps"]))
    assert min(timings["steps"]) >= 0.25  # each step lasts the emulated step at least
    assert timings["total"] >= 0.75
    summary = script("bench_data_wait").summarise(timings["waits"], timings["steps"], warmup=1)
    assert summary["steps"] == 2 and 0 <= summary["share"] <= 1
    marks = script("bench_startup").measure(overrides, tmp_path / "start")
    assert 0 <= marks["loop start"] <= marks["first batch"] <= marks["first step done"] <= marks["total"]


def test_step_clock_marks_each_optimizer_step_of_this_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    clock = tmp_path / "clock"
    monkeypatch.setenv("QIE_STEP_CLOCK", str(clock))
    spec = importlib.util.spec_from_file_location("step_clock_under_test", SCRIPTS / "step_clock" / "sitecustomize.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    try:
        weight = torch.nn.Parameter(torch.ones(3))
        optimizer = torch.optim.AdamW([weight])
        for _ in range(3):
            weight.sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    finally:
        module.HANDLE.remove()
        module._OUT.close()
    marks = [float(x) for x in clock.read_text().split()]
    assert len(marks) == 3 and marks == sorted(marks) and abs(marks[0] - time.time()) < 60
    timed = script("bench_peers").clock_steps(clock.read_text(), marks[0] - 2.0)
    assert timed["first step"] == pytest.approx(2.0) and len(timed["steps"]) == 2
    assert timed["steps"] == pytest.approx([marks[1] - marks[0], marks[2] - marks[1]])


def test_peers_report_targets_compare_qie_with_the_best_peer(capsys: pytest.CaptureFixture) -> None:
    peers = script("bench_peers")

    def run(step: float, first: float, peak_mib: int) -> dict:
        peak = peak_mib * 2**20
        return {"steps": [1.0] * 2 + [step] * 5, "first step": first, "peak rss": peak, "after last step": 1.0}

    runs = {"qie, defaults": [run(0.010, 4.0, 400), run(0.012, 5.0, 420)],
            peers.DIFFUSERS: [run(0.009, 30.0, 700)], peers.MUSUBI: [run(0.020, 6.0, 1000)]}  # fmt: skip
    summary = peers.report(runs, warmup=2, repeats=2)
    out = capsys.readouterr().out
    assert summary["qie, defaults"]["step"] == pytest.approx(0.011) and summary["qie, defaults"]["first"] == 4.5
    assert "step at the defaults / fastest peer's = 1.22x (target <= 0.9x) FAIL" in out
    assert "peak RSS / lowest peer's = 0.6x (target <= 1x) PASS" in out
    assert "start to first step / fastest peer's = 0.75x (target <= 1x) PASS" in out
    assert "last step to exit / fastest peer's = 1x (target <= 1x) PASS" in out
    peers.report({"qie, defaults": runs["qie, defaults"]}, warmup=2, repeats=2)
    assert "target" not in capsys.readouterr().out  # no peer, no target lines


# --- the folder scan ----------------------------------------------------------------------------------------


def test_folder_scan_reads_captions_as_read_text_would(tmp_path: Path) -> None:
    from PIL import Image

    from qie.data.scan import scan_dataset

    t, c = tmp_path / "training_images", tmp_path / "control_images"
    t.mkdir()
    c.mkdir()
    for folder, name in [(t, "a.png"), (c, "a.png"), (t, "b.PNG"), (c, "b_control_1.png"), (c, "b_control_0.png")]:
        Image.new("RGB", (8, 8)).save(folder / name, format="PNG")
    (t / "a.txt").write_bytes(b"  line one\r\nline two\rthree\n")
    (c / "b.txt").write_bytes(b"caption beside the control\r\n")
    data = scan_dataset(tmp_path)
    assert [(s.id, s.prompt) for s in data.samples] == [
        ("a", (t / "a.txt").read_text(encoding="utf-8").strip()),
        ("b", "caption beside the control"),
    ]
    assert data.samples[0].prompt == "line one\nline two\nthree"
    assert data.samples[1].target == t / "b.PNG"
    assert data.samples[1].controls == (c / "b_control_0.png", c / "b_control_1.png")


def test_startup_bench_writes_entries_as_the_cache_writes_them(tiny_path: Path, tmp_path: Path) -> None:
    from stage_edges import key_context_for

    from qie.cache.entries import write_entries
    from qie.cache.keys import FileHasher
    from qie.cache.ssd import SsdBackend
    from qie.checks import compose
    from qie.data.keys import sample_keys
    from qie.data.scan import scan_dataset

    bench = script("bench_startup")
    data, cache, info = bench.build(tmp_path / "set", 5, "manifest", per_image=2)
    assert info["entries"] == 20 and info["files"] == 5 + 3 * 3  # one prompt entry each; the rest per image pair
    samples = scan_dataset(data).samples
    assert [s.prompt for s in samples] == [bench._sample(tmp_path / "set", i, 2).prompt for i in range(5)]
    ctx = key_context_for(compose("train", [f"data.path={data}", f"cache.dir={cache}"]))
    fresh = SsdBackend(tmp_path / "fresh")
    for s in samples:
        keys = sample_keys(s, ctx, FileHasher())
        write_entries(fresh, keys, bench._entries())
        for t in bench.ENTRY_TYPES:  # safetensors writes the header's keys in a hash order of its own
            written = SsdBackend(cache).path(t, keys[t]).read_bytes()
            assert _parts(written) == _parts(fresh.path(t, keys[t]).read_bytes())


def _parts(data: bytes) -> tuple[dict, bytes]:
    import json
    import struct

    n = struct.unpack("<Q", data[:8])[0]
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def test_random_model_builds_the_real_class_with_its_tables_and_random_weights() -> None:
    from diffusers import QwenImageTransformer2DModel

    from qie.models.real_size import random_model

    config = {"patch_size": 2, "in_channels": 64, "out_channels": 16, "num_layers": 2, "attention_head_dim": 32,
              "num_attention_heads": 2, "joint_attention_dim": 48, "axes_dims_rope": (8, 12, 12)}  # fmt: skip
    model = random_model(QwenImageTransformer2DModel, config, "cpu", torch.bfloat16, seed=3)
    params = dict(model.named_parameters())
    assert {p.device.type for p in params.values()} == {"cpu"} and {p.dtype for p in params.values()} == {
        torch.bfloat16
    }
    matrix = params["transformer_blocks.0.attn.to_q.weight"].float()
    assert abs(matrix.std().item() - 0.02) < 0.002
    assert torch.equal(params["transformer_blocks.0.attn.norm_q.weight"], torch.ones(32, dtype=torch.bfloat16))
    assert not params["transformer_blocks.0.attn.to_q.bias"].any()
    # The rotary tables (plain tensors, computed in __init__) are the ones a normal construction computes.
    plain = QwenImageTransformer2DModel(**config)
    assert torch.equal(model.pos_embed.pos_freqs, plain.pos_embed.pos_freqs)
    again = random_model(QwenImageTransformer2DModel, config, "cpu", torch.bfloat16, seed=3)
    assert torch.equal(
        again.transformer_blocks[1].img_mlp.net[2].weight, model.transformer_blocks[1].img_mlp.net[2].weight
    )


def test_a_bucket_filled_by_the_server_process_is_the_one_put_requests_fill(
    tiny_path: Path, tmp_path: Path, monkeypatch
) -> None:
    """The remote benchmarks' big caches are put into the S3 server's store by the server process (no HTTP): the
    objects and the index are those PUT requests give, so training reads the same entries and the index answers
    the whole-set check."""
    pytest.importorskip("moto")
    pytest.importorskip("s3fs")
    from qie.cache.remote import RemoteBackend
    from qie.cache.ssd import SsdBackend

    bench, remote = script("bench_startup"), script("_bench_remote")
    _, cache, _ = bench.build(tmp_path / "set", 6, "manifest", per_image=2)
    (tmp_path / "server").mkdir()
    server, endpoint = remote.start_server(tmp_path / "server")
    try:
        url_put = remote.upload(cache, endpoint, "by-put", bench.ENTRY_TYPES, server)
        monkeypatch.setattr(remote, "PUT_LIMIT", 0)
        url_fill = remote.upload(cache, endpoint, "by-fill", bench.ENTRY_TYPES, server)
        backends = [RemoteBackend(url=u, endpoint_url=endpoint, local_dir=tmp_path / f"copy{i}")
                    for i, u in enumerate((url_put, url_fill))]  # fmt: skip
        ssd = SsdBackend(cache)
        items = [(t, k) for t in bench.ENTRY_TYPES for k in ssd.keys(t)]
        assert len(items) == 6 + 3 * 3
        put, fill = backends
        assert fill.store.fs.find(fill.store.root) and put.keys("prompt_embed") == fill.keys("prompt_embed")
        for t, k in items:
            assert fill.store.read(fill.name(t, k)) == put.store.read(put.name(t, k)) == ssd.path(t, k).read_bytes()
        assert all(fill.intact_all(items)) and fill.index.all_whole(items)
    finally:
        server.stop()


def test_startup_bench_builds_its_sets_on_a_fresh_qie_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The keys are the tiny model's: on a QIE_HOME where it was never built, the bench builds it first."""
    home = tmp_path / "home"
    monkeypatch.setenv("QIE_HOME", str(home))
    data, cache, info = script("bench_startup").build(tmp_path / "set", 3, "folder")
    assert info["entries"] == 12 and len(list((cache / "pixel_latent").rglob("*.safetensors"))) == 3
    assert (home / "tiny" / "edit-v1" / "model_index.json").is_file()


def test_the_gate_fails_a_figure_worse_than_its_allowance(capsys: pytest.CaptureFixture) -> None:
    gate = script("bench_gate")
    figures = {"error_s": 1.0, "first_step_s": 4.0, "step_ms": 10.0, "peak_mib": 400.0, "precompute_per_s": 2.0}
    last = {"figures": figures, "when": "2026-12-02T03:00:00", "commit": "abc1234", "load": [1.0] * 6}
    assert gate.compare({**figures, "peak_mib": 419.0, "step_ms": 12.0}, last)  # +4.75 % memory, +20 % step
    assert not gate.compare({**figures, "peak_mib": 421.0}, last)  # memory: more than 5 %
    assert not gate.compare({**figures, "precompute_per_s": 1.4}, last)  # throughput: 30 % lower
    assert gate.compare(figures, None)  # nothing recorded yet: the first line
    out = capsys.readouterr().out
    assert "FAIL (allowed 5% higher)" in out and "FAIL (allowed 25% lower)" in out and "first record" in out
