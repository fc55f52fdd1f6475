"""Captions from a model's own vision-language text encoder: edit instructions, descriptions, Layered captions.

Every family's text encoder (Qwen2.5-VL, Qwen3-VL) is a full VL model that generates text. A `Captioner`
shows it a sample's images (control images first, then the target) with a prompt and decodes its answer:
the prompt goes through the processor's chat template, or is a complete prompt read off a diffusers
pipeline (the Layered pipeline's own caption prompt). Generation is greedy by default (deterministic); with
sampling each caption is generated alone after seeding, so one caption can be redone from its seed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from functools import cache
from typing import Any

import torch
from PIL import Image

from qie.errors import ConfigError
from qie.models.family import import_named

# --- Family facts for captioning, kept in this one place until the family interface holds them -----------
# How a prompt names its images: "Picture N: " before each image, as the Edit-Plus pipeline (and Qwen-VL's
# own chat template with add_vision_id) does. Every Qwen-Image family's VL model reads this convention.
IMAGE_NAME = "Picture {}"
IMAGE_LABEL = IMAGE_NAME + ": "
# The ChatML chat template Qwen2-VL's processor ships (default system message, image slots), for a
# processor or tokenizer saved without one (the text-to-image checkpoint, qie's tiny Edit models).
QWEN_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{% if part['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# The image slot a complete pipeline prompt (the Layered pipeline's) holds, once per image.
IMAGE_SLOT = "<|image_pad|>"


def caption_processor(parts: Any, processor_class: str) -> Any:
    """The processor that shows images to the text encoder: the pipeline's own, or (a pipeline without one:
    text-to-image) `processor_class` ("module:Class") made of the tokenizer and a default Qwen2-VL image
    processor, whose 14 px patches and 2x2 merge are Qwen2.5-VL's."""
    if parts.processor is not None:
        return parts.processor
    from transformers import Qwen2VLImageProcessorPil

    cls = import_named(processor_class)
    return cls(Qwen2VLImageProcessorPil(), parts.tokenizer, chat_template=parts.tokenizer.chat_template)


# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CaptionPrompt:
    """What the VL model is asked, from the `caption` group.

    Args:
        name: the group's choice (edit_instruction, describe, layered).
        instruction: the text after the images; `{inputs}` and `{target}` name the control images and the
            target ("Picture 1", "Picture 2"; several inputs: "Picture 1 and Picture 2").
        no_controls: the text for a sample without control images (None: `instruction`).
        show_controls: show the control images before the target (else the target alone).
        pipeline_prompt: "PipelineClass.attribute": a complete prompt read off that diffusers pipeline at run
            time, with one image slot, used as is for the target alone (`instruction` is then unused).
    """

    name: str
    instruction: str | None
    no_controls: str | None = None
    show_controls: bool = True
    pipeline_prompt: str | None = None

    def shown(self, controls: Sequence[Any], target: Any) -> list[Any]:
        """The images the VL model sees, in order: the controls (if the prompt shows them), then the target."""
        return [*controls, target] if self.show_controls and not self.pipeline_prompt else [target]

    def identity(self, num_controls: int) -> str:
        """What the model is asked of a sample with `num_controls` control images, as text that changes whenever
        the question does (the pipeline's prompt, or the chat messages before the template): part of a cached
        caption's key. The chat template itself is the processor's (its fingerprint is keyed beside it)."""
        import json

        if self.pipeline_prompt:
            return pipeline_prompt(self.pipeline_prompt)
        return json.dumps(prompt_messages(self, num_controls), sort_keys=True)


@dataclass(frozen=True)
class GenerationSettings:
    """How the text is generated: greedy (`do_sample=False`) or sampled with temperature/top_p from `seed`."""

    max_new_tokens: int = 256
    do_sample: bool = False
    temperature: float = 0.7
    top_p: float = 0.9
    seed: int = 0

    def generate_kwargs(self) -> dict[str, Any]:
        sampling = {"temperature": self.temperature, "top_p": self.top_p} if self.do_sample else {}
        return {"max_new_tokens": self.max_new_tokens, "do_sample": self.do_sample, **sampling}

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@cache
def pipeline_prompt(spec: str) -> str:
    """The prompt a diffusers pipeline keeps as an attribute ("QwenImageLayeredPipeline.image_caption_prompt_en"),
    read off a component-less instance (the Layered pipeline sets its caption prompts in `__init__`).

    Raises:
        ConfigError: no such pipeline or attribute, or a prompt without exactly one image slot.
    """
    import inspect

    import diffusers

    cls_name, _, attr = spec.partition(".")
    cls = getattr(diffusers, cls_name, None)
    if cls is None or not attr:
        raise ConfigError(f"caption.pipeline_prompt={spec!r}: expected PipelineClass.attribute of a diffusers pipeline")
    params = [n for n, p in inspect.signature(cls.__init__).parameters.items() if n != "self" and p.default is p.empty]
    text = getattr(cls(**{n: None for n in params}), attr, None)
    if not isinstance(text, str) or text.count(IMAGE_SLOT) != 1:
        raise ConfigError(
            f"caption.pipeline_prompt={spec!r}: diffusers' {cls_name} has no prompt {attr!r} with one image"
        )
    return text


