"""Model descriptions: what differs between the models qie trains, as data.

`model_spec(model_cfg)` joins a model yaml (checkpoint, condition sizes, control counts, what the
transformer config must say) with its pipeline family (`FAMILIES`: the diffusers pipeline, how prompts see
their images, which image sets the output size). The prompt template, drop index, default output size,
sampling defaults and the parts a pipeline takes are read off the diffusers class itself. Stages, encoding,
keys, sampling and validation read these fields instead of comparing model names; adding a model is one
yaml file. A family whose pipeline works differently (Qwen-Image-2.1) names its own module (`Family.code`,
e.g. `qie.models.qwen_image_21`), which provides the pieces that differ; the spec hands them out.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache
from types import ModuleType
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
        code: the module of a family whose pipeline works unlike Qwen-Image's (see `DEFAULT_PIECES`); None
            for the Qwen-Image pipelines, whose pieces are qie's defaults.
    """

    pipeline_class: str
    prompt_images: str
    output_image: int | None
    max_prompt_tokens: int | None = None
    patch_size: int = 2
    code: str | None = None


# What a family module (`Family.code`) may provide, where the family differs from the Qwen-Image pipelines:
# PART_CLASSES (part -> "module:Class"), ALPHA (images keep alpha), pipeline(parts), prompt_template(),
# default_size(spec), encode_prompt(pipeline, prompt, images, device) -> {"embed", "image_mask"}, and the
# pieces of DEFAULT_PIECES with their names and signatures: flow_matching_loss(transformer, batch, noise,
# sigmas, weighting) -> loss; sample(parts, prompt, negative, controls, size, options, progress) -> latents;
# decode_latents(vae, latents, output_type) -> images.
DEFAULT_PIECES = {
    "flow_matching_loss": "qie.training.step:flow_matching_loss",
    "sample": "qie.sampling:sample_edit",
    "decode_latents": "qie.sampling:decode_latents",
}


FAMILIES: dict[str, Family] = {
    "edit": Family("QwenImageEditPipeline", "one", output_image=0),
    "edit_plus": Family("QwenImageEditPlusPipeline", "all", output_image=-1),
    "text_to_image": Family("QwenImagePipeline", "none", output_image=None, max_prompt_tokens=512),
    # Text to image and editing with up to 10 references, which the prompt sees all at once.
    "qwen_image_21": Family("QwenImage21Pipeline", "all", -1, patch_size=1, code="qie.models.qwen_image_21"),
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
    # The pipeline's own sampling defaults (its `__call__`'s), the `predict` group's defaults.
    true_cfg_scale: float = 4.0
    num_inference_steps: int = 50

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

    @property
    def code(self) -> ModuleType | None:
        """The family's own module, or None for the Qwen-Image pipelines."""
        return importlib.import_module(self.family.code) if self.family.code else None

    def piece(self, name: str) -> Any:
        """The family module's `name`, else the Qwen-Image one (`DEFAULT_PIECES`)."""
        if hasattr(self.code, name):
            return getattr(self.code, name)
        module, _, attr = DEFAULT_PIECES[name].partition(":")
        return getattr(importlib.import_module(module), attr)

    @property
    def part_classes(self) -> dict[str, str]:
        """The parts whose class is not the registry's default: part name -> "module:Class"."""
        return dict(getattr(self.code, "PART_CLASSES", {}))

    @property
    def alpha(self) -> bool:
        """Whether images keep their alpha channel (else it is composited on white)."""
        return bool(getattr(self.code, "ALPHA", False))

    @property
    def prompt_encoder(self) -> Callable[..., dict] | None:
        """The family's own prompt encoding (one prompt per call); None: `Encoder`'s batched one."""
        return getattr(self.code, "encode_prompt", None)

    @property
    def loss(self) -> Callable[..., Any]:
        return self.piece("flow_matching_loss")

    @property
    def sampler(self) -> Callable[..., Any]:
        return self.piece("sample")

    @property
    def decoder(self) -> Callable[..., Any]:
        return self.piece("decode_latents")

    def pipeline(self, parts: Any) -> Any:
        """The diffusers pipeline over the built parts (parts not built stay None)."""
        if self.code is not None:
            return self.code.pipeline(parts)
        return self.pipeline_cls()(**{name: getattr(parts, name, None) for name in self.part_names})

    def prompt_template(self) -> str:
        """The pipeline's prompt template, drop index and prompt cut, as one string (part of prompt keys)."""
        if self.code is not None:
            return self.code.prompt_template()
        template, drop_idx, _ = _pipeline_facts(self.pipeline_class)
        cut = f"|{self.family.max_prompt_tokens}" if self.family.max_prompt_tokens else ""
        return f"{template}|{drop_idx}{cut}"

    def default_size(self, vae_scale: int) -> tuple[int, int]:
        """(height, width) the pipeline makes when given no size and no image: its default sample size."""
        if self.code is not None:
            return self.code.default_size(self)
        side = _pipeline_facts(self.pipeline_class)[2] * vae_scale
        return side, side

    def call_defaults(self) -> dict[str, Any]:
        """The model's defaults for the sampling options left unset (`SamplingOptions.resolved`)."""
        return {"true_cfg_scale": self.true_cfg_scale, "num_inference_steps": self.num_inference_steps}

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
        true_cfg_scale=float(model.get("true_cfg_scale", 4.0)),
        num_inference_steps=int(model.get("num_inference_steps", 50)),
    )


@cache
def _pipeline_facts(pipeline_class: str) -> tuple[str, int, int]:
    """(prompt template, drop index, default sample size) of a component-less pipeline instance."""
    import diffusers

    cls = getattr(diffusers, pipeline_class)
    pipe = cls(**{name: None for name in pipeline_parts(pipeline_class)})
    return pipe.prompt_template_encode, int(pipe.prompt_template_encode_start_idx), int(pipe.default_sample_size)


@cache
def pipeline_parts(pipeline_class: str) -> tuple[str, ...]:
    """The parts a diffusers pipeline takes: its required `__init__` arguments, in their order (settings
    with a default, such as 2.1's `sample_sigmas`, are not parts)."""
    import diffusers

    params = inspect.signature(getattr(diffusers, pipeline_class).__init__).parameters
    return tuple(n for n, p in params.items() if n != "self" and p.default is inspect.Parameter.empty)
