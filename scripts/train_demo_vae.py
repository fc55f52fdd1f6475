"""Train one of the demo's tiny VAEs on the synthetic shapes and write it into `qie/components/`.

Without options: the Edit demo's RGB VAE, diffusers' `AutoencoderKLQwenImage` at the `demo` preset's sizes
(`qie.components.tiny_presets`), trained on 64² images drawn as the demo's data set draws them (`random_image`),
written to `tiny_demo_vae.safetensors`. With `--layered`: the Layered demo's RGBA VAE (`input_channels=4`, 16x down)
trained on the frames a Layered model encodes, the image of shapes and each of its RGBA layers
(`random_layers`), resized to the pipeline's 640² bucket as precompute resizes them; it learns from 64² squares
of them, most about a shape's edge (a whole frame costs 100x a square), and is measured on whole frames. Written to
`tiny_demo_layered_vae.safetensors`.

Both learn from a fixed seed the mean squared error of the decoded encoder mean. The file holds the weights in
float16 and, as metadata, the VAE config, the per-channel mean and standard deviation of the encoder's latents over
fresh images (the model's `latents_mean` / `latents_std`) and the PSNR on held-out images, all measured with the
float16 weights that ship. One CPU thread and deterministic algorithms: the same torch version writes the same file.

    python scripts/train_demo_vae.py [--layered] [--steps N] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from diffusers import AutoencoderKLQwenImage
from safetensors.torch import save_file

from qie.components.tiny_presets import (
    DEMO_LAYERED_VAE_CONFIG,
    DEMO_LAYERED_VAE_FILE,
    DEMO_VAE_CONFIG,
    DEMO_VAE_FILE,
)
from qie.data.images import prepare_target
from qie.demo.synthetic import random_image, random_layers

COMPONENTS = Path(__file__).resolve().parent.parent / "qie" / "components"
SIZE = 64  # the demo's images (`demo.image_size`)
LAYERED_PIXELS = 640 * 640  # the Layered pipeline's smaller resolution bucket, where the demo's model works
SEED = 0
HELDOUT_SEED = 1_000_003  # a different stream of images than training draws
STATS_SEED = 2_000_003
POOL_SEED = 3_000_017  # the frames the layered VAE learns from


def images(rng: random.Random, count: int) -> torch.Tensor:
    """(count, 3, 1, SIZE, SIZE) images in [-1, 1], as the pipelines feed the VAE."""
    arrays = [np.asarray(random_image(rng, SIZE), dtype=np.float32) for _ in range(count)]
    return torch.from_numpy(np.stack(arrays) / 127.5 - 1.0).permute(0, 3, 1, 2).unsqueeze(2)


def layered_frames(rng: random.Random, count: int) -> torch.Tensor:
    """(count, 4, 1, 640, 640) frames in [-1, 1], each one frame (the image or one of its layers) of a fresh
    layered sample, resized as precompute resizes a Layered model's targets."""
    frames = []
    for _ in range(count):
        image, layers, _ = random_layers(rng, SIZE)
        frames.append(prepare_target(rng.choice([image, *layers]), LAYERED_PIXELS))
    return torch.stack(frames).unsqueeze(2)


