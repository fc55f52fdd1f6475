"""The model card (`README.md`) of an export folder, in the Hub's format: a YAML metadata block (base model, library,
tags, license, pipeline tag, the sample gallery's `widget`) written by huggingface_hub's own `ModelCardData`, then
what the LoRA is: the instructions it was trained on, its settings, the held-out metrics, sample edits with their
prompts, how to load it in diffusers, ComfyUI and qie, and the base it needs (with any LoRAs fused into it)."""

from __future__ import annotations

from pathlib import Path

from qie.publish.run_facts import BaseModel, RunFacts

# What each measured number is, for the metrics table.
METRIC_NOTES = {
    "loss": "training loss at the last step",
    "heldout_loss": "flow-matching loss on samples kept out of training, at fixed noise (lower is better)",
    "heldout_loss_before": "the base model's held-out loss, at the same noise",
    "pixel_error_base": "the base model's mean pixel error against the held-out targets",
    "pixel_error_lora": "the LoRA's mean pixel error against the held-out targets",
    "validation/psnr_edit": "PSNR inside the edited region, output against target (dB)",
    "validation/ssim_edit": "SSIM inside the edited region, output against target",
    "validation/psnr_keep": "PSNR outside the edited region, output against input (dB)",
    "validation/ssim_keep": "SSIM outside the edited region, output against input",
    "validation/edit_fraction": "share of the image the edit changes",
}


def model_card(facts: RunFacts, base: BaseModel, license: str, files: dict[str, str], where: str) -> str:
    """The card's text.

    Args:
        files: what the folder holds, file name -> what reads it.
        where: the repo id (or folder) the code examples load the LoRA from.
    """
    from huggingface_hub import ModelCard, ModelCardData

    widget = [{"text": s.prompt, "output": {"url": f"samples/{s.image.name}"}} for s in facts.samples if s.prompt]
    tags = [
        "lora",
        "diffusers",
        "qwen-image",
        "qie",
        "image-editing" if base.task == "image-to-image" else "text-to-image",
    ]
    data = ModelCardData(
        base_model=base.hub_id,
        library_name="diffusers",
        license=license,
        pipeline_tag=base.task,
        tags=tags,
        widget=widget or None,
    )
    sections = [
        _intro(facts, base),
        _instructions(facts),
        _settings(facts),
        _metrics(facts),
        _samples(facts, base.task),
        _files(files),
        _usage(base, where),
        _fused(base),
    ]
    return str(ModelCard(f"---\n{data.to_yaml()}\n---\n" + "\n\n".join(s for s in sections if s) + "\n"))


def _intro(facts: RunFacts, base: BaseModel) -> str:
    link = f"[{base.hub_id}](https://huggingface.co/{base.hub_id})" if base.hub_id else f"`{base.source}`"
    steps = facts.result.get("step")
    trained = f" for {steps} steps" if steps is not None else ""
    text = (
        f"# {_title(facts)}\n\nA LoRA for {link} (`{base.pipeline}`), trained with qie (`model={base.name}`)"
        f"{trained}. Every LoRA file here holds the trained strength in its weights (alpha = rank): load it at 1.0."
    )
    x = facts.extraction
    if x:
        text += (
            f"\n\nIt was extracted at rank {x.get('rank')} from the difference between the tuned transformer and its "
            "base (`python -m qie.extract_lora`, SVD per linear layer): relative error of the "
            f"{x.get('changed_layers')} layers' reconstructions mean {x.get('mean_relative_error', 0):.3g}, worst "
            f"{x.get('max_relative_error', 0):.3g}; {len(x.get('not_carried') or {})} changed parameters a LoRA cannot "
            "carry (biases, norms) are left out (`extract_report.json`)."
        )
    return text


def _title(facts: RunFacts) -> str:
    """The run folder's name (a demo's: the demo folder's, its training run being `train/`)."""
    run = facts.run_dir.parent if facts.run_dir.name == "train" else facts.run_dir
    return f"{run.name} (Qwen-Image LoRA)" if run.name else "Qwen-Image LoRA"


def _instructions(facts: RunFacts) -> str:
    data = (facts.config.get("data") or {}).get("path")
    if not facts.instructions:
        where = f" (`{data}`)" if data else ""
        return f"## Trained on\n\nThe data set{where} was not readable where this card was written."
    lines = ["## Trained on\n\nThe data set's most common instructions, with how many samples have each:", ""]
    lines += [
        f"- {prompt!r} ({count})" if prompt else f"- (no prompt) ({count})" for prompt, count in facts.instructions
    ]
    return "\n".join(lines)


