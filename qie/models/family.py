"""The model-family interface: every piece qie needs of one family of pipelines, each one required.

A family module (`qie/models/<family>.py`) builds one `ModelFamily` named `FAMILY`; `qie.models.FAMILY_MODULES`
lists the modules, and that list is the only place family names are written down. Construction checks every
piece: a missing one is a TypeError, a piece whose parameters are not the interface's is a `FamilyError` naming
it, so a misspelt piece can never fall back to another family's.

The stages, the training loop, the cache, the data code and the sampler hand-off read families only through this
interface (and `ModelSpec`, which joins a family with one model yaml); none of them names a family.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

from qie.models.flavour import Flavour
from qie.models.outputs import Outputs


class FamilyError(TypeError):
    """A family module that does not provide the interface."""


@dataclass(frozen=True)
class Variant:
    """One pipeline of a family (Edit, Edit-Plus and text-to-image are the Qwen-Image family's).

    Args:
        pipeline_class: the pipeline's class name in `diffusers`.
        prompt_images: how a prompt sees the sample's control images: "none" (text only), "one" (one image,
            prompts batched), "all" (every image, one prompt per call; no image: text only).
        output_image: the control image (0 first, -1 last) whose condition size is the output size, as the
            pipeline's `__call__` picks it; None for a pipeline without control images.
        caption: how `data.auto_caption` asks the model's own VL text encoder for a missing caption: the name of
            a caption preset (`conf/caption/<name>.yaml`: "edit_instruction" for an edit pipeline,
            "describe" for text to image, "layered" for the prompt the Layered pipeline captions its input with).
        max_prompt_tokens: where `__call__` cuts prompt embeddings (its `max_sequence_length`), if it does.
    """

    pipeline_class: str
    prompt_images: str
    output_image: int | None
    caption: str
    max_prompt_tokens: int | None = None


@dataclass(frozen=True)
class PlannerFacts:
    """What the memory planner needs of a family, besides its transformer class and blocks.

    Args:
        latent_pixels: pixels per latent token along a side (VAE scale x patch size), to count tokens.
        vl_pixels_per_token: condition-image pixels per vision token of the text encoder.
        template_tokens: tokens the prompt template adds.
        text_encoder_label: how the planner names the text encoder in its report.
        step_inputs: (transformer config, Workload, make) -> (Batch, noise, sigmas) for one simulated step;
            `make(*shape, dtype=)` makes each tensor (fake tensors in the planner).
    """

    latent_pixels: int
    vl_pixels_per_token: int
    template_tokens: int
    text_encoder_label: str
    step_inputs: Callable[..., tuple]


# The parameters each callable piece takes, in order (a piece may add parameters with defaults after them).
SIGNATURES: dict[str, tuple[str, ...]] = {
    "pipeline": ("spec", "parts"),
    "prompt_template": ("spec",),
    "default_size": ("spec", "vae_scale"),
    "encode_prompts": ("pipeline", "spec", "prompts", "images", "device"),
    "encode_latents": ("vae", "pixels"),
    "predict": ("transformer", "batch", "noise", "sigmas"),
    "sample": ("parts", "prompt", "negative", "controls", "size", "options", "progress"),
    "denoise": (
        "transformer",
        "scheduler",
        "noise",
        "prompt",
        "negative",
        "controls",
        "steps",
        "true_cfg_scale",
        "checkpoint",
        "pipeline_config",
    ),
    "decode": ("vae", "latents", "output_type"),
    "vae_scale": ("vae",),
    "config_problems": ("spec",),
    "checkpoint_problems": ("spec", "read_json"),
    "sampling_notes": ("spec", "pipeline_config", "options"),
    "text_positions": ("spec", "frames"),
}


@dataclass(frozen=True)
class ModelFamily:
    """Everything that differs between families of pipelines; every field is required.

    Data:
        name: the family's name (its module's last part).
        variants: variant name (the model yaml's `variant`) -> `Variant`.
        part_classes: every part (vae, text_encoder, tokenizer, processor, transformer, scheduler) ->
            "module:Class" qie builds it with.
        alpha: whether images keep their alpha channel (else it is composited on white).
        patch_size: latent pixels per side of one transformer token.
        blocks: the transformer's attribute holding its repeated blocks (swapped, sharded, compiled one by one;
            their class is the transformer's `_no_split_modules`).
        unused_in_last_block: modules of the last block whose output never reaches the loss (a joint block's
            text path: the transformer returns image tokens only); an adapter there would never train.
        lora_loader: "module:Class" of the diffusers LoRA loader of the family's pipelines: how LoRA files of
            other tools' formats are read and qie's are written.
        keep_full_precision: transformer module name patterns that weight quantization leaves alone.
        weight_signature: keys (diffusers module names) every transformer file of the family holds and no other
            family's does: how a single file (`model.transformer_path=FILE.safetensors`) is recognised.
        flavours: the family's sizes (`qie.models.flavour`): name -> `Flavour`, its one published size
            ("published", `published`: for the planner and benchmarks) and its tiny presets (`tiny_flavours`:
            a model yaml's `tiny`, written by `qie.components.tiny.build_tiny`).
        planner: `PlannerFacts`.
        outputs: what the sampler makes of one input (`qie.models.outputs`: `IMAGES`, one image per sample, or
            `LAYERS`, an image's layers): how inference writes them, the demo data set the models train on, and
            whether layer counts apply (`predict.layers`, a training sample's layers).

    Pieces (callables; parameters as `SIGNATURES` lists them):
        pipeline: the diffusers pipeline over the built parts (parts not built stay None).
        prompt_template: the prompt template(s) and cuts as one string (part of prompt cache keys).
        default_size: (height, width) made without a size or an image.
        encode_prompts: prompts seen with their images -> one {"embed", ["image_mask"]} per prompt, unpadded, CPU.
        encode_latents: same-size pixel batch (B, C, 1, H, W) on the VAE -> normalised latents (B, C', 1, h, w).
        predict: the transformer's velocity prediction for the batch noised to `sigmas`, beside the true velocity
            (a `qie.models.flow.FlowPrediction`): what the flow-matching loss (`loss`) compares.
        sample: one sample's encoded inputs -> latents of `options.num_images` images.
        denoise: the sampler's loop from given noise (B, C, F, h, w) over batched prompts (`PromptInputs`) and
            controls (B, C, 1, h, w): what `sample` runs after drawing its noise (`qie.models.sampling.initial_noise`),
            with the gradient where the caller has it on (`checkpoint`: each prediction recomputed in the backward
            pass); `pipeline_config` is the checkpoint's model_index.json (`Parts.pipeline_config`).
        decode: normalised latents -> images ("pil", "np" or "pt").
        vae_scale: pixels per latent along a side, read off the VAE.
        config_problems: why a model config cannot work with this family (checked when the config is composed).
        checkpoint_problems: why the checkpoint's files cannot work; `read_json(relative path)` reads one of its
            JSON files ({} when absent), before anything is built.
        sampling_notes: warnings about how sampling options will be applied (e.g. steps the checkpoint fixes).
        text_positions: how many prompt tokens (image slots aside) the transformer takes beside image frames
            given as `img_shapes` lists them, (frames, height, width) in tokens (`qie.models.text_positions`).
    """

    name: str
    variants: Mapping[str, Variant]
    part_classes: Mapping[str, str]
    alpha: bool
    patch_size: int
    blocks: str
    unused_in_last_block: tuple[str, ...]
    lora_loader: str
    keep_full_precision: tuple[str, ...]
    weight_signature: tuple[str, ...]
    flavours: Mapping[str, Flavour]
    planner: PlannerFacts
    outputs: Outputs
    pipeline: Callable[..., Any]
    prompt_template: Callable[..., str]
    default_size: Callable[..., tuple[int, int]]
    encode_prompts: Callable[..., list[dict]]
    encode_latents: Callable[..., Any]
    predict: Callable[..., Any]
    sample: Callable[..., Any]
    denoise: Callable[..., Any]
    decode: Callable[..., Any]
    vae_scale: Callable[..., int]
    config_problems: Callable[..., list[str]]
    checkpoint_problems: Callable[..., list[str]]
    sampling_notes: Callable[..., list[str]]
    text_positions: Callable[..., int]

    def __post_init__(self) -> None:
        parts = {"vae", "text_encoder", "tokenizer", "processor", "transformer", "scheduler"}
        if missing := parts - set(self.part_classes):
            raise FamilyError(f"family {self.name!r}: part_classes lacks {sorted(missing)}")
        if not self.variants:
            raise FamilyError(f"family {self.name!r} names no variant")
        if [name for name, f in self.flavours.items() if f.tiny is None] != ["published"] or not self.tiny_flavours:
            raise FamilyError(
                f"family {self.name!r}: flavours must hold its published size, named 'published', "
                "and at least one tiny preset"
            )
        if not isinstance(self.outputs, Outputs):
            raise FamilyError(f"family {self.name!r}: outputs is not a qie.models.outputs.Outputs")
        for f in fields(self):
            if f.name in SIGNATURES:
                _check_piece(self.name, f.name, getattr(self, f.name))

    def loss(
        self,
        transformer: Any,
        batch: Any,
        noise: Any,
        sigmas: Any,
        weighting: str = "none",
        per_sample: bool = False,
    ) -> Any:
        """The flow-matching loss of the batch noised to `sigmas`: the mean weighted squared error of the predicted
        velocity (`predict`), with the batch's loss masks; with `per_sample`, each sample's (B,)."""
        return self.predict(transformer, batch, noise, sigmas).error(weighting=weighting, per_sample=per_sample)

    @property
    def published(self) -> Flavour:
        """The published size: the parts' configs the planner and the benchmarks build."""
        return self.flavours["published"]

    @property
    def tiny_flavours(self) -> dict[str, Flavour]:
        """tiny preset name -> its flavour."""
        return {name: f for name, f in self.flavours.items() if f.tiny is not None}

    def block_classes(self) -> list[str]:
        """Class names of the transformer's repeated blocks: what FSDP wraps one by one."""
        return list(self.part_class("transformer")._no_split_modules)

    def part_class(self, part: str) -> type:
        """The class a part is built with."""
        return import_named(self.part_classes[part])

    def lora_loader_class(self) -> type:
        return import_named(self.lora_loader)


def import_named(name: str) -> Any:
    """What "module:attribute" names (a part's class, a tiny preset's tokenizer builder): the one way qie resolves
    such names."""
    import importlib

    module, _, attr = name.partition(":")
    return getattr(importlib.import_module(module), attr)


def _check_piece(family: str, name: str, piece: Any) -> None:
    if not callable(piece):
        raise FamilyError(f"family {family!r}: {name} is not callable")
    want = SIGNATURES[name]
    params = list(inspect.signature(piece).parameters.values())
    have = tuple(p.name for p in params[: len(want)])
    extra = [p.name for p in params[len(want) :] if p.default is inspect.Parameter.empty and p.kind != p.VAR_KEYWORD]
    if have != want or extra:
        raise FamilyError(f"family {family!r}: {name}{tuple(p.name for p in params)} must take {want}")
