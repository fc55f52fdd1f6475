"""Hugging Face data sets as samples: `save_to_disk` folders, parquet files (or a glob), `imagefolder` folders.

Image columns may hold encoded images (the `Image` feature's bytes), file paths, or lists of either.
Images stored inside the data set are written once to a content-addressed folder
(`images_dir/<sha256[:2]>/<sha256>.<ext>`), so every later step (cache keys, image sizes, encoding) reads
files as for the other layouts, and a cache key still hashes exactly the image's bytes: the same picture as
a file in a folder data set and as bytes in a parquet file has the same key. Images that are files already
(an `imagefolder`) are used where they are. Needs the `datasets` library (`pip install "qie[hf]"`).
"""

from __future__ import annotations

import hashlib
import os
import secrets
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qie.data.confine import FIX, Confinement
from qie.data.fields import DEFAULT_FIELDS, REJECTED, SampleField
from qie.data.samples import NO_CAPTION_FIX, DataProblem, Dataset, Sample
from qie.errors import ConfigError, DataError

GLOB_CHARACTERS = "*?["
ROWS_PER_READ = 256  # rows read per slice: bounds the image bytes held in memory at once
_MAGIC = (
    (b"\x89PNG", ".png"),
    (b"\xff\xd8", ".jpg"),
    (b"GIF8", ".gif"),
    (b"BM", ".bmp"),
    (b"II*\x00", ".tif"),
    (b"MM\x00*", ".tif"),
)


@dataclass(frozen=True, kw_only=True)
class Columns:
    """Column names of a Hugging Face data set (`data.columns`)."""

    target: str | None = "target"
    controls: tuple[str, ...] = ("controls",)
    prompt: str = "prompt"
    id: str | None = None
    mask: str | None = None  # a column of loss mask images
    layers: str | None = None  # a column holding each row's layers (a list of images), for a layered model
    # A column of preference pairs' rejected results (`train/objective=dpo`); None: the column `rejected`, if any.
    rejected: str | None = None

    def field_column(self, f: SampleField, present: Iterable[str]) -> str | None:
        """The column of the sample field `f`'s images: the one named in `data.columns` (for `rejected`), else the
        column named like the field when the data set has one (`present`), else None."""
        named = self.rejected if f is REJECTED else None
        return named or (f.name if f.name in present else None)


def is_hf_save_folder(path: Path) -> bool:
    """A folder written by `Dataset.save_to_disk` or `DatasetDict.save_to_disk`."""
    return (path / "dataset_dict.json").is_file() or (
        (path / "state.json").is_file() and (path / "dataset_info.json").is_file()
    )


def load_hf(path: str, split: str) -> Any:
    """The `split` of the Hugging Face data set at `path`, as a `datasets.Dataset`.

    Raises:
        ConfigError: `datasets` is not installed; DataError: the data set cannot be read or has no such split.
    """
    try:
        import datasets
    except ImportError:
        raise ConfigError(
            f"data.path {path!r} is read as a Hugging Face data set, which needs the datasets library: "
            'pip install "qie[hf]" (a qie folder data set holds training_images/ and control_images/)'
        ) from None
    from qie.progress import quiet_library_bars

    quiet_library_bars()
    root = Path(path).expanduser()
    check_parquet_files(root)
    try:
        if root.is_dir() and is_hf_save_folder(root):
            data = datasets.load_from_disk(str(root))
        elif root.is_dir():
            data = datasets.load_dataset(str(root))
        else:
            builder = "arrow" if root.suffix.lower() == ".arrow" else "parquet"
            data = datasets.load_dataset(builder, data_files=str(root))
    except Exception as e:  # datasets raises many types for "not a data set"; the message says which
        raise DataError(
            f"cannot read {path!r} as a Hugging Face data set ({_root_cause(e)}); "
            "data.path takes a qie folder (training_images/, control_images/), a .jsonl/.csv manifest, a "
            "save_to_disk folder, parquet files or a glob of them, or an imagefolder folder."
        ) from None
    if isinstance(data, datasets.DatasetDict):
        if split not in data:
            if len(data) != 1:
                raise DataError(f"{path!r} has no split {split!r}: set data.split to one of {sorted(data)}")
            split = next(iter(data))
        data = data[split]
    return data


