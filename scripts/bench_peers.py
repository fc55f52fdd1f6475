"""The cached training step side by side: qie at its defaults against peers, same tiny model and data.

Data: 32 text-to-image samples of 128² (noise images, one caption each), the tiny text-to-image Qwen-Image
(`model=tiny_t2i`), LoRA rank 16, batch 1, fp32, 80 steps, CPU. qie fills its cache with `python -m qie.precompute`
once, then each variant runs `python -m qie.train` as a user would (a fresh process; TensorBoard and
metrics.jsonl on, checkpoint at the end), interleaved with the peers `--repeats` times.

Every trainer is timed the same way: `scripts/step_clock/sitecustomize.py` is put on its path and marks the end
of each optimizer step (torch's global optimizer step hook), so a step is the interval between two marks, one
whole loop iteration whatever the trainer logs. Per run: the median step after `--warmup` steps, the time
from process start to the end of the first step, and the peak resident memory of the whole process tree
(sampled every 20 ms from /proc).

Peers run only when given (neither is shipped here; both need torchvision, hence `--peer-python`, a Python
that has it and sees the same torch, diffusers and transformers):

- `--diffusers-example PATH`: diffusers' `examples/dreambooth/train_dreambooth_lora_qwen_image.py`, on the
  same model folder and images (a folder of the images alone: it opens every file it finds), with its own
  latent cache (`--cache_latents`; its one prompt is encoded once) and qie's LoRA targets.
- `--musubi-tuner DIR`: a musubi-tuner checkout. Its weights are single files, written here from the tiny
  model folder; its model, VAE and text encoder sizes are fixed in its code, so the checkout must carry the
  change that reads them from `MUSUBI_TINY_CONFIG` (a folder with the three config.json files), see
  docs/benchmarks.md §11. Its latent and text-encoder caches are filled once (not timed), then its training
  script is timed as the others.

    python scripts/bench_peers.py --repeats 3
    python scripts/bench_peers.py --repeats 3 --peer-python VENV/bin/python --musubi-tuner MUSUBI \
        --diffusers-example DIFFUSERS/examples/dreambooth/train_dreambooth_lora_qwen_image.py
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_common import REPO, child_env, header, median, run_in_work_dir, table, target_line  # noqa: E402

QIE_BASE = ["model=tiny_t2i", "data.target_pixels=16384", "data.multiple_of=16"]
QIE_TRAIN = ["train.lora.rank=16", "train.lora.alpha=16", "data.batch_size=1"]


def prepare(work: Path, samples: int, size: int) -> tuple[Path, Path]:
    """The data set (text to image: training_images/ only) and qie's cache of it."""
    import numpy as np
    from PIL import Image

    from qie.checks import compose
    from qie.stages import precompute

    data, cache = work / "ds", work / "cache"
    images = data / "training_images"
    if not images.is_dir():
        images.mkdir(parents=True)
        rng = np.random.default_rng(0)
        for i in range(samples):
            pixels = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(images / f"{i:03d}.png")
            (images / f"{i:03d}.txt").write_text(f"a noise picture number {i}\n")
    cfg = compose("precompute", [*QIE_BASE, f"data.path={data}", f"cache.dir={cache}"])
    precompute.run(cfg, work / "precompute_run")
    return data, cache


CLOCK = REPO / "scripts" / "step_clock"
LORA_TARGETS = "to_q,to_k,to_v,to_out.0,add_q_proj,add_k_proj,add_v_proj,to_add_out"  # qie's default targets


def clocked_env(env: dict, clock: Path) -> dict:
    """`env` with the step clock on the path, writing its marks to `clock` (emptied first)."""
    clock.write_text("")
    env = dict(env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(CLOCK), env.get("PYTHONPATH", "")] if p)
    env["QIE_STEP_CLOCK"] = str(clock)
    return env


def watch(cmd: list[str], env: dict, log: Path, cwd: str | None = None) -> dict:
    """Run `cmd` with the step clock (`env` from `clocked_env`): wall time, the steps (seconds between marks),
    the time from start to the end of the first step, and the process tree's peak RSS."""
    clock = Path(env["QIE_STEP_CLOCK"])
    start = time.time()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=cwd)
        peak = 0
        while proc.poll() is None:
            peak = max(peak, tree_rss(proc.pid))
            time.sleep(0.02)
    if proc.returncode:
        raise SystemExit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{log.read_text()[-3000:]}")
    end = time.time()
    steps = clock_steps(clock.read_text(), start)
    return {"wall": end - start, "peak rss": peak, "after last step": end - steps.pop("last"), **steps}


