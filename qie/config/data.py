"""Schema of the `data` group: where samples come from and how images are prepared."""

from dataclasses import dataclass, field
from enum import StrEnum

from qie.config.ranges import first, out_of_range


class DataFormat(StrEnum):
    # A folder in the folder layout, a .jsonl/.csv manifest, or else a Hugging Face data set.
    auto = "auto"
    folder = "folder"
    manifest = "manifest"
    hf = "hf"  # `save_to_disk` folder, parquet file(s) or glob, or an `imagefolder` folder (qie[hf])


class ResizeMode(StrEnum):
    """How a target image reaches the target area: keep aspect and resize, or center-crop."""

    resize = "resize"
    crop = "crop"


@dataclass
class DataColumns:
    """Column names of a Hugging Face data set: image columns hold images (bytes or paths)."""

    target: str | None = "target"
    # Several columns of one image each, or one column holding a list of images.
    controls: list[str] = field(default_factory=lambda: ["controls"])
    prompt: str = "prompt"
    # A column of unique sample ids; without it a row's id is its number (row000000, ...).
    id: str | None = None
    # A column of loss mask images (data.mask.source=file).
    mask: str | None = None
    # A column holding each row's ordered layers (a list of images), for a layered model (Qwen-Image-Layered):
    # then set target and controls to the column of the image the layers split.
    layers: str | None = None
    # A column of rejected results: each row a preference pair (target preferred) for `train/objective=dpo`.
    rejected: str | None = None


@dataclass
class RegularizationConfig:
    # A second data set (any format data.path takes) trained between the main one's batches; null: none.
    path: str | None = None
    weight: float = 1.0  # its loss is multiplied by this
    ratio: float = 0.25  # the share of optimizer steps it takes

    def problem(self) -> str | None:
        """Where it has a path: a weight of 0 or more, a share of the steps inside (0, 1)."""
        if not self.path:
            return None
        if self.weight < 0:
            return f"data.regularization.weight={self.weight} is out of range: give 0 or more"
        if not 0.0 < self.ratio < 1.0:
            return (
                f"data.regularization.ratio={self.ratio} is out of range: give the share of steps, above 0 and below 1"
            )
        return None


@dataclass
class DataConfig:
    # A data set folder (training_images/, control_images/), a manifest file (.jsonl or .csv), or a Hugging
    # Face data set (a `save_to_disk` folder, parquet files or a glob of them, an `imagefolder` folder).
    path: str | None = None
    format: DataFormat = DataFormat.auto
    # Hugging Face data sets: which split and which columns.
    split: str = "train"
    columns: DataColumns = field(default_factory=DataColumns)
    # Area in pixels the target image is resized to (aspect kept, sides rounded to `multiple_of`).
    target_pixels: int = 1024 * 1024
    resize_mode: ResizeMode = ResizeMode.resize
    multiple_of: int = 32
    caption_dropout_rate: float = 0.0
    # A sample without a caption (no <stem>.txt, an empty one, a row without "prompt") is refused; true:
    # captioned once by the model's own VL text encoder with its family's caption prompt (or
    # `auto_caption_prompt`), the caption cached like any entry (type `caption`), keyed by the images shown,
    # the caption prompt, the generation settings and the text encoder.
    auto_caption: bool = False
    # A caption preset of `conf/caption/` (edit_instruction, describe, layered), or a .yaml file of the
    # `caption` group's fields (instruction, pipeline_prompt, max_new_tokens, ...); null: the model's own
    # (edit_instruction for edit models, describe for text to image, layered for Qwen-Image-Layered).
    auto_caption_prompt: str | None = None
    # Chance that a batch trains without its control images, on the text-only prompt (Edit-Plus, 2511, 2.1);
    # precompute then caches each sample's text-only prompt too.
    control_dropout_rate: float = 0.0
    # Regularisation (prior-preservation) data, cached like the main set (docs/guide.md, "Regularisation data").
    regularization: RegularizationConfig = field(default_factory=RegularizationConfig)
    batch_size: int = 1
    # Loader worker processes. 0 (default): the prefetch thread below reads cached entries ahead of the step,
    # which hides the reads without a process per worker (faster and ~600 MiB less for small cached steps);
    # workers help when reading a batch costs more than a step (live images, slow disks).
    num_workers: int = 0
    # Batches a background thread of the training process keeps ready (cached sources only; 0: no thread).
    prefetch: int = 4
    shuffle: bool = True
    # Images outside the data set's folder (manifest rows naming "../x.png" or "/abs/x.png"; symbolic links of any
    # layout leading elsewhere) are refused unless this is true.
    allow_outside_paths: bool = False

    def problem(self) -> str | None:
        """The first of the loader's settings out of range, as one line; None when each is in."""
        return first(
            out_of_range("data.caption_dropout_rate", self.caption_dropout_rate, 0.0, 1.0),
            out_of_range("data.batch_size", self.batch_size, 1),
            out_of_range("data.num_workers", self.num_workers, 0),
            out_of_range("data.prefetch", self.prefetch, 0),
            out_of_range("data.target_pixels", self.target_pixels, 1),
            out_of_range("data.multiple_of", self.multiple_of, 1),
        )
