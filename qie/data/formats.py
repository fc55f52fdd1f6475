"""Which kind of data set `data.path` names, and reading any kind into samples.

Three kinds: qie's folder layout, a .jsonl/.csv manifest (both in `qie.data.samples`), and a Hugging Face
data set (`qie.data.hf`: a `save_to_disk` folder, parquet files or a glob of them, an `imagefolder`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from operator import attrgetter
from pathlib import Path

from qie.data.fields import DEFAULT_FIELDS, SampleField
from qie.data.hf import GLOB_CHARACTERS, Columns, ImageFolder, scan_hf
from qie.data.samples import MAX_PROMPT_CHARS, DataProblem, Dataset, prompt_problem
from qie.data.scan import scan_dataset
from qie.errors import DataError

MANIFEST_SUFFIXES = (".jsonl", ".json", ".csv")
HF_FILE_SUFFIXES = (".parquet", ".arrow")


@dataclass(frozen=True, kw_only=True)
class DataSource:
    """Where samples come from: `path`, its `format`, and for Hugging Face data sets the split, the columns
    and the folder in-data-set images are written to (content-addressed, so cache keys hash their bytes)."""

    path: str
    format: str = "auto"
    split: str = "train"
    columns: Columns = field(default_factory=Columns)
    images_dir: Path | None = None
    # Images may lie outside the data set's folder (`data.allow_outside_paths`): manifest rows naming such files,
    # links leading out of any layout's folder.
    allow_outside: bool = False
    # Where the scan of a manifest or data set folder is remembered (`cache.dir/manifests`); None: nowhere.
    index_dir: Path | None = None
    # The sample fields read beside the target (`qie.data.fields`): a run's, `with_defaults(run_fields(...))`.
    fields: tuple[SampleField, ...] = DEFAULT_FIELDS


def detect_format(path: str | Path) -> str:
    """ "folder", "manifest" or "hf" for `path`.

    A folder with training_images/ or control_images/ (or images/ and layers/, a layered data set) is the
    folder layout; a .jsonl/.json/.csv file a manifest; a `save_to_disk` folder, a .parquet/.arrow file, a glob,
    or any other folder a Hugging Face data set (`datasets.load_dataset` finds parquet, csv or image files in it).

    Raises:
        DataError: the path does not exist, or is a file of another kind.
    """
    text = str(path)
    if any(c in text for c in GLOB_CHARACTERS) and not Path(text).expanduser().exists():
        return "hf"
    root = Path(text).expanduser()
    if not root.exists():
        raise DataError(
            f"data.path {text!r} does not exist: point data.path at a data set folder, a .jsonl/.csv manifest "
            "or a Hugging Face data set (save_to_disk folder, parquet files)"
        )
    if root.is_dir():
        if (root / "training_images").is_dir() or (root / "control_images").is_dir():
            return "folder"
        if (root / "images").is_dir() and (root / "layers").is_dir():
            return "folder"
        return "hf"
    suffix = root.suffix.lower()
    if suffix in MANIFEST_SUFFIXES:
        return "manifest"
    if suffix in HF_FILE_SUFFIXES:
        return "hf"
    raise DataError(
        f"data.path {text!r} is a {suffix or 'suffix-less'} file: use a data set folder, a .jsonl/.csv manifest, "
        "or .parquet files of a Hugging Face data set"
    )


def read_dataset(source: DataSource, require_target: bool = True, require_prompt: bool = True) -> Dataset:
    """The samples (and problems) of any kind of data set; see `scan_dataset` and `qie.data.hf.scan_hf`.

    Raises:
        DataError: the path does not exist, is no data set, or holds no usable sample.
    """
    format = detect_format(source.path) if source.format == "auto" else source.format
    if format != "hf":
        return without_long_prompts(
            scan_dataset(
                source.path,
                format=format,
                require_target=require_target,
                allow_outside=source.allow_outside,
                require_prompt=require_prompt,
                index_dir=source.index_dir,
                fields=source.fields,
            )
        )
    if source.images_dir is None:
        raise ValueError("a Hugging Face data set needs DataSource.images_dir for its in-data-set images")
    images = ImageFolder(source.images_dir, source.allow_outside)
    return without_long_prompts(
        scan_hf(
            source.path,
            split=source.split,
            columns=source.columns,
            images=images,
            require_target=require_target,
            require_prompt=require_prompt,
            fields=source.fields,
        )
    )


def without_long_prompts(data: Dataset) -> Dataset:
    """`data` with the samples whose prompt is too long to encode (`prompt_problem`) turned into problems."""
    if max(map(len, map(attrgetter("prompt"), data.samples)), default=0) <= MAX_PROMPT_CHARS:
        return data  # none too long (the usual case, looked at without a call per sample)
    long = {s.id: why for s in data.samples if (why := prompt_problem(s.prompt))}
    kept = [s for s in data.samples if s.id not in long]
    problems = [
        DataProblem(s.id, str(s.target or (s.controls or ("",))[0]), long[s.id]) for s in data.samples if s.id in long
    ]
    if not kept:
        raise DataError(f"no usable sample: the first, {problems[0].id!r}: {problems[0].reason}")
    return Dataset(kept, data.problems + problems)
