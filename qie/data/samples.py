"""Samples of a data set: a target image, its control images (none for text to image) and the prompt.

Two layouts: a folder (`training_images/<stem>.<ext>` + `<stem>.txt`, `control_images/<stem>.<ext>` and
`control_images/<stem>_control_<N>.<ext>`, optionally a loss mask `masks/<stem>.<ext>`; without
`control_images/` every sample has no control image; the images of the sample fields read (`qie.data.fields`)
`training_images/<stem>_<field>.<ext>`, a preference pair's rejected result also `rejected_images/<stem>.<ext>`;
for a layered model `images/<stem>.<ext>` + `<stem>.txt`
and its ordered layers `layers/<stem>_<N>.<ext>`) or a manifest (.jsonl or .csv with `target`, `controls`,
`prompt`, optionally `mask` and a key per sample field read, e.g. `rejected`; paths relative to the
manifest; a row without `controls` has
none). Whether a model takes a sample's control count is the model's to say (`ModelSpec.control_problem`). Problems with
single samples are collected, not raised, so precompute can name them and go on; a data set with no usable
sample at all is an error.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from qie.data.confine import FIX, Confinement
from qie.data.fields import DEFAULT_FIELDS, FIELD_FOLDERS, SampleField
from qie.errors import DataError

# Every folder of either layout that holds images, relative to the data set folder.
FOLDERS = ("training_images", "control_images", "masks", *FIELD_FOLDERS, "images", "layers")
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".tif", ".tiff")
_CONTROL_SUFFIX = re.compile(r"^(?P<stem>.+)_control_(?P<n>\d+)$")


@dataclass(frozen=True, kw_only=True)
class Sample:
    """One training or inference example. `target` is None for inference-only rows; `controls` is empty for
    a text-to-image sample (or an edit sample trained on the text-only prompt)."""

    id: str
    target: Path | None
    controls: tuple[Path, ...]
    prompt: str
    # A loss mask image (white: trained, black: `train.mask.outside_weight`); None: every pixel trained.
    mask: Path | None = None
    # A target of several frames (a layered model's): the frames after `target`, in order (its layers).
    layers: tuple[Path, ...] = ()
    # The images of its sample fields (`qie.data.fields`), as (field name, path) pairs in the order the fields were
    # read: a preference pair's rejected result (`train/objective=dpo`) is ("rejected", path).
    field_images: tuple[tuple[str, Path], ...] = ()

    @property
    def fields(self) -> Mapping[str, Path]:
        """The images of its sample fields by the field's name."""
        return dict(self.field_images)


# Longer prompts are refused: the pipelines keep at most ~1,024 prompt tokens (~4,000 characters of English)
# of the encoding, and the text encoder's attention over ~40,000 tokens would exhaust the memory first.
MAX_PROMPT_CHARS = 20_000


# What to do about a sample without a caption: the training stages need a prompt for every sample (an empty one
# would train the sample as caption dropout does, on every step; `data.caption_dropout_rate` is the deliberate way).
NO_CAPTION_FIX = "write one, caption the data set with `python -m qie.caption`, or set data.auto_caption=true"


def prompt_problem(prompt: str) -> str | None:
    """Why `prompt` cannot be encoded (too long), or None."""
    if len(prompt) > MAX_PROMPT_CHARS:
        return (
            f"the prompt is {len(prompt):,} characters, more than the {MAX_PROMPT_CHARS:,} a prompt may have "
            "(the model reads ~1,024 tokens of it): shorten it"
        )
    return None


@dataclass(frozen=True)
class DataProblem:
    """A sample that cannot be used: the file at fault and why."""

    id: str
    path: str
    reason: str


@dataclass
class Dataset:
    samples: list[Sample] = field(default_factory=list)
    problems: list[DataProblem] = field(default_factory=list)


