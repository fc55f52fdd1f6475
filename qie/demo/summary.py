"""The demo's summary as it prints it: the verdict (did the LoRA learn the edit, by the drops it needs), the held-out
measures before and after, and where its picture, images, metrics and report are."""

from __future__ import annotations

from pathlib import Path

# What the demo calls learned: the held-out loss and the held-out pixel (or latent) error this much lower.
REQUIRED_LOSS_DROP = 0.2
REQUIRED_PIXEL_DROP = 0.3


def format_report(r: dict, run_dir: Path) -> str:
    layered = "latent_error_drop" in r
    judged = "latent error" if layered else "pixel error"
    if r["learned"]:
        verdict = "the LoRA learned to split the images" if layered else "the LoRA learned the edit"
    else:
        verdict = (
            f"did NOT learn {'the split' if layered else 'the edit'} (needs {REQUIRED_LOSS_DROP:.0%} lower loss and "
            f"{REQUIRED_PIXEL_DROP:.0%} lower {judged})"
        )
    unedited = "the image itself as every layer" if layered else "the unedited control"
    lines = [
        "",
        f"qie demo: {r['train_steps']} training steps from the cache; {verdict}",
        f"  held-out loss (fixed noise)  before {r['heldout_loss_before']:.4f}  after {r['heldout_loss_after']:.4f}"
        f"  ({r['heldout_loss_drop']:.0%} lower)",
    ]
    if layered:
        lines.append(
            f"  held-out latent error        base   {r['latent_error_base']:.4f}  LoRA  {r['latent_error_lora']:.4f}"
            f"  ({r['latent_error_drop']:.0%} lower)"
        )
        lines += _per_layer(r["layer_latent_error_base"], r["layer_latent_error_lora"])
    lines.append(
        f"  held-out pixel error         base   {r['pixel_error_base']:.4f}  LoRA  {r['pixel_error_lora']:.4f}"
        f"  ({r['pixel_error_drop']:.0%} lower; {unedited}: {r['pixel_error_unedited']:.4f})"
    )
    if layered:
        lines += _per_layer(r["layer_pixel_error_base"], r["layer_pixel_error_lora"])
        picture = "rows per sample: its image and layers, the base model's, the LoRA's; layers on a checkerboard"
    else:
        picture = "columns: control, target, base model, LoRA; the prompt under each row"
    return "\n".join(
        [
            *lines,
            f"  VAE reconstruction PSNR      {r['vae_psnr_db']:.1f} dB (held-out targets)",
            f"  picture:     {r['demo_image']}  ({picture})",
            f"  images:      {r['predictions']}/{{base,lora}}",
            f"  metrics:     {r['metrics']}",
            f"  TensorBoard: tensorboard --logdir {r['tensorboard']}",
            f"  report:      {run_dir / 'demo_report.json'}",
        ]
    )


def _per_layer(base: list[float], lora: list[float]) -> list[str]:
    """One report line per layer position, aligned under the totals."""
    names = [f"    layer {n}" + (" (background)" if n == 0 else "") for n in range(len(base))]
    return [f"{name:<31}base   {b:.4f}  LoRA  {lo:.4f}" for name, b, lo in zip(names, base, lora)]