def clock_steps(text: str, start: float) -> dict:
    """The step clock's marks (one epoch time a line) as {"first step": seconds after `start`, "steps": [...]}."""
    marks = [float(line) for line in text.split()]
    if not marks:
        raise SystemExit("the trainer ran no optimizer step (no step clock mark)")
    return {"first step": marks[0] - start, "last": marks[-1], "steps": [b - a for a, b in zip(marks, marks[1:])]}


def tree_rss(pid: int) -> int:
    """Resident bytes of `pid` and every descendant (from /proc)."""
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(entry))
        rss[int(entry)] = int(fields[21]) * os.sysconf("SC_PAGE_SIZE")
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        total += rss.get(p, 0)
        todo += children.get(p, [])
    return total


def fresh(folder: Path) -> Path:
    if folder.exists():
        import shutil

        shutil.rmtree(folder)
    return folder


def run_qie(
    work: Path, data: Path, cache: Path, steps: int, extra: list[str], tag: str, repo: str | None = None
) -> dict:
    run_dir = fresh(work / f"run_{tag}")
    cmd = [sys.executable, "-m", "qie.train", *QIE_BASE, *QIE_TRAIN, f"data.path={data}", f"cache.dir={cache}",
           f"train.max_steps={steps}", f"train.checkpoint_every={steps}", f"hydra.run.dir={run_dir}",
           *extra]  # fmt: skip
    env = child_env()
    if repo:  # another qie checkout (an earlier version, for a before/after comparison); `-m` reads the cwd first
        env["PYTHONPATH"] = repo
    out = watch(cmd, clocked_env(env, work / f"{tag}.clock"), work / f"{tag}.log", cwd=repo or str(REPO))
    metrics = run_dir / "metrics.jsonl"  # qie's own per-step timer, kept beside the clock's
    out["own steps"] = [json.loads(line)["seconds"] for line in metrics.read_text().splitlines()]
    return out


def tiny_model() -> Path:
    from qie.config import qie_home

    return qie_home() / "tiny" / "t2i-v1"


def images_only(work: Path, data: Path) -> Path:
    """The training images without their caption files (diffusers' example opens every file of its folder)."""
    folder = work / "images_only"
    if not folder.is_dir():
        folder.mkdir()
        for image in sorted((data / "training_images").glob("*.png")):
            (folder / image.name).symlink_to(image.resolve())
    return folder


def run_diffusers(script: Path, python: str, work: Path, data: Path, steps: int, tag: str) -> dict:
    """diffusers' Qwen-Image LoRA example on the same model folder and images, its latents cached in-process
    before the first step (its one instance prompt, as long as qie's captions, is encoded once)."""
    out_dir = fresh(work / f"diffusers_out_{tag}")
    cmd = [python, str(script), f"--pretrained_model_name_or_path={tiny_model()}",
           f"--instance_data_dir={images_only(work, data)}", "--instance_prompt=a noise picture number 0",
           f"--output_dir={out_dir}", "--resolution=128", "--train_batch_size=1", "--rank=16",
           f"--lora_layers={LORA_TARGETS}", f"--max_train_steps={steps}", "--learning_rate=1e-4",
           "--mixed_precision=no", "--seed=0", f"--checkpointing_steps={steps}", "--cache_latents"]  # fmt: skip
    env = child_env(HF_HUB_OFFLINE="1", TQDM_DISABLE="1")
    return watch(cmd, clocked_env(env, work / f"{tag}.clock"), work / f"{tag}.log")


