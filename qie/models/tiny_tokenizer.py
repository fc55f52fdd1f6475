"""The tiny models' tokenizers: byte-level BPEs trained offline on the pipelines' prompt templates.

A tiny flavour names its tokenizer's builder and the pipelines whose templates it learns
(`qie.models.flavour.Tiny`). `build_tokenizer`, trained on the templates of the Qwen-Image pipelines that share it
(the Edit pipelines, the text-to-image one, or the Layered one), tokenises each template's system-prompt prefix to
exactly the pipeline's drop index (`prompt_template_encode_start_idx`), so the pipelines' real prefix dropping runs
on the tiny models. `build_tokenizer_21` is Qwen-Image-2.1's, trained on its templates (written out here) with
a Qwen-VL chat template, from which the pipeline derives its drop index.
"""

from __future__ import annotations

import inspect
import json
import re
from collections.abc import Sequence

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import Qwen2Tokenizer
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

# Qwen2.5-VL's special tokens, in Qwen's order; here they take ids 0..13.
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
TOKENIZER_VOCAB_CAP = 1024
EDIT_INSTRUCTIONS = [
    "Make the sky blue.",
    "Remove the red car from the street.",
    "Add a small hat to the dog.",
    "Change the color of the dress to green.",
    "Turn the photo into a pencil sketch.",
    "Replace the background with a sandy beach at sunset.",
    "Put a pair of glasses on the man.",
    "Make it look like winter, with snow on the ground.",
    "Change the text on the sign to 'OPEN'.",
    "Remove the people in the background.",
    "Make the cat orange and fluffy.",
    "Rotate the cup so the handle faces left.",
    "Add soft light from the window on the right.",
    "Make the image brighter and more colorful.",
    "Turn the house into a wooden cabin.",
    "Give the woman long black hair.",
    "Replace the apple with a pear.",
    "Make the water calm and clear.",
    "Put the object from picture 2 on the table in picture 1.",
    "Keep the face, change the clothes.",
]


def _template(pipeline_cls: type) -> tuple[str, int]:
    """The pipeline's prompt template and its drop index, read off a component-less instance."""
    names = [n for n in inspect.signature(pipeline_cls.__init__).parameters if n != "self"]
    pipe = pipeline_cls(**{n: None for n in names})
    return pipe.prompt_template_encode, int(pipe.prompt_template_encode_start_idx)


def system_prefix(pipeline_cls: type) -> tuple[str, int]:
    """The template's system-prompt prefix (through "<|im_start|>user\\n") and the drop index."""
    template, drop_idx = _template(pipeline_cls)
    user_start = "<|im_start|>user\n"
    cut = template.rindex(user_start, 0, template.index("{}")) + len(user_start)
    return template[:cut], drop_idx


def _training_corpus(pipelines: Sequence[type]) -> list[str]:
    """The templates and some edit instructions, cut at the special tokens (those are not learned)."""
    texts = [_template(pipeline_cls)[0] for pipeline_cls in pipelines]
    return without_special_tokens(texts + [f"Picture {i}: " for i in range(1, 4)] + EDIT_INSTRUCTIONS)


def train_bpe(corpus: Sequence[str], vocab_size: int = TOKENIZER_VOCAB_CAP) -> Qwen2Tokenizer:
    """A byte-level BPE (Qwen2 pre-tokenizer, Qwen special tokens) trained on `corpus`, as a `Qwen2Tokenizer`."""
    bpe = Tokenizer(models.BPE())
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(corpus, trainer)
    model = json.loads(bpe.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    return Qwen2Tokenizer(
        vocab=model["vocab"],
        merges=merges,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        extra_special_tokens=SPECIAL_TOKENS[1:],
        model_max_length=32768,
    )


def without_special_tokens(texts: Sequence[str]) -> list[str]:
    """`texts` cut at the special tokens (those are not learned)."""
    special = re.compile("|".join(re.escape(t) for t in SPECIAL_TOKENS))
    return [part for text in texts for part in special.split(text) if part]


def build_tokenizer(*pipelines: type) -> Qwen2Tokenizer:
    """Train the tiny byte-level BPE on `pipelines`' templates and some edit instructions.

    Raises:
        RuntimeError: a pipeline's system prefix does not tokenise to exactly its drop index.
    """
    tokenizer = train_bpe(_training_corpus(pipelines))
    for pipeline_cls in pipelines:  # the pipelines' prefix dropping must cut exactly here
        prefix, drop_idx = system_prefix(pipeline_cls)
        if (n := len(tokenizer(prefix)["input_ids"])) != drop_idx:
            raise RuntimeError(f"{pipeline_cls.__name__}: system prefix is {n} tokens, pipeline drops {drop_idx}")
    return tokenizer


# Qwen-VL's chat template, reduced to what a prompt of text and images needs.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MAX_REFERENCES = 10  # Qwen-Image-2.1's reference images


def _templates_21() -> list[str]:
    """The text of 2.1's prompt templates (training text for the tokenizer, not read by the pipeline)."""
    system = "Comprehend and analyze the provided prompt."
    images = "".join(f" <image{i}><|vision_start|><|image_pad|><|vision_end|>" for i in range(1, MAX_REFERENCES + 1))
    return [
        f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{{}}<|im_end|>\n<|im_start|>assistant\n",
        f"<|im_start|>user\n{images}<|im_end|>\n",
    ]


def build_tokenizer_21() -> Qwen2Tokenizer:
    """A byte-level BPE (Qwen2 pre-tokenizer, Qwen special tokens) trained on 2.1's templates and some prompts."""
    tokenizer = train_bpe(without_special_tokens(_templates_21() + EDIT_INSTRUCTIONS), vocab_size=768)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer
