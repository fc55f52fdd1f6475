"""Schema of the `data` group: where samples come from and how images are prepared."""

from dataclasses import dataclass
from enum import Enum


class DataFormat(str, Enum):
    auto = "auto"  # a folder is the folder layout, a .jsonl/.csv file a manifest
    folder = "folder"
    manifest = "manifest"


class ResizeMode(str, Enum):
    """How a target image reaches the target area: keep aspect and resize, or center-crop."""

    resize = "resize"
    crop = "crop"


@dataclass
class DataConfig:
    # A data set folder (training_images/, control_images/) or a manifest file (.jsonl or .csv).
    path: str | None = None
    format: DataFormat = DataFormat.auto
    # Area in pixels the target image is resized to (aspect kept, sides rounded to `multiple_of`).
    target_pixels: int = 1024 * 1024
    resize_mode: ResizeMode = ResizeMode.resize
    multiple_of: int = 32
    caption_dropout_rate: float = 0.0
    batch_size: int = 1
    num_workers: int = 2
    # Batches a background thread of the training process keeps ready (cached sources only; 0: no thread).
    prefetch: int = 4
    shuffle: bool = True