def musubi_files(work: Path, data: Path) -> Path:
    """The tiny model as the single files musubi-tuner loads, its config folder (`MUSUBI_TINY_CONFIG`) and a
    dataset config over the same images and captions; returns the folder."""
    import shutil

    from safetensors.torch import load_file, save_file

    folder, model = work / "musubi", tiny_model()
    if (folder / "dataset.toml").is_file():
        return folder
    (folder / "config").mkdir(parents=True, exist_ok=True)
    for part, weights in (("transformer", "diffusion_pytorch_model"), ("vae", "diffusion_pytorch_model"),
                          ("text_encoder", "model")):  # fmt: skip
        sd = load_file(model / part / f"{weights}.safetensors")
        if part == "text_encoder":  # musubi reads the checkpoint's layout (model.*, visual.*, lm_head.*)
            sd = {k.replace("model.language_model.", "model.", 1).replace("model.visual.", "visual.", 1): v
                  for k, v in sd.items()}  # fmt: skip
        save_file(sd, folder / f"{part}.safetensors")
        shutil.copy(model / part / "config.json", folder / "config" / f"{part}.json")
    shutil.copytree(model / "tokenizer", folder / "config" / "tokenizer", dirs_exist_ok=True)
    (folder / "dataset.toml").write_text(
        '[general]\nresolution = [128, 128]\ncaption_extension = ".txt"\nbatch_size = 1\nenable_bucket = false\n\n'
        f'[[datasets]]\nimage_directory = "{data / "training_images"}"\ncache_directory = "{folder / "cache"}"\n'
    )
    return folder


def musubi_env(repo: Path, folder: Path) -> dict:
    """The environment musubi-tuner's scripts run in: its sources importable, the tiny sizes (the VAE's
    scale factor too: 2 per level after the first of `dim_mult`), an fp32 DiT (it fixes bf16 otherwise), offline."""
    vae = json.loads((folder / "config" / "vae.json").read_text())
    scale = str(2 ** (len(vae["dim_mult"]) - 1))
    env = child_env(MUSUBI_TINY_CONFIG=str(folder / "config"), MUSUBI_VAE_SCALE_FACTOR=scale,
                    MUSUBI_DIT_DTYPE="float32", HF_HUB_OFFLINE="1")  # fmt: skip
    env["PYTHONPATH"] = os.pathsep.join([str(repo / "src"), env["PYTHONPATH"]])
    return env


def prepare_musubi(repo: Path, python: str, work: Path, data: Path) -> Path:
    """musubi-tuner's two caching scripts over the data set (once; not timed)."""
    folder = musubi_files(work, data)
    musubi_caching(repo, python, folder, folder / "dataset.toml", work / "musubi")
    return folder


def musubi_caching(repo: Path, python: str, folder: Path, dataset: Path, logs: Path) -> float:
    """Run musubi-tuner's latent and text-encoder caching scripts over `dataset` (a dataset TOML); their wall time."""
    env = musubi_env(repo, folder)
    text_encoder = ["--text_encoder", folder / "text_encoder.safetensors", "--batch_size", "1"]
    start = time.perf_counter()
    for script, weights in (("qwen_image_cache_latents.py", ["--vae", folder / "vae.safetensors"]),
                            ("qwen_image_cache_text_encoder_outputs.py", text_encoder)):  # fmt: skip
        cmd = [python, str(repo / "src" / "musubi_tuner" / script), "--dataset_config", str(dataset),
               *map(str, weights), "--device", "cpu"]  # fmt: skip
        log = Path(f"{logs}_{script}.log")
        with open(log, "w") as out:
            if subprocess.run(cmd, env=env, stdout=out, stderr=subprocess.STDOUT).returncode:
                raise SystemExit(f"failed: {' '.join(cmd)}\n{log.read_text()[-3000:]}")
    return time.perf_counter() - start


def time_caching(work: Path, data: Path, musubi: Path | None, python: str, repeats: int) -> dict[str, list[float]]:
    """Wall time of filling a fresh cache of the data set, interleaved: qie's `python -m qie.precompute` (start-up
    included) and musubi-tuner's two caching scripts (both start-ups included)."""
    out: dict[str, list[float]] = {"qie precompute": []}
    folder = musubi_files(work, data) if musubi is not None else None
    for r in range(repeats):
        cache, run_dir = fresh(work / f"caching_qie_{r}"), fresh(work / f"caching_run_{r}")
        cmd = [sys.executable, "-m", "qie.precompute", *QIE_BASE, f"data.path={data}", f"cache.dir={cache}",
               f"hydra.run.dir={run_dir}"]  # fmt: skip
        start = time.perf_counter()
        with open(work / f"caching_qie_{r}.log", "w") as log:
            if subprocess.run(cmd, env=child_env(), stdout=log, stderr=subprocess.STDOUT, cwd=str(REPO)).returncode:
                raise SystemExit(f"failed: {' '.join(cmd)}")
        out["qie precompute"].append(time.perf_counter() - start)
        if folder is not None:
            toml = (folder / "dataset.toml").read_text().replace(str(folder / "cache"), str(fresh(folder / f"c{r}")))
            (folder / f"dataset_{r}.toml").write_text(toml)
            out.setdefault(f"{MUSUBI} caching", []).append(
                musubi_caching(musubi, python, folder, folder / f"dataset_{r}.toml", work / f"caching_musubi_{r}")
            )
    return out