def read_caption(path: Path | str) -> str:
    """The caption text of `path`, stripped (read as `Path.read_text(encoding="utf-8")` would: newlines
    of any convention become "\n").

    Raises:
        DataError: missing file or not UTF-8.
    """
    try:
        # Bytes then decode: a third of the cost of a text-mode read, which counts with 100k captions.
        with open(path, "rb") as f:
            text = f.read().decode("utf-8")
    except FileNotFoundError:
        raise DataError(f"caption {str(path)!r} is missing: {NO_CAPTION_FIX} (a UTF-8 .txt beside the image)") from None
    except UnicodeDecodeError as e:
        raise DataError(
            f"caption {str(path)!r} is not UTF-8 ({e.reason} at byte {e.start}): re-save it as UTF-8"
        ) from None
    if "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    return text.strip()


class CaptionFiles:
    """How a folder scan looks at caption files: reads them, and tests whether one is a file. The folder
    index's kind also notes what it saw of each, to know later whether it changed (`qie.data.folder_index`)."""

    def read(self, path: Path | str) -> str:
        """`read_caption(path)`."""
        return read_caption(path)

    def is_file(self, path: Path) -> bool:
        return path.is_file()


def _listing(folder: Path, links: set[str]) -> list[str]:
    """Names in `folder`, sorted (as strings: sorting Path objects costs seconds at 100k files); the paths of
    those that are symbolic links are added to `links` (the listing says so without a stat)."""
    try:
        with os.scandir(folder) as it:
            names = []
            for e in it:
                names.append(e.name)
                if e.is_symlink():
                    links.add(f"{folder}/{e.name}")
            return sorted(names)
    except (FileNotFoundError, NotADirectoryError):
        return []


def _split_suffix(name: str) -> tuple[str, str]:
    """(stem, suffix) of a file name, as pathlib's `Path.stem` / `Path.suffix` give them."""
    i = name.rfind(".")
    return (name[:i], name[i:]) if 0 < i < len(name) - 1 else (name, "")


def _images_by_stem(folder: Path, names: list[str]) -> dict[str, Path]:
    """Image files among `names` (the sorted listing of `folder`) by stem; a later name wins a stem."""
    child = child_path(folder)
    images = {}
    for name in names:
        stem, suffix = _split_suffix(name)
        if suffix.lower() in IMAGE_EXTENSIONS and not name.startswith("."):  # ._x.png: macOS metadata
            images[stem] = child(name)
    return images


def child_path(folder: Path):
    """A function name -> `folder / name` for a plain file name. pathlib's own child constructor (what
    `iterdir` uses) skips parsing the name and is 3x faster than `/`; it is private, so it is used only
    where it gives exactly what `/` gives."""
    fast = getattr(type(folder), "_make_child_relpath", None)
    if fast is not None:
        try:
            if fast(folder, "x.png") == folder / "x.png" and str(fast(folder, "x.png")) == str(folder / "x.png"):
                return _with_text(lambda name: fast(folder, name), str(folder))
        except Exception:
            pass
    return folder.joinpath


def _with_text(child, folder: str):
    """`child`, also filling in the path's text where pathlib keeps it (`_str`): pathlib formats it on first
    use at ~5 us a path, a second per 100k samples when the start-up check stats every image. Used only where
    the text is exactly what pathlib would format."""
    probe = child("x.png")
    try:
        probe._str = f"{folder}/x.png"
        ok = str(child("x.png")) == probe._str == f"{folder}/x.png" and str(probe) == probe._str
    except (AttributeError, TypeError):
        ok = False
    if not ok or folder.endswith("/"):
        return child

    def make(name: str):
        p = child(name)
        p._str = f"{folder}/{name}"
        return p

    return make


_LAYER_SUFFIX = re.compile(r"^(?P<stem>.+)_(?P<n>\d+)$")


