"""Train the demo's tiny VAE on the synthetic shapes and write `qie/components/tiny_demo_vae.safetensors`.

The VAE is diffusers' `AutoencoderKLQwenImage` at the `demo` preset's sizes (`qie.components.tiny_presets`),
trained from a fixed seed to reconstruct images drawn as the demo's data set draws them (`random_image`):
mean squared error of the decoded encoder mean. The file holds the weights in float16 and, as metadata, the
VAE config, the per-channel mean and standard deviation of the encoder's latents over fresh images (the
model's `latents_mean` / `latents_std`) and the PSNR on held-out images, all measured with the float16
weights that ship. One CPU thread and deterministic algorithms: the same torch version writes the same file.

    python scripts/train_demo_vae.py [--steps 1200] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import numpy as np
import torch
from diffusers import AutoencoderKLQwenImage
from safetensors.torch import save_file

from qie.components.tiny_presets import DEMO_VAE_CONFIG, DEMO_VAE_FILE
from qie.demo.synthetic import random_image

OUT = Path(__file__).resolve().parent.parent / "qie" / "components" / DEMO_VAE_FILE
SIZE = 64
SEED = 0
HELDOUT_SEED = 1_000_003  # a different stream of images than training draws
STATS_SEED = 2_000_003


def images(rng: random.Random, count: int) -> torch.Tensor:
    """(count, 3, 1, SIZE, SIZE) images in [-1, 1], as the pipelines feed the VAE."""
    arrays = [np.asarray(random_image(rng, SIZE), dtype=np.float32) for _ in range(count)]
    return torch.from_numpy(np.stack(arrays) / 127.5 - 1.0).permute(0, 3, 1, 2).unsqueeze(2)


def reconstruct(vae: AutoencoderKLQwenImage, x: torch.Tensor) -> torch.Tensor:
    return vae.decode(vae.encode(x).latent_dist.mode()).sample


@torch.no_grad()
def psnr(vae: AutoencoderKLQwenImage, x: torch.Tensor) -> float:
    """PSNR in dB of the reconstructions, pixels in [0, 1]."""
    mse = torch.cat([((reconstruct(vae, b) - b) / 2).pow(2).flatten(1).mean(1) for b in x.split(32)]).mean()
    return float(10 * math.log10(1.0 / mse.item()))


def train(steps: int, batch_size: int, lr: float, log_every: int) -> AutoencoderKLQwenImage:
    torch.manual_seed(SEED)
    z = DEMO_VAE_CONFIG["z_dim"]
    vae = AutoencoderKLQwenImage(**DEMO_VAE_CONFIG, latents_mean=[0.0] * z, latents_std=[1.0] * z)
    optimizer = torch.optim.Adam(vae.parameters(), lr=lr)
    # Constant, then a cosine decay over the last third.
    decay_from = 2 * steps // 3
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: 1.0 if s < decay_from else 0.5 * (1 + math.cos(math.pi * (s - decay_from) / (steps - decay_from))),
    )
    rng, heldout, start = random.Random(SEED), images(random.Random(HELDOUT_SEED), 64), time.time()
    for step in range(1, steps + 1):
        x = images(rng, batch_size)
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
def latent_stats(vae: AutoencoderKLQwenImage) -> tuple[list[float], list[float]]:
    """Per-channel mean and standard deviation of the encoder's latents (the mode) over fresh images."""
    x = images(random.Random(STATS_SEED), 256)
    latents = torch.cat([vae.encode(b).latent_dist.mode() for b in x.split(32)])
    channels = latents.transpose(0, 1).flatten(1).double()
    return [round(v, 6) for v in channels.mean(1).tolist()], [round(v, 6) for v in channels.std(1).tolist()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1200)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--log-every", type=int, default=100)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)

    vae = train(args.steps, args.batch_size, args.lr, args.log_every)
    # What ships is float16: measure (and take the statistics of) exactly those weights.
    weights = {k: v.detach().to(torch.float16).contiguous() for k, v in vae.state_dict().items()}
    vae.load_state_dict({k: v.float() for k, v in weights.items()})
    mean, std = latent_stats(vae)
    heldout_psnr = psnr(vae, images(random.Random(HELDOUT_SEED), 64))
    metadata = {
        "config": json.dumps(DEMO_VAE_CONFIG, sort_keys=True),
        "latents_mean": json.dumps(mean),
        "latents_std": json.dumps(std),
        "heldout_psnr_db": f"{heldout_psnr:.2f}",
        "recipe": json.dumps({"steps": args.steps, "batch_size": args.batch_size, "lr": args.lr, "seed": SEED}),
        "torch": torch.__version__,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(args.out), metadata=metadata)
    size_mb = args.out.stat().st_size / 2**20
    print(f"wrote {args.out} ({size_mb:.2f} MiB): held-out PSNR {heldout_psnr:.2f} dB, latents mean {mean}, std {std}")


if __name__ == "__main__":
    main()