def run_musubi(repo: Path, python: str, folder: Path, work: Path, steps: int, tag: str) -> dict:
    """musubi-tuner's Qwen-Image LoRA training on its caches, at its defaults but for what makes the runs alike
    (steps, rank, fp32, learning rate, torch's AdamW, PyTorch attention, the attention projections as targets)."""
    out_dir = fresh(work / f"musubi_out_{tag}")
    cmd = [python, str(repo / "src" / "musubi_tuner" / "qwen_image_train_network.py"),
           "--dit", str(folder / "transformer.safetensors"), "--vae", str(folder / "vae.safetensors"),
           "--text_encoder", str(folder / "text_encoder.safetensors"), "--dataset_config", str(folder / "dataset.toml"),
           "--sdpa", "--mixed_precision", "no", "--optimizer_type", "AdamW", "--learning_rate", "1e-4",
           "--network_module", "networks.lora_qwen_image", "--network_dim", "16", "--network_alpha", "16",
           "--network_args", "exclude_patterns=['.*_mlp.*', '.*_mod.*']",  # qie's targets: attention projections only
           "--max_train_steps", str(steps), "--seed", "0", "--output_dir", str(out_dir),
           "--output_name", "lora"]  # fmt: skip
    env = musubi_env(repo, folder)
    return watch(cmd, clocked_env(env, work / f"{tag}.clock"), work / f"{tag}.log")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=32)
    p.add_argument("--size", type=int, default=128)
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--warmup", type=int, default=10, help="steps left out of the median")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--diffusers-example", type=Path, default=None, help="train_dreambooth_lora_qwen_image.py")
    p.add_argument("--musubi-tuner", type=Path, default=None, help="a musubi-tuner checkout (see the docstring)")
    p.add_argument("--peer-python", default=sys.executable, help="the Python that runs the peers")
    p.add_argument("--variants", nargs="*", default=["defaults"],
                   help="qie variants: 'defaults' or space-free override lists joined by ','")  # fmt: skip
    p.add_argument("--baseline", default=None, help="another qie checkout, run at its defaults as one more row")
    p.add_argument("--caching", action="store_true", help="also time filling a fresh cache: qie against musubi-tuner")
    p.add_argument("--caching-only", action="store_true", help="time filling the cache, train nothing")
    p.add_argument("--work", default=None)
    args = p.parse_args(argv)
    header("cached training step: qie at its defaults vs peers", ["scripts/bench_peers.py", *(argv or sys.argv[1:])])
    return run_in_work_dir(lambda work: _run(args, work), args.work, "qie_bench_peers_")


DIFFUSERS, MUSUBI = "diffusers' Qwen-Image LoRA example", "musubi-tuner"