def _scan_layered_folder(root: Path, require_prompt: bool, captions: CaptionFiles, links: set[str]) -> Dataset:
    """`images/<stem>.<ext>` (+ `<stem>.txt`) and its layers `layers/<stem>_<N>.<ext>` in the order of N: the
    image is the control and the composite frame of the target, the layers follow (see `scan_manifest`)."""
    images_dir, layers_dir = root / "images", root / "layers"
    images = _images_by_stem(images_dir, _listing(images_dir, links))
    layers: dict[str, list[tuple[int, Path]]] = {}
    for stem, p in _images_by_stem(layers_dir, _listing(layers_dir, links)).items():
        m = _LAYER_SUFFIX.match(stem)
        if m:
            layers.setdefault(m["stem"], []).append((int(m["n"]), p))
    data = Dataset()
    for stem in sorted(set(layers) - set(images)):
        data.problems.append(DataProblem(stem, str(images_dir / f"{stem}.<ext>"), "image is missing (layers found)"))
    for stem, image in sorted(images.items()):
        if stem not in layers:
            data.problems.append(DataProblem(stem, str(layers_dir / f"{stem}_0.<ext>"), "its layers are missing"))
            continue
        caption = images_dir / f"{stem}.txt"
        try:
            prompt = captions.read(caption) if require_prompt or captions.is_file(caption) else ""
            if require_prompt and not prompt:
                raise DataError(f"caption {str(caption)!r} is empty: {NO_CAPTION_FIX}")
        except DataError as e:
            data.problems.append(DataProblem(stem, str(caption), str(e)))
            continue
        numbers = sorted(layers[stem])
        if [n for n, _ in numbers] != list(range(len(numbers))):  # a layer missing, or one numbered twice
            found = ", ".join(str(n) for n, _ in numbers)
            data.problems.append(
                DataProblem(
                    stem,
                    str(numbers[0][1]),
                    f"its layers are numbered {found}: number them 0 to {len(numbers) - 1} with none missing",
                )
            )
            continue
        ordered = tuple(p for _, p in numbers)
        data.samples.append(Sample(id=stem, target=image, controls=(image,), prompt=prompt, mask=None, layers=ordered))
    return data


def read_folder(
    root: Path,
    require_target: bool,
    require_prompt: bool = True,
    captions: CaptionFiles | None = None,
    allow_outside: bool = False,
    fields: tuple[SampleField, ...] = DEFAULT_FIELDS,
) -> Dataset:
    """`qie.data.scan.scan_folder` from the folders' listings and the captions (`captions` reads them), remembering
    nothing; the images of `fields` are read too (`qie.data.fields`)."""
    links: set[str] = set()
    if (root / "layers").is_dir() and (root / "images").is_dir():
        data = _scan_layered_folder(root, require_prompt, captions or CaptionFiles(), links)
    else:
        data = _scan_edit_folder(root, require_target, require_prompt, captions or CaptionFiles(), links, fields)
    return data if allow_outside else confined(root, data, links)


def confined(root: Path, data: Dataset, links: set[str]) -> Dataset:
    """`data` with each sample that has an image leading outside `root` (in a linked folder that leads out, or
    one of `links`, the paths that are symbolic links, leading out) made a problem of its own."""
    confine = Confinement(root)
    folders_out = any(confine.folder_leads_out(root / name) for name in FOLDERS)
    if not folders_out and not links:
        return data  # nothing can lead out: no sample looked at
    kept = []
    for sample in data.samples:
        found = None
        for path in (sample.target, *sample.controls, sample.mask, *sample.layers, *dict(sample.field_images).values()):
            if path is not None and (folders_out or str(path) in links) and (where := confine.leads_out(path)):
                found = path
                break
        if found is None:
            kept.append(sample)
            continue
        why = f"image {str(found)!r} leads to {where!r} through a symbolic link, outside the data set folder"
        data.problems.append(DataProblem(sample.id, str(found), f"{why} {str(root)!r}: {FIX}"))
    return Dataset(kept, data.problems)


