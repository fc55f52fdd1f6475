"""Qwen2-VL and Qwen3-VL processors that need no video processor, hence no torchvision.

transformers' `Qwen2VLProcessor` and `Qwen3VLProcessor` insist on a video processor, and their video
processors import torchvision. The Qwen-Image pipelines only ever pass images, so these subclasses drop
the video part and use the PIL image processor (Qwen3-VL uses Qwen2-VL's image processor too).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, Qwen2VLImageProcessorPil, Qwen2VLProcessor, Qwen3VLProcessor
from transformers.processing_utils import ProcessorMixin

from qie.errors import ModelLoadError

IMAGE_PROCESSOR_FILE = "preprocessor_config.json"
PROCESSOR_FILE = "processor_config.json"  # transformers 5 save_pretrained nests the image config here
TOKENIZER_FILES = ("tokenizer.json", "vocab.json")  # either is enough for a Qwen2 BPE tokenizer


class QwenImageProcessorNoVideo(Qwen2VLProcessor):
    """`Qwen2VLProcessor` made of an image processor and a tokenizer only (no video processor).

    The sub-processors a `ProcessorMixin` expects are read from the `__init__` signature, so
    leaving `video_processor` out of it is what removes the video part.
    """

    def __init__(
        self,
        image_processor: Any = None,
        tokenizer: Any = None,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> None:
        self.image_token = getattr(tokenizer, "image_token", None) or "<|image_pad|>"
        self.video_token = getattr(tokenizer, "video_token", None) or "<|video_pad|>"
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template, **kwargs)


class Qwen3VLProcessorNoVideo(Qwen3VLProcessor):
    """`Qwen3VLProcessor` made of an image processor and a tokenizer only (no video processor)."""

    def __init__(
        self,
        image_processor: Any = None,
        tokenizer: Any = None,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> None:
        QwenImageProcessorNoVideo.__init__(self, image_processor, tokenizer, chat_template, **kwargs)
        self.vision_start_token = getattr(tokenizer, "vision_start_token", None) or "<|vision_start|>"
        self.vision_end_token = getattr(tokenizer, "vision_end_token", None) or "<|vision_end|>"
        self.vision_start_token_id = tokenizer.convert_tokens_to_ids(self.vision_start_token)
        self.vision_end_token_id = tokenizer.convert_tokens_to_ids(self.vision_end_token)


def _nests_image_processor(path: Path) -> bool:
    try:
        return "image_processor" in json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False


def _missing_local_files(folder: Path) -> list[str]:
    """What a local processor folder lacks, as human-readable items (empty: nothing missing)."""
    if not folder.is_dir():
        return [f"the folder itself ({folder} does not exist or is not a directory)"]
    missing = []
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        missing.append("tokenizer files (tokenizer.json, or vocab.json + merges.txt)")
    if not ((folder / IMAGE_PROCESSOR_FILE).is_file() or _nests_image_processor(folder / PROCESSOR_FILE)):
        missing.append(f"image processor config ({IMAGE_PROCESSOR_FILE}, or {PROCESSOR_FILE} with one)")
    return missing


def _processor_chat_template(source: str, kwargs: dict[str, Any]) -> str | None:
    """The chat template a processor folder keeps beside the tokenizer (`chat_template.json`), if any."""
    from transformers.utils import cached_file

    try:
        path = cached_file(source, "chat_template.json", _raise_exceptions_for_missing_entries=False, **kwargs)
    except (OSError, ValueError):
        return None
    return json.loads(Path(path).read_text(encoding="utf-8"))["chat_template"] if path else None


def load_processor(
    pretrained_model_name_or_path: str | os.PathLike,
    subfolder: str = "processor",
    revision: str | None = None,
    processor_class: type = QwenImageProcessorNoVideo,
) -> Any:
    """Load the tokenizer and PIL image processor of `<path>/<subfolder>` into a video-free processor.

    `processor_class` is `QwenImageProcessorNoVideo` (Qwen2.5-VL) or `Qwen3VLProcessorNoVideo`.

    `pretrained_model_name_or_path` is a hub id or a local diffusers-format folder. A video
    processor config there, if any, is ignored. Raises `ModelLoadError` naming the path and
    what is missing when it cannot be loaded.
    """
    source = str(pretrained_model_name_or_path)
    where = f"{source}/{subfolder}" if subfolder else source
    local = Path(source)
    if local.is_dir():
        missing = _missing_local_files(local / subfolder if subfolder else local)
        if missing:
            raise ModelLoadError(f"cannot load the processor from {where}: missing {'; '.join(missing)}")
    kwargs: dict[str, Any] = {"subfolder": subfolder or ""}
    if revision is not None:
        kwargs["revision"] = revision
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot load the processor's tokenizer from {where}: {e}") from e
    try:
        image_processor = Qwen2VLImageProcessorPil.from_pretrained(source, **kwargs)
    except (OSError, ValueError) as e:
        raise ModelLoadError(
            f"cannot load the processor's image processor ({IMAGE_PROCESSOR_FILE}) from {where}: {e}"
        ) from e
    chat_template = getattr(tokenizer, "chat_template", None) or _processor_chat_template(source, kwargs)
    return processor_class(image_processor, tokenizer, chat_template=chat_template)