def _run(args: argparse.Namespace, work: Path) -> dict:
    data, cache = prepare(work, args.samples, args.size)
    variants = {v: ([] if v == "defaults" else v.split(",")) for v in args.variants}
    diffusers, musubi = args.diffusers_example, args.musubi_tuner
    if diffusers is not None and not diffusers.is_file():
        print(f"skipping diffusers' example: {diffusers} is not a file")
        diffusers = None
    if musubi is not None and not (musubi / "src" / "musubi_tuner" / "qwen_image_train_network.py").is_file():
        print(f"skipping musubi-tuner: {musubi} has no src/musubi_tuner/qwen_image_train_network.py")
        musubi = None
    training = musubi is not None and not args.caching_only
    musubi_folder = prepare_musubi(musubi, args.peer_python, work, data) if training else None
    runs: dict[str, list[dict]] = {}
    if args.caching_only:
        return {"caching": caching_report(time_caching(work, data, musubi, args.peer_python, args.repeats), args)}
    for r in range(args.repeats):
        for v, (name, extra) in enumerate(variants.items()):
            runs.setdefault(f"qie, {name}", []).append(run_qie(work, data, cache, args.steps, extra, f"q{v}_{r}"))
        if args.baseline:
            runs.setdefault(f"qie at {args.baseline}, defaults", []).append(
                run_qie(work, data, cache, args.steps, [], f"b{r}", args.baseline)
            )
        if diffusers is not None:
            runs.setdefault(DIFFUSERS, []).append(
                run_diffusers(diffusers, args.peer_python, work, data, args.steps, f"d{r}")
            )
        if musubi_folder is not None:
            runs.setdefault(MUSUBI, []).append(
                run_musubi(musubi, args.peer_python, musubi_folder, work, args.steps, f"m{r}")
            )
    summary = report(runs, args.warmup, args.repeats)
    if args.caching:
        summary["caching"] = caching_report(time_caching(work, data, musubi, args.peer_python, args.repeats), args)
    return summary


def caching_report(times: dict[str, list[float]], args: argparse.Namespace) -> dict:
    """Samples per second of each way of filling the cache (best of the repeats: load only ever adds time)."""
    rates = {name: args.samples / min(ts) for name, ts in times.items()}
    rows = [[name, ", ".join(f"{t:.1f}" for t in ts), f"{rates[name]:.2f}"] for name, ts in times.items()]
    print(f"\nfilling a fresh cache of {args.samples} samples (wall time of the whole commands, start-up included)")
    print(table(["cacher", "seconds (per run)", "samples/s (best run)"], rows))
    peer = f"{MUSUBI} caching"
    if peer in rates:
        target_line("precompute throughput / musubi-tuner's caching", rates["qie precompute"] / rates[peer], ">=", 3)
    return rates


def report(runs: dict[str, list[dict]], warmup: int, repeats: int) -> dict:
    """The table (a row per trainer: medians over its runs, the highest peak) and, with peers, the targets."""
    summary = {}
    for name, rs in runs.items():
        summary[name] = {"step": median([median(r["steps"][warmup:]) for r in rs]),
                         "per run": [median(r["steps"][warmup:]) for r in rs],
                         "first": median([r["first step"] for r in rs]),
                         "end": median([r["after last step"] for r in rs]),
                         "peak": max(r["peak rss"] for r in rs)}  # fmt: skip
    fastest = min(s["step"] for s in summary.values())
    base = summary[next(iter(summary))]["step"]
    rows = []
    for name, s in summary.items():
        per_run = ", ".join(f"{1e3 * x:.1f}" for x in s["per run"])
        rows.append([name, f"{1e3 * s['step']:.2f}", per_run, f"{s['step'] / base:.2f}x", f"{s['step'] / fastest:.2f}x",
                     f"{s['first']:.2f}", f"{s['end']:.2f}", f"{s['peak'] / 2**20:,.0f}"])  # fmt: skip
    print(f"\nmedian step after {warmup} warm-up steps (between optimizer steps), {repeats} interleaved run(s)")
    print(table(["trainer", "step (ms)", "per run (ms)", "vs first row", "vs fastest", "start to first step (s)",
                 "last step to exit (s)", "peak RSS of the process tree (MiB)"], rows))  # fmt: skip
    peers = {n: s for n, s in summary.items() if n in (DIFFUSERS, MUSUBI)}
    qie = summary.get("qie, defaults")
    if peers and qie is not None:
        step = min(s["step"] for s in peers.values())
        first = min(s["first"] for s in peers.values())
        peak = min(s["peak"] for s in peers.values())
        target_line("step at the defaults / fastest peer's", qie["step"] / step, "<=", 0.9)
        target_line("peak RSS / lowest peer's", qie["peak"] / peak, "<=", 1)
        target_line("start to first step / fastest peer's", qie["first"] / first, "<=", 1)
        end = min(s["end"] for s in peers.values())
        target_line("last step to exit / fastest peer's", qie["end"] / end, "<=", 1)
    return summary


if __name__ == "__main__":
    main()