def check_parquet_files(root: Path) -> None:
    """Read the footer of each parquet file `root` names (a file, a glob, or a folder holding them).

    Raises:
        DataError: naming the first damaged file (datasets' own error names none of them).
    """
    if root.is_dir():
        files = sorted(root.rglob("*.parquet"))
    elif any(c in str(root) for c in GLOB_CHARACTERS):
        files = sorted(Path(root.anchor or ".").glob(str(root.relative_to(root.anchor)) if root.anchor else str(root)))
    else:
        files = [root] if root.suffix.lower() == ".parquet" else []
    if not files:
        return
    import pyarrow.parquet as pq

    for file in files:
        try:
            pq.read_metadata(str(file))
        except Exception as e:  # pyarrow's ArrowInvalid, OSError, ...
            raise DataError(
                f"parquet file {str(file)!r} of data set {str(root)!r} is damaged ({type(e).__name__}: "
                f"{' '.join(str(e).split())}): download it again, or remove it from the data set"
            ) from None


def _root_cause(e: BaseException) -> str:
    """`Type: message` of the innermost cause of `e`, on one line."""
    while (e.__cause__ or e.__context__) is not None:
        e = e.__cause__ or e.__context__
    return f"{type(e).__name__}: {' '.join(str(e).split())}"


def scan_hf(
    path: str,
    split: str,
    columns: Columns,
    images: ImageFolder,
    require_target: bool = True,
    require_prompt: bool = True,
    fields: tuple[SampleField, ...] = DEFAULT_FIELDS,
) -> Dataset:
    """The samples of a Hugging Face data set, in a stable order (by id); rows that cannot be used are problems.
    The images of each of `fields` are read from its column (`Columns.field_column`).
    Without `require_prompt`, a row with no prompt (or no prompt column) has the prompt "". `images` writes the
    images stored in the data set and checks those it names as files.

    Raises:
        DataError: a column that is not there, or no usable row; ConfigError: no `datasets` library.
    """
    data = load_hf(path, split)
    optional = ([] if require_target else [columns.target]) + ([] if require_prompt else [columns.prompt])
    names, extra = _read_columns(path, data.column_names, columns, fields, optional)
    base = _base_folder(path)
    out = Dataset()
    seen: set[str] = set()
    for n, row in _rows(data, [c for c in names if c in data.column_names]):
        sample_id = str(row[columns.id]) if columns.id else f"row{n:06d}"
        if sample_id in seen:
            sample_id = f"{sample_id}#{n}"
        seen.add(sample_id)
        try:
            target = row.get(columns.target) if columns.target else None
            target_path = images.path(target, base) if target is not None else None
            controls = [images.path(v, base) for c in columns.controls for v in _as_list(row[c])]
            mask = row.get(columns.mask) if columns.mask else None
            mask_path = images.path(mask, base) if mask is not None else None
            layers = [images.path(v, base) for v in _as_list(row[columns.layers])] if columns.layers else []
            field_images = tuple((name, images.path(row[c], base)) for name, c in extra if row.get(c) is not None)
        except DataError as e:
            out.problems.append(DataProblem(sample_id, f"{path} row {n}", str(e)))
            continue
        prompt = row.get(columns.prompt)
        if prompt is None and not require_prompt:
            prompt = ""
        why = (
            "has no control image"
            if not controls
            else f"has no layers in column {columns.layers!r}"
            if columns.layers and not layers
            else "has no target image"
            if require_target and target_path is None
            else f"has no prompt text: {NO_CAPTION_FIX}"
            if prompt is None
            else f"has no prompt text (got {prompt!r})"
            if not isinstance(prompt, str)
            else f"has an empty prompt: {NO_CAPTION_FIX}"
            if require_prompt and not prompt.strip()
            else None
        )
        if why:
            out.problems.append(DataProblem(sample_id, f"{path} row {n}", f"row {n} {why}"))
            continue
        out.samples.append(
            Sample(
                id=sample_id,
                target=target_path,
                controls=tuple(controls),
                prompt=prompt.strip(),
                mask=mask_path,
                layers=tuple(layers),
                field_images=field_images,
            )
        )
    if not out.samples:
        detail = "".join(f"\n  {p.path}: {p.reason}" for p in out.problems[:5]) or "\n  it has no rows"
        raise DataError(f"no usable sample in {path!r}{detail}")
    out.samples.sort(key=lambda s: s.id)
    out.problems.sort(key=lambda p: p.id)
    return out


