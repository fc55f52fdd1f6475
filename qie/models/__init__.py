"""Model descriptions: what differs between the variants of a model family, as data.

A variant names its diffusers pipeline (whose prompt template, drop index and encoding code qie reuses),
how its prompts see their images, and which control image sets the output size. Stages, encoding, keys,
sampling and validation read these fields instead of comparing variant names.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Any

from qie.errors import ConfigError


@dataclass(frozen=True)
class ModelSpec:
    """One model variant.

    Args:
        variant: the `model.variant` value.
        pipeline_class: the diffusers pipeline class name (imported from `diffusers`).
        multi_image_prompt: a prompt sees all of its sample's control images ("Picture 1: ...") and is
            encoded on its own, since diffusers applies one image list to every prompt of a call.
        output_image: the control image (0 first, -1 last) whose condition size is the output size,
            as the pipeline's `__call__` picks it.
    """

    variant: str
    pipeline_class: str
    multi_image_prompt: bool = False
    output_image: int = 0

    def pipeline_cls(self) -> type:
        import diffusers

        return getattr(diffusers, self.pipeline_class)

    def pipeline(self, parts: Any) -> Any:
        """The diffusers pipeline over the built parts (parts not built stay None)."""
        from qie.components.registry import PART_NAMES

        return self.pipeline_cls()(**{name: getattr(parts, name) for name in PART_NAMES})

    def prompt_template(self) -> str:
        """The pipeline's prompt template and drop index, as one string (part of prompt cache keys)."""
        return _template(self.pipeline_class)

    def output_size(self, condition_sizes: list[tuple[int, int]]) -> tuple[int, int]:
        """(height, width) of the output, from the (height, width) of each control image at its VAE
        condition size (the pipeline's rule: that image's aspect at the condition area)."""
        return condition_sizes[self.output_image]


@cache
def _template(pipeline_class: str) -> str:
    import diffusers

    cls = getattr(diffusers, pipeline_class)
    pipe = cls(**{name: None for name in ("vae", "text_encoder", "tokenizer", "processor", "transformer", "scheduler")})
    return f"{pipe.prompt_template_encode}|{pipe.prompt_template_encode_start_idx}"


SPECS: dict[str, ModelSpec] = {
    "edit": ModelSpec("edit", "QwenImageEditPipeline"),
    "edit_plus": ModelSpec("edit_plus", "QwenImageEditPlusPipeline", multi_image_prompt=True, output_image=-1),
}


def model_spec(variant: str) -> ModelSpec:
    """The description of `variant`.

    Raises:
        ConfigError: for a variant qie does not know, naming the ones it does.
    """
    try:
        return SPECS[str(getattr(variant, "value", variant))]
    except KeyError:
        raise ConfigError(f"model.variant={variant!r} is not known: choose one of {', '.join(SPECS)}") from None