def image_names(count: int) -> list[str]:
    """The names "Picture 1" ... "Picture count"."""
    return [IMAGE_NAME.format(i) for i in range(1, count + 1)]


def _joined(names: Sequence[str]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def prompt_messages(prompt: CaptionPrompt, num_controls: int) -> list[dict]:
    """The chat messages of a sample with `num_controls` control images shown before the target (labelled
    "Picture N: " when there are several images)."""
    shown = num_controls if prompt.show_controls else 0
    names = image_names(shown + 1)
    text = prompt.instruction if shown else (prompt.no_controls or prompt.instruction)
    text = str(text).replace("{inputs}", _joined(names[:-1]) if shown else "").replace("{target}", names[-1])
    content: list[dict] = []
    for name in names:
        if len(names) > 1:
            content.append({"type": "text", "text": IMAGE_LABEL.format(name.split()[-1])})
        content.append({"type": "image"})
    content.append({"type": "text", "text": text})
    return [{"role": "user", "content": content}]


class Captioner:
    """Writes captions with a VL text encoder and its processor.

    Args:
        text_encoder: a `*ForConditionalGeneration` VL model, placed on its device.
        processor: its processor (tokenizer + image processor).
        prompt: what to ask.
        settings: how to generate.
    """

    def __init__(self, text_encoder: Any, processor: Any, prompt: CaptionPrompt, settings: GenerationSettings):
        self.text_encoder = text_encoder
        self.processor = processor
        self.prompt = prompt
        self.settings = settings
        self.raw = pipeline_prompt(prompt.pipeline_prompt) if prompt.pipeline_prompt else None
        tokenizer = processor.tokenizer
        self.chat_template = getattr(processor, "chat_template", None) or tokenizer.chat_template
        self.chat_template = self.chat_template or QWEN_VL_CHAT_TEMPLATE
        tokenizer.padding_side = "left"  # generation continues every row from its last token

    def checkpoint_generation(self) -> dict[str, Any]:
        """The checkpoint's own generation settings (its generation_config.json, e.g. a repetition penalty), which
        `generate` applies where `settings` leave them: recorded with each caption so it can be redone."""
        config = self.text_encoder.generation_config.to_diff_dict()
        return {k: v for k, v in config.items() if k != "transformers_version"}

    def shown(self, controls: Sequence[Any], target: Any) -> list[Any]:
        """The images the VL model sees, in order: the controls (if the prompt shows them), then the target."""
        return self.prompt.shown(controls, target)

    def text(self, num_controls: int) -> str:
        """The exact prompt text (chat template applied) for a sample with `num_controls` control images."""
        if self.raw is not None:
            return self.raw
        messages = prompt_messages(self.prompt, num_controls)
        return self.processor.tokenizer.apply_chat_template(
            messages, chat_template=self.chat_template, tokenize=False, add_generation_prompt=True
        )

    def inputs(self, images: Sequence[Sequence[Image.Image]]) -> Any:
        """The processor's batch for samples whose shown images are `images` (see `shown`), left-padded."""
        shown = [list(imgs) for imgs in images]
        texts = [self.text(len(imgs) - 1 if self.raw is None and self.prompt.show_controls else 0) for imgs in shown]
        return self.processor(text=texts, images=shown, padding=True, return_tensors="pt")

    @torch.no_grad()
    def caption(self, images: Sequence[Sequence[Image.Image]]) -> list[str]:
        """One caption per sample; `images` are each sample's shown images (controls then target, see `shown`).

        Greedy decoding runs the samples as one batch; sampling runs each alone after seeding with
        `settings.seed`, so a caption depends on its own sample only.
        """
        if self.settings.do_sample:
            out = []
            for imgs in images:
                torch.manual_seed(self.settings.seed)
                out += self._generate([imgs])
            return out
        return self._generate(images)

    def _generate(self, images: Sequence[Sequence[Image.Image]]) -> list[str]:
        batch = self.inputs(images).to(self.text_encoder.device)
        ids = self.text_encoder.generate(**batch, **self.settings.generate_kwargs())
        new = ids[:, batch["input_ids"].shape[1] :]
        texts = self.processor.batch_decode(new, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        return [t.strip() for t in texts]
