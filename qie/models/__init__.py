"""Model descriptions: what differs between the models qie trains, as data.

`model_spec(model_cfg)` joins a model yaml (checkpoint, condition sizes, control counts, what the
transformer config must say) with its pipeline family (`FAMILIES`: the diffusers pipeline, how prompts see
their images, which image sets the output size). The prompt template, drop index, default output size and
the parts a pipeline takes are read off the diffusers class itself. Stages, encoding, keys, sampling and
validation read these fields instead of comparing model names; adding a model is one yaml file.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

from qie.errors import ConfigError


@dataclass(frozen=True)
class Family:
    """What one diffusers pipeline does with prompts and images.

    Args:
        pipeline_class: the pipeline's class name in `diffusers`.
        prompt_images: how a prompt sees the sample's control images: "none" (text only, tokenizer),
            "one" (one image, prompts batched), "all" (every image as "Picture N: ...", one prompt per call,
            since diffusers applies one image list to every prompt of a call; no image: text only).
        output_image: the control image (0 first, -1 last) whose condition size is the output size, as the
            pipeline's `__call__` picks it; None for a pipeline without control images.
        max_prompt_tokens: where `__call__` cuts prompt embeddings (its `max_sequence_length`), if it does.
        patch_size: the transformer packs patch_size x patch_size latent pixels into one token, so its
            in_channels are patch_size² times its out_channels (the VAE's latent channels).
    """

    pipeline_class: str
    prompt_images: str
    output_image: int | None
    max_prompt_tokens: int | None = None
    patch_size: int = 2


FAMILIES: dict[str, Family] = {
    "edit": Family("QwenImageEditPipeline", "one", output_image=0),
    "edit_plus": Family("QwenImageEditPlusPipeline", "all", output_image=-1),
    "text_to_image": Family("QwenImagePipeline", "none", output_image=None, max_prompt_tokens=512),
}


@dataclass(frozen=True)
class CheckpointFacts:
    """What a checkpoint says about itself: model_index.json's pipeline class, the transformer and VAE configs."""

    pipeline_class: str | None
    zero_cond_t: bool
    patch_size: int | None = None
    in_channels: int | None = None
    out_channels: int | None = None
    latent_channels: int | None = None  # the VAE's z_dim


@dataclass(frozen=True)
class ModelSpec:
    """One model: its family's behaviour and its yaml's numbers (see `qie.config.model.ModelConfig`)."""

    name: str
    variant: str
    family: Family
    min_control_images: int
    max_control_images: int
    vae_image_pixels: int
    vl_image_pixels: int
    zero_cond_t: bool = False

    @property
    def pipeline_class(self) -> str:
        return self.family.pipeline_class

    @property
    def output_image(self) -> int | None:
        return self.family.output_image

    def pipeline_cls(self) -> type:
        import diffusers

        return getattr(diffusers, self.pipeline_class)

    @property
    def part_names(self) -> tuple[str, ...]:
        """The parts the pipeline takes (its `__init__` arguments): what inference builds."""
        return pipeline_parts(self.pipeline_class)

    @property
    def prompt_parts(self) -> tuple[str, ...]:
        """What encodes a prompt besides Qwen2.5-VL: the processor where the pipeline has one, else the
        tokenizer (text-to-image builds no processor)."""
        return ("processor",) if "processor" in self.part_names else ("tokenizer",)

    @property
    def encoder_parts(self) -> tuple[str, ...]:
        """The parts precompute and live encoding build."""
        return ("vae", "text_encoder", *self.prompt_parts)

    @property
    def needs_controls(self) -> bool:
        return self.min_control_images > 0

    def pipeline(self, parts: Any) -> Any:
        """The diffusers pipeline over the built parts (parts not built stay None)."""
        return self.pipeline_cls()(**{name: getattr(parts, name, None) for name in self.part_names})

    def prompt_template(self) -> str:
        """The pipeline's prompt template, drop index and prompt cut, as one string (part of prompt keys)."""
        template, drop_idx, _ = _pipeline_facts(self.pipeline_class)
        cut = f"|{self.family.max_prompt_tokens}" if self.family.max_prompt_tokens else ""
        return f"{template}|{drop_idx}{cut}"

    def default_size(self, vae_scale: int) -> tuple[int, int]:
        """(height, width) the pipeline makes when given no size and no image: its default sample size."""
        side = _pipeline_facts(self.pipeline_class)[2] * vae_scale
        return side, side

    def output_size(
        self,
        height: int | None,
        width: int | None,
        condition_sizes: Sequence[tuple[int, int]],
        target_size: tuple[int, int] | None,
        vae_scale: int,
    ) -> tuple[int, int]:
        """(height, width) in pixels of an output: the requested sides; the others from the output image's
        condition size (Edit: the first control image, Edit-Plus: the last), else from the target (a
        training sample's size), else the pipeline's default."""
        if height is not None and width is not None:
            return int(height), int(width)
        if condition_sizes and self.output_image is not None:
            h, w = condition_sizes[self.output_image]
        elif target_size is not None:
            h, w = target_size
        else:
            h, w = self.default_size(vae_scale)
        return int(height or h), int(width or w)

    def control_problem(self, count: int) -> str | None:
        """Why a sample with `count` control images cannot be used with this model (None: it can)."""
        if count > self.max_control_images == 0:
            return (
                f"{count} control images, but model {self.name!r} is text-to-image and takes none: "
                "use an edit model (e.g. model=qwen_image_edit_2511) or a data set without control images"
            )
        if count > self.max_control_images:
            return (
                f"{count} control images, but model {self.name!r} takes at most {self.max_control_images} "
                "(use an Edit-Plus model, or remove the extra control images)"
            )
        if count < self.min_control_images:
            return (
                f"{count} control images, but model {self.name!r} needs at least {self.min_control_images} "
                "(its prompt holds the image): add a control image, or use an Edit-Plus model "
                "(e.g. model=qwen_image_edit_2511), which trains samples without one on the text-only prompt"
            )
        return None

    def mismatches(self, found: CheckpointFacts) -> list[str]:
        """How a checkpoint differs from this description (empty: it fits)."""
        problems = []
        if found.pipeline_class is not None and found.pipeline_class != self.pipeline_class:
            problems.append(f"the checkpoint is a {found.pipeline_class}, model={self.name} a {self.pipeline_class}")
        if found.zero_cond_t != self.zero_cond_t:
            problems.append(
                f"its transformer has zero_cond_t={found.zero_cond_t}, model={self.name} expects {self.zero_cond_t}"
            )
        patch = self.family.patch_size
        have = (found.patch_size, found.in_channels, found.out_channels)
        want = (patch, (found.out_channels or 0) * patch**2, found.latent_channels or found.out_channels)
        if None not in have and have != want:
            problems.append(
                f"its transformer takes patch {have[0]}, in/out channels {have[1]}/{have[2]} (VAE latent channels "
                f"{found.latent_channels}); model={self.name} expects {patch}x{patch} patches of the VAE latents "
                f"(in = {patch**2} x out = {patch**2} x latent channels)"
            )
        return problems


def model_spec(model: Any) -> ModelSpec:
    """The description of the `model` config node (a composed `model` group).

    Raises:
        ConfigError: for a variant qie does not know, naming the ones it does.
    """
    variant = str(getattr(model.variant, "value", model.variant))
    if variant not in FAMILIES:
        raise ConfigError(f"model.variant={variant!r} is not known: choose one of {', '.join(FAMILIES)}")
    return ModelSpec(
        name=str(model.name),
        variant=variant,
        family=FAMILIES[variant],
        min_control_images=int(model.min_control_images),
        max_control_images=int(model.max_control_images),
        vae_image_pixels=int(model.vae_image_pixels),
        vl_image_pixels=int(model.vl_image_pixels),
        zero_cond_t=bool(model.get("zero_cond_t", False)),
    )


def fitting_models(found: CheckpointFacts) -> list[str]:
    """The `model=` names of qie's model yamls that describe a checkpoint like `found` (real models first,
    then the tiny ones), for the hint of a mismatch."""
    from importlib.resources import files

    from omegaconf import OmegaConf

    fits = []
    for path in files("qie.conf").joinpath("model").iterdir():
        if path.name.endswith(".yaml"):
            node = OmegaConf.create(path.read_text(encoding="utf-8"))
            if not model_spec(node).mismatches(found):
                fits.append((bool(node.get("tiny")), str(node.name)))
    return [name for _, name in sorted(fits)]


@cache
def _pipeline_facts(pipeline_class: str) -> tuple[str, int, int]:
    """(prompt template, drop index, default sample size) of a component-less pipeline instance."""
    import diffusers

    cls = getattr(diffusers, pipeline_class)
    pipe = cls(**{name: None for name in pipeline_parts(pipeline_class)})
    return pipe.prompt_template_encode, int(pipe.prompt_template_encode_start_idx), int(pipe.default_sample_size)


@cache
def pipeline_parts(pipeline_class: str) -> tuple[str, ...]:
    """The parts a diffusers pipeline takes: its `__init__` arguments, in their order."""
    import diffusers

    params = inspect.signature(getattr(diffusers, pipeline_class).__init__).parameters
    return tuple(name for name in params if name != "self")