def _read_columns(
    path: str, present: list[str], columns: Columns, fields: tuple[SampleField, ...], optional: list[str | None]
) -> tuple[list[str], list[tuple[str, str]]]:
    """The columns a scan reads of a data set with the columns `present`, and the (field name, column) of each of
    `fields` it has.

    Raises:
        DataError: a named column that is not there and not `optional`.
    """
    extra = [(f.name, c) for f in fields if (c := columns.field_column(f, present))]
    named = (columns.target, *columns.controls, columns.prompt, columns.id, columns.mask, columns.layers)
    names = [c for c in (*named, *(c for _, c in extra)) if c]
    missing = [c for c in names if c not in present]
    if any(c not in optional for c in missing):
        raise DataError(
            f"{path!r} has no column {missing[0]!r} (columns: {', '.join(present)}): set "
            "data.columns.target, data.columns.controls (a list) and data.columns.prompt to its columns"
        )
    return names, extra


def _rows(data: Any, names: list[str]) -> Iterator[tuple[int, dict]]:
    """(row number, {column: value}) with images undecoded (dicts of bytes and path), a slice at a time."""
    table = data.with_format("arrow")
    for start in range(0, len(data), ROWS_PER_READ):
        chunk = table[start : start + ROWS_PER_READ].select(names).to_pydict()
        for i in range(len(chunk[names[0]]) if names else 0):
            yield start + i, {name: chunk[name][i] for name in names}


def _as_list(value: Any) -> list:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _base_folder(path: str) -> Path:
    """The folder relative image paths in the data set start from: the data set folder, the file's folder,
    or a glob's part before its first wildcard."""
    root = Path(path).expanduser()
    if root.is_dir():
        return root
    if root.exists():
        return root.parent
    fixed = []
    for part in root.parts:
        if any(c in part for c in GLOB_CHARACTERS):
            break
        fixed.append(part)
    return Path(*fixed) if fixed else Path(".")


class ImageFolder:
    """Writes image bytes to `root/<sha256[:2]>/<sha256><ext>` (once) and names image files that exist, inside
    the data set's folder (symbolic links followed) unless `allow_outside` (`data.allow_outside_paths`)."""

    def __init__(self, root: Path, allow_outside: bool = False) -> None:
        self.root = Path(root)
        self.allow_outside = allow_outside
        self.confines: dict[Path, Confinement] = {}

    def path(self, value: Any, base: Path) -> Path:
        """The file holding the image `value`: a dict with "bytes" and/or "path", bytes, or a path string.

        Raises:
            DataError: an empty value, or a path that is not a file.
        """
        if isinstance(value, dict):
            data, where = value.get("bytes"), value.get("path")
        elif isinstance(value, (bytes, bytearray)):
            data, where = bytes(value), None
        else:
            data, where = None, value
        if data:
            return self.write(bytes(data), Path(where).suffix.lower() if where else "")
        if not where or not isinstance(where, str):
            raise DataError(f"an image value is empty ({value!r:.80}): expected image bytes or a file path")
        file = Path(where).expanduser()
        file = file if file.is_absolute() else base / file
        if not file.is_file():
            raise DataError(f"image {str(file)!r} does not exist")
        if not self.allow_outside:
            confine = self.confines.get(base) or self.confines.setdefault(base, Confinement(base))
            if (where := confine.leads_out(file)) is not None:
                link = f" (a link to {where!r})" if where != os.path.abspath(file) else ""
                raise DataError(f"image {str(file)!r}{link} lies outside the data set's folder {str(base)!r}: {FIX}")
        return file

    def write(self, data: bytes, suffix: str = "") -> Path:
        digest = hashlib.sha256(data).hexdigest()
        suffix = suffix or next((ext for magic, ext in _MAGIC if data.startswith(magic)), "")
        if not suffix and data[:4] == b"RIFF" and data[8:12] == b"WEBP":
            suffix = ".webp"
        out = self.root / digest[:2] / f"{digest}{suffix}"
        if out.is_file() and out.stat().st_size == len(data):
            return out
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f".{out.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        try:
            tmp.write_bytes(data)
            os.replace(tmp, out)  # atomic: processes writing the same image race harmlessly
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return out