class LayeredCrops:
    """Squares of layered frames: `__call__(rng, count)` gives (count, 4, 1, crop, crop), each a square of a frame
    drawn from a pool of `pool` fresh frames (made on first use; a frame costs ~40x its square's training), most of
    them (`edge_share`) about a pixel where the frame changes (a shape's edge): a frame is mostly flat, and flat
    squares teach little."""

    def __init__(self, crop: int, pool: int, edge_share: float = 0.75) -> None:
        self.crop, self.size, self.edge_share = crop, pool, edge_share
        self.frames: list[tuple[torch.Tensor, torch.Tensor]] = []  # (frame in float16, its edge pixels (n, 2))

    def _fill(self) -> None:
        rng = random.Random(POOL_SEED)
        for _ in range(self.size):
            frame = layered_frames(rng, 1)[0]
            p = frame[:, 0]
            changes = (p[:, 1:, :-1] - p[:, :-1, :-1]).abs() + (p[:, :-1, 1:] - p[:, :-1, :-1]).abs()
            self.frames.append((frame.half(), (changes.amax(0) > 0.1).nonzero()))

    def __call__(self, rng: random.Random, count: int) -> torch.Tensor:
        if not self.frames:
            self._fill()
        squares = []
        for _ in range(count):
            frame, edges = self.frames[rng.randrange(len(self.frames))]
            side, crop = frame.shape[-1], self.crop
            if len(edges) and rng.random() < self.edge_share:
                y, x = (min(max(int(c) - crop // 2, 0), side - crop) for c in edges[rng.randrange(len(edges))])
            else:
                y, x = rng.randrange(side - crop + 1), rng.randrange(side - crop + 1)
            squares.append(frame[..., y : y + crop, x : x + crop].float())
        return torch.stack(squares)


@dataclass(frozen=True)
class DemoVae:
    """One of the demo's VAEs: its config, its file, what it learns from and what it is measured on.

    Args:
        train_images: (rng, count) -> a training batch.
        heldout_images: (rng, count) -> images as the demo's model encodes them.
        heldout_count, stats_count: how many held-out images the PSNR and the latent statistics take.
        steps, batch_size, lr, log_every: the recipe's defaults.
    """

    config: dict[str, Any]
    file: str
    train_images: Callable[[random.Random, int], torch.Tensor]
    heldout_images: Callable[[random.Random, int], torch.Tensor]
    heldout_count: int
    stats_count: int
    steps: int
    batch_size: int
    lr: float
    log_every: int


KINDS = {
    "rgb": DemoVae(DEMO_VAE_CONFIG, DEMO_VAE_FILE, images, images, 64, 256, 1200, 8, 2e-3, 100),
    # 64² squares (4x4 latents), 32 a step: ~0.6 s on one core; 12 whole frames held out (~15 s to measure). At
    # 2e-3, or 8 squares of 128² a step, the reconstructions stayed at the frames' mean colour (~12 dB) for 750
    # steps; so did a VAE twice as wide.
    "layered": DemoVae(
        DEMO_LAYERED_VAE_CONFIG,
        DEMO_LAYERED_VAE_FILE,
        LayeredCrops(64, 384),
        layered_frames,
        12,
        32,
        3000,
        32,
        1e-3,
        250,
    ),  # fmt: skip
}


def reconstruct(vae: AutoencoderKLQwenImage, x: torch.Tensor) -> torch.Tensor:
    return vae.decode(vae.encode(x).latent_dist.mode()).sample


@torch.no_grad()
def psnr(vae: AutoencoderKLQwenImage, x: torch.Tensor) -> float:
    """PSNR in dB of the reconstructions, pixels (every channel) in [0, 1]."""
    mse = torch.cat([((reconstruct(vae, b) - b) / 2).pow(2).flatten(1).mean(1) for b in x.split(32)]).mean()
    return float(10 * math.log10(1.0 / mse.item()))


def train(kind: DemoVae, steps: int, batch_size: int, lr: float, log_every: int) -> AutoencoderKLQwenImage:
    torch.manual_seed(SEED)
    z = kind.config["z_dim"]
    vae = AutoencoderKLQwenImage(**kind.config, latents_mean=[0.0] * z, latents_std=[1.0] * z)
    optimizer = torch.optim.Adam(vae.parameters(), lr=lr)
    # Constant, then a cosine decay over the last third.
    decay_from = 2 * steps // 3
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: 1.0 if s < decay_from else 0.5 * (1 + math.cos(math.pi * (s - decay_from) / (steps - decay_from))),
    )
    rng, start = random.Random(SEED), time.time()
    heldout = kind.heldout_images(random.Random(HELDOUT_SEED), kind.heldout_count)
    for step in range(1, steps + 1):
        x = kind.train_images(rng, batch_size)
        loss = (reconstruct(vae, x) - x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        if step % log_every == 0 or step == steps:
            vae.eval()
            print(f"step {step}: loss {loss.item():.5f}, held-out PSNR {psnr(vae, heldout):.2f} dB, "
                  f"{time.time() - start:.0f} s", flush=True)  # fmt: skip
            vae.train()
    return vae.eval()


@torch.no_grad()
def latent_stats(kind: DemoVae, vae: AutoencoderKLQwenImage) -> tuple[list[float], list[float]]:
    """Per-channel mean and standard deviation of the encoder's latents (the mode) over fresh images."""
    x = kind.heldout_images(random.Random(STATS_SEED), kind.stats_count)
    latents = torch.cat([vae.encode(b).latent_dist.mode() for b in x.split(32)])
    channels = latents.transpose(0, 1).flatten(1).double()
    return [round(v, 6) for v in channels.mean(1).tolist()], [round(v, 6) for v in channels.std(1).tolist()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layered", action="store_true", help="the Layered demo's RGBA VAE (default: the RGB one)")
    parser.add_argument("--steps", type=int, help="default: 1200 (RGB), 3000 (--layered)")
    parser.add_argument("--batch-size", type=int, help="default: 8 (RGB), 32 (--layered)")
    parser.add_argument("--lr", type=float, help="default: 2e-3 (RGB), 1e-3 (--layered)")
    parser.add_argument("--log-every", type=int, help="default: 100 (RGB), 250 (--layered)")
    parser.add_argument("--out", type=Path, help="default: qie/components/<the VAE's file>")
    args = parser.parse_args()
    kind = KINDS["layered" if args.layered else "rgb"]
    steps, out = args.steps or kind.steps, args.out or COMPONENTS / kind.file
    batch_size, lr = args.batch_size or kind.batch_size, args.lr or kind.lr
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)

    vae = train(kind, steps, batch_size, lr, args.log_every or kind.log_every)
    # What ships is float16: measure (and take the statistics of) exactly those weights.
    weights = {k: v.detach().to(torch.float16).contiguous() for k, v in vae.state_dict().items()}
    vae.load_state_dict({k: v.float() for k, v in weights.items()})
    mean, std = latent_stats(kind, vae)
    heldout_psnr = psnr(vae, kind.heldout_images(random.Random(HELDOUT_SEED), kind.heldout_count))
    metadata = {
        "config": json.dumps(kind.config, sort_keys=True),
        "latents_mean": json.dumps(mean),
        "latents_std": json.dumps(std),
        "heldout_psnr_db": f"{heldout_psnr:.2f}",
        "recipe": json.dumps({"steps": steps, "batch_size": batch_size, "lr": lr, "seed": SEED}),
        "torch": torch.__version__,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out), metadata=metadata)
    size_mb = out.stat().st_size / 2**20
    print(f"wrote {out} ({size_mb:.2f} MiB): held-out PSNR {heldout_psnr:.2f} dB, latents mean {mean}, std {std}")


if __name__ == "__main__":
    main()