def _settings(facts: RunFacts) -> str:
    c = facts.config
    train, data, lora = c.get("train") or {}, c.get("data") or {}, (c.get("train") or {}).get("lora") or {}
    optimizer = (train.get("optimizer") or {}).get("_target_")
    if train.get("mode") == "full":  # the LoRA, if any, was extracted: its rank is the extraction's
        lora = {}
    rows = [
        ("mode", train.get("mode")),
        ("adapter", train.get("adapter")),
        ("rank / alpha", f"{lora.get('rank')} / {lora.get('alpha')}" if lora else None),
        ("target modules", ", ".join(lora.get("target_modules") or []) or None),
        ("steps", facts.result.get("step", train.get("max_steps"))),
        ("learning rate", train.get("learning_rate")),
        ("optimizer", optimizer),
        ("batch size x accumulation", f"{data.get('batch_size')} x {train.get('gradient_accumulation_steps')}"),
        ("timestep sampling", train.get("timestep_sampling")),
        ("mixed precision", train.get("mixed_precision")),
        ("seed", train.get("seed")),
    ]
    shown = [(k, v) for k, v in rows if v is not None and "None" not in str(v)]
    if not shown:
        return ""
    return "## Settings\n\n| setting | value |\n| --- | --- |\n" + "\n".join(f"| {k} | `{v}` |" for k, v in shown)


def _metrics(facts: RunFacts) -> str:
    if not facts.metrics:
        return "## Held-out metrics\n\nNone were measured (`validation.heldout_samples`, `validation.every`)."
    rows = [f"| {k} | {v:.4g} | {METRIC_NOTES.get(k, '')} |" for k, v in facts.metrics.items()]
    return "## Held-out metrics\n\n| metric | value | what |\n| --- | --- | --- |\n" + "\n".join(rows)


def _samples(facts: RunFacts, task: str) -> str:
    if not facts.samples and not facts.pictures:
        return ""
    lines = ["## Sample edits", ""]
    for picture, caption in facts.pictures:
        lines += [f"![{caption}](samples/{picture.name})", "", f"*{caption}*", ""]
    if facts.samples:
        lines += ["| input | output | prompt |", "| --- | --- | --- |"]
    for s in facts.samples:
        source = "(text to image)" if task == "text-to-image" else "-"
        source = f"![input](samples/{input_name(s.image)})" if s.control else source
        prompt = s.prompt.replace("|", "\\|") or "(not recorded)"
        lines.append(f"| {source} | ![output](samples/{s.image.name}) | {prompt} |")
    return "\n".join(lines).rstrip()


def input_name(image: Path) -> str:
    """The file name of the input image shown beside the sample `image` (`<stem>_input.png`)."""
    return f"{image.stem}_input{image.suffix}"


def _files(files: dict[str, str]) -> str:
    rows = "\n".join(f"| `{name}` | {reader} |" for name, reader in files.items())
    return f"## Files\n\n| file | read by |\n| --- | --- |\n{rows}"


def _usage(base: BaseModel, where: str) -> str:
    source = base.hub_id or base.source
    fuse = "".join(
        f'pipe.load_lora_weights("{file}")\npipe.fuse_lora(lora_scale={scale})\npipe.unload_lora_weights()\n'
        for file, scale in base.fused
    )
    call = 'pipe(image=load_image("in.png"), prompt="...")' if base.task == "image-to-image" else 'pipe(prompt="...")'
    image = "predict.image=in.png " if base.task == "image-to-image" else ""
    infer = f"python -m qie.infer model={base.name} {image}predict.lora=pytorch_lora_weights.safetensors"
    infer += ' predict.prompt="..."'
    return f"""## Use it

With diffusers:

```python
import torch
from diffusers import {base.pipeline}
from diffusers.utils import load_image

pipe = {base.pipeline}.from_pretrained("{source}", torch_dtype=torch.bfloat16).to("cuda")
{fuse}pipe.load_lora_weights("{where}", weight_name="pytorch_lora_weights.safetensors")
image = {call}.images[0]
```

In ComfyUI: copy `comfyui_lora.safetensors` into `ComfyUI/models/loras/` and apply it to the Qwen-Image diffusion
model with a `LoraLoaderModelOnly` node at strength 1.0. musubi-tuner and kohya-style loaders read
`kohya_lora.safetensors`.

With qie: `{infer}`."""


def _fused(base: BaseModel) -> str:
    if not base.fused:
        return ""
    rows = "\n".join(f"| `{file}` | {scale} |" for file, scale in base.fused)
    return (
        "## Base with fused LoRAs\n\nThis LoRA was trained on the base with these LoRAs fused into its weights "
        "(`model.fuse_loras`); fuse the same ones, at the same scales, before loading it (qie: the same "
        f"`model.fuse_loras`).\n\n| fused LoRA | scale |\n| --- | --- |\n{rows}"
    )
