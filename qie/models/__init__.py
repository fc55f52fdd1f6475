"""Model families and model descriptions.

`FAMILY_MODULES` is the one list of model families: each module builds a `ModelFamily` (`qie.models.family`)
named `FAMILY`, with every piece qie needs of it. `model_spec(model_cfg)` joins a model yaml (checkpoint,
condition sizes, control counts, what the transformer config must say) with its family and variant into the
`ModelSpec` every stage reads. A stage builds the spec once, at its edge, and passes it down.

Adding a family: one module here (its `FAMILY`, with its flavours: the published size and at least one tiny
preset), its name in `FAMILY_MODULES`, one model yaml per variant in `conf/model/`, and its tiny model's name in
the test battery.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING, Any

from qie.errors import ConfigError
from qie.models.family import FamilyError, ModelFamily, PlannerFacts, Variant
from qie.models.flavour import Flavour

if TYPE_CHECKING:  # the schema for annotations only: a family's step code loads no config library
    from qie.config.model import ModelConfig

# The model families qie knows, by module. The only list of family names: variants and tiny presets are
# read off the families.
FAMILY_MODULES = ("qie.models.qwen_image", "qie.models.qwen_image_21", "qie.models.qwen_image_layered")


@cache
def families() -> dict[str, ModelFamily]:
    """name -> family, each checked as it registers (`ModelFamily` requires every piece)."""
    out = {}
    for path in FAMILY_MODULES:
        family = getattr(importlib.import_module(path), "FAMILY", None)
        if not isinstance(family, ModelFamily):
            raise FamilyError(f"{path} defines no FAMILY (a qie.models.family.ModelFamily)")
        out[family.name] = family
    return out


@cache
def variants() -> dict[str, tuple[ModelFamily, Variant]]:
    """variant name (a model yaml's `variant`) -> (its family, the variant)."""
    return {name: (f, v) for f in families().values() for name, v in f.variants.items()}


@cache
def tiny_presets() -> dict[str, tuple[ModelFamily, Flavour]]:
    """tiny preset name (a model yaml's `tiny`, `python -m qie.tiny PRESET`) -> (its family, its flavour)."""
    return {name: (f, flavour) for f in families().values() for name, flavour in f.tiny_flavours.items()}


def family_of(transformer: Any) -> ModelFamily:
    """The family of a transformer: of the families whose transformer class it is an instance of, the one whose
    `weight_signature` its modules hold; where several do (a Layered transformer holds Qwen-Image's modules too),
    the longest signature names it, as for a single file. Adapters, quantization and FSDP keep the class (or
    subclass it) and the module names.

    Raises:
        FamilyError: a transformer of no family qie knows, or one two families' signatures fit alike.
    """
    modules = {name for name, _ in transformer.named_modules()}
    matches = sorted(
        (
            f
            for f in families().values()
            if isinstance(transformer, f.part_class("transformer"))
            and all(key.rpartition(".")[0] in modules for key in f.weight_signature)
        ),
        key=lambda f: len(f.weight_signature),
        reverse=True,
    )
    if not matches:
        raise FamilyError(f"{type(transformer).__name__} is the transformer of no model family qie knows")
    if len(matches) > 1 and len(matches[0].weight_signature) == len(matches[1].weight_signature):
        raise FamilyError(
            f"{type(transformer).__name__} fits the families {matches[0].name!r} and "
            f"{matches[1].name!r} alike: their weight signatures do not tell them apart"
        )
    return matches[0]


@dataclass(frozen=True)
class CheckpointFacts:
    """What a checkpoint says about itself: model_index.json's pipeline class, the transformer and VAE configs."""

    pipeline_class: str | None
    zero_cond_t: bool | None  # None: no transformer config could be read (a hub id offline, a partial folder)
    patch_size: int | None = None
    in_channels: int | None = None
    out_channels: int | None = None
    latent_channels: int | None = None  # the VAE's z_dim


@dataclass(frozen=True)
class ModelSpec:
    """One model: its family (`family`, whose pieces callers use directly, e.g. `spec.family.sample(...)`,
    `spec.family.pipeline(spec, parts)`) and its yaml's numbers (see `qie.config.model.ModelConfig`)."""

    name: str
    variant: str
    family: ModelFamily
    pipe: Variant
    min_control_images: int
    max_control_images: int
    vae_image_pixels: int
    vl_image_pixels: int
    zero_cond_t: bool = False
    # The pipeline's own sampling defaults (its `__call__`'s), the `predict` group's defaults (`call_defaults`);
    # the model schema's (`qie.config.model.ModelConfig`) are the same, as a test checks.
    true_cfg_scale: float = 4.0
    num_inference_steps: int = 50

    @property
    def pipeline_class(self) -> str:
        return self.pipe.pipeline_class

    @property
    def output_image(self) -> int | None:
        return self.pipe.output_image

    def pipeline_cls(self) -> type:
        import diffusers

        return getattr(diffusers, self.pipeline_class)

    @property
    def part_names(self) -> tuple[str, ...]:
        """The parts the pipeline takes (its `__init__` arguments): what inference builds."""
        return pipeline_parts(self.pipeline_class)

    @property
    def prompt_parts(self) -> tuple[str, ...]:
        """What encodes a prompt besides the text encoder: the processor where the prompt sees images, else the
        tokenizer (text-to-image builds no processor; Layered's prompt is text alone, though it has one)."""
        if self.pipe.prompt_images == "none" or "processor" not in self.part_names:
            return ("tokenizer",)
        return ("processor",)

    @property
    def encoder_parts(self) -> tuple[str, ...]:
        """The parts precompute and live encoding build."""
        return ("vae", "text_encoder", *self.prompt_parts)

    @property
    def needs_controls(self) -> bool:
        return self.min_control_images > 0

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
            h, w = self.family.default_size(self, vae_scale)
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

    def layers_problem(self, count: int) -> str | None:
        """Why a training sample with `count` layers cannot be used with this model (None: it can): the rule of
        the family's outputs."""
        return self.family.outputs.layers_problem(self.name, count)

    def mismatches(self, found: CheckpointFacts) -> list[str]:
        """How a checkpoint differs from this description (empty: it fits). A checkpoint of another pipeline
        is named as such first; the transformer's details are compared only for the right pipeline."""
        if found.pipeline_class is not None and found.pipeline_class != self.pipeline_class:
            return [f"the checkpoint is a {found.pipeline_class}, model={self.name} a {self.pipeline_class}"]
        problems = []
        if found.zero_cond_t is not None and found.zero_cond_t != self.zero_cond_t:
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


def model_spec(model: ModelConfig) -> ModelSpec:
    """The description of a `model` group (its schema's dataclass: `Checked.groups.model`, or
    `ModelConfig.of_values` for a model yaml read without Hydra).

    Raises:
        ConfigError: for a variant qie does not know, naming the ones it does.
    """
    variant = str(model.variant)
    known = variants()
    if variant not in known:
        raise ConfigError(f"model.variant={variant!r} is not known: choose one of {', '.join(known)}")
    family, pipe = known[variant]
    return ModelSpec(
        name=str(model.name),
        variant=variant,
        family=family,
        pipe=pipe,
        min_control_images=model.min_control_images,
        max_control_images=model.max_control_images,
        vae_image_pixels=model.vae_image_pixels,
        vl_image_pixels=model.vl_image_pixels,
        zero_cond_t=model.zero_cond_t,
        true_cfg_scale=model.true_cfg_scale,
        num_inference_steps=model.num_inference_steps,
    )


@cache
def pipeline_parts(pipeline_class: str) -> tuple[str, ...]:
    """The parts a diffusers pipeline takes: its required `__init__` arguments, in their order (settings
    with a default, such as 2.1's `sample_sigmas`, are not parts)."""
    import diffusers

    params = inspect.signature(getattr(diffusers, pipeline_class).__init__).parameters
    return tuple(n for n, p in params.items() if n != "self" and p.default is inspect.Parameter.empty)


__all__ = [
    "FAMILY_MODULES",
    "CheckpointFacts",
    "FamilyError",
    "Flavour",
    "ModelFamily",
    "ModelSpec",
    "PlannerFacts",
    "Variant",
    "families",
    "family_of",
    "model_spec",
    "pipeline_parts",
    "tiny_presets",
    "variants",
]