def _scan_edit_folder(
    root: Path,
    require_target: bool,
    require_prompt: bool,
    captions: CaptionFiles,
    links: set[str],
    fields: tuple[SampleField, ...] = (),
) -> Dataset:
    """The edit (and text-to-image) layout: training_images/, control_images/, masks/, and the images of `fields`
    (`<stem>_<field>` in training_images/, rejected_images/)."""
    targets_dir, controls_dir, masks_dir = root / "training_images", root / "control_images", root / "masks"
    if not targets_dir.is_dir() and not controls_dir.is_dir():
        raise DataError(
            f"{str(root)!r} is not a data set folder: expected training_images/ (and control_images/ for edits) inside"
        )
    # Without control_images/ the data set is text to image; with it, a target without a control is a mistake.
    controls_needed = controls_dir.is_dir()
    # One listing per folder gives the images and the captions: no stat per sample.
    target_names, control_names = _listing(targets_dir, links), _listing(controls_dir, links)
    target_set, control_set = set(target_names), set(control_names)
    targets_str, controls_str = str(targets_dir), str(controls_dir)
    listed = set() if require_prompt else target_set | control_set  # a sample without a caption has the prompt ""
    targets = _images_by_stem(targets_dir, target_names)
    by_field = _field_images(root, targets, fields, links)
    masks = _images_by_stem(masks_dir, _listing(masks_dir, links))  # optional: masks/<stem>.png
    controls: dict[str, list[tuple[int, Path]]] = {}
    for stem, p in _images_by_stem(controls_dir, control_names).items():
        m = _CONTROL_SUFFIX.match(stem)
        base, n = (m["stem"], int(m["n"])) if m else (stem, -1)
        controls.setdefault(base, []).append((n, p))
    data = Dataset()
    stems = sorted(set(targets) | set(controls)) if not require_target else sorted(targets)
    for stem in sorted(set(controls) - set(stems)):
        data.problems.append(
            DataProblem(stem, str(targets_dir / f"{stem}.<ext>"), "target image is missing (control image found)")
        )
    for name, images in by_field.items():
        for stem in sorted(set(images) - set(targets)):
            data.problems.append(
                DataProblem(stem, str(targets_dir / f"{stem}.<ext>"), f"target image is missing ({name} image found)")
            )
    for stem in stems:
        target = targets.get(stem)
        ctrl = tuple(p for _, p in sorted(controls.get(stem, [])))
        caption = f"{stem}.txt"
        caption_path = f"{targets_str}/{caption}"  # a string: 100k Path objects cost a second
        if caption not in target_set and caption in control_set:
            caption_path = f"{controls_str}/{caption}"
        if not ctrl and controls_needed:
            data.problems.append(DataProblem(stem, str(controls_dir / f"{stem}.<ext>"), "control image is missing"))
            continue
        try:
            prompt = captions.read(caption_path) if require_prompt or caption in listed else ""
            if require_prompt and not prompt:
                raise DataError(f"caption {caption_path!r} is empty: {NO_CAPTION_FIX}")
        except DataError as e:
            data.problems.append(DataProblem(stem, str(caption_path), str(e)))
            continue
        extra = tuple((name, images[stem]) for name, images in by_field.items() if stem in images) if by_field else ()
        data.samples.append(
            Sample(
                id=stem,
                target=target,
                controls=ctrl,
                prompt=prompt,
                mask=masks.get(stem),
                layers=(),
                field_images=extra,
            )
        )
    return data


def _field_images(
    root: Path, targets: dict[str, Path], fields: tuple[SampleField, ...], links: set[str]
) -> dict[str, dict[str, Path]]:
    """Each field's images by the stem of their sample: a field's folder (`rejected_images/<stem>`), then the files
    `<stem>_<field>` of training_images/ (taken out of `targets`, which they are not)."""
    out: dict[str, dict[str, Path]] = {}
    for f in fields:
        images = out[f.name] = {}
        if f.folder is not None:
            images.update(_images_by_stem(root / f.folder, _listing(root / f.folder, links)))
        for stem in [stem for stem in targets if stem.endswith(f.suffix) and len(stem) > len(f.suffix)]:
            images[stem[: -len(f.suffix)]] = targets.pop(stem)
    return out


def without_controls(sample: Sample, suffix: str = "") -> Sample:
    """`sample` without its control images: trained on the text-only prompt (reference dropout). Its entries
    are keyed by what they hold, so they are cached apart from the sample's own."""
    return replace(sample, id=sample.id + suffix, controls=())
