"""Manifests: a .jsonl or .csv file with `target`, `controls`, `prompt` per row (optionally `mask`, and a key
per sample field read, `qie.data.fields`: `rejected` for a preference pair), paths relative to the manifest's
folder (and inside it, unless
`data.allow_outside_paths`); a row without `controls` has none.
A layered row (`image`, `layers`, `prompt`: an image and its ordered layers) is the sample whose control is
the image and whose target is the image (the composite frame) followed by its layers.
A row that cannot be used is a problem of that row alone."""

from __future__ import annotations

import csv
import io
import json
import os
from pathlib import Path

from qie.data import index_file, manifest_index
from qie.data.confine import Confinement
from qie.data.fields import DEFAULT_FIELDS, SampleField
from qie.data.samples import NO_CAPTION_FIX, DataProblem, Dataset, Sample
from qie.errors import DataError


def _manifest_rows(path: Path) -> list[tuple[int, object]]:
    """(line or row number, parsed row) of a .jsonl or .csv manifest; a row that cannot be parsed is a
    string saying why, so it becomes a problem of that row alone."""
    if path.is_dir():
        raise DataError(f"{str(path)!r} is a folder: use data.format=folder (or auto) for the folder layout")
    suffix = path.suffix.lower()
    if suffix not in (".jsonl", ".json", ".csv"):
        raise DataError(f"manifest {str(path)!r}: use a .jsonl or .csv file, or a data set folder")
    try:
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as e:
        raise DataError(f"manifest {str(path)!r} is not UTF-8 ({e.reason} at byte {e.start}): re-save it") from None
    if suffix == ".csv":
        reader = csv.DictReader(io.StringIO(text, newline=""))
        return [(n, _csv_row(row)) for n, row in enumerate(reader, 2)]  # row 1 is the header
    rows: list[tuple[int, object]] = []
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                rows.append((n, json.loads(line)))
            except json.JSONDecodeError as e:
                rows.append((n, f"line {n} is not JSON ({e.msg})"))
    return rows


def _csv_row(row: dict) -> dict | str:
    """A CSV row with `controls` parsed: a JSON list, or paths separated by `|`."""
    raw = (row.get("controls") or "").strip()
    if raw.startswith("["):
        try:
            row["controls"] = json.loads(raw)
        except json.JSONDecodeError as e:
            return f"'controls' is not a JSON list ({e.msg})"
    else:
        row["controls"] = [c.strip() for c in raw.split("|") if c.strip()]
    return row


# (controls, target, prompt, mask, layers, the (field name, path) of each sample field the row gives)
RowFields = tuple[list[str], str | None, str | None, str | None, list[str], tuple[tuple[str, str], ...]]


def _row_fields(row: object, fields: tuple[SampleField, ...] = DEFAULT_FIELDS) -> RowFields | str:
    """(controls, target, prompt, mask, layers, field images) of a manifest row, or why the row is not usable."""
    if not isinstance(row, dict):
        return f"is a JSON {type(row).__name__}, expected an object with target, controls, prompt"
    if "layers" in row or "image" in row:
        return _layered_fields(row, fields)
    controls = row.get("controls")
    if controls is None:  # no control image: a text-to-image row, or an edit row for the text-only prompt
        controls = [row["control"]] if row.get("control") else []
    if isinstance(controls, str):
        controls = [controls] if controls else []
    if not isinstance(controls, list) or not all(isinstance(c, str) and c for c in controls):
        return f"'controls' must be a list of paths, got {controls!r}"
    target, prompt = row.get("target") or None, row.get("prompt")
    if target is not None and not isinstance(target, str):
        return f"'target' must be a path, got {target!r}"
    if prompt is not None and not isinstance(prompt, str):
        return f"'prompt' must be text, got {prompt!r}"
    mask, extra = row.get("mask") or None, tuple((f.name, row.get(f.name) or None) for f in fields)
    for key, path in (("mask", mask), *extra):
        if path is not None and not isinstance(path, str):
            return f"{key!r} must be a path, got {path!r}"
    return controls, target, prompt, mask, [], tuple((name, path) for name, path in extra if path is not None)


def _layered_fields(row: dict, fields: tuple[SampleField, ...]) -> RowFields | str:
    """A layered row: the image is the control and the composite frame of the target, the layers follow."""
    image, layers, prompt = row.get("image"), row.get("layers"), row.get("prompt")
    if not isinstance(image, str) or not image:
        return f"has 'layers' but no 'image' path (got {image!r}): a layered row is image, layers, prompt"
    if not isinstance(layers, list) or not layers or not all(isinstance(p, str) and p for p in layers):
        return f"'layers' must be a non-empty list of paths, got {layers!r}"
    if prompt is not None and not isinstance(prompt, str):
        return f"'prompt' must be text, got {prompt!r}"
    for f in fields:
        if row.get(f.name):
            return f"has {f.name!r} beside 'layers': a {f.called} of layered results is not read; drop one"
    return [image], image, prompt, None, layers, ()


def _outside(name: str) -> bool:
    """Whether the manifest path `name` leaves its folder as written (absolute, or climbing out with `..`)."""
    if os.path.isabs(name):
        return True
    return ".." in name and os.path.normpath(name).split(os.sep)[0] == ".."


class _Files:
    """The manifest's image paths, each joined to the manifest's folder and looked up once however many rows
    name it (several prompts on one image pair)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.paths: dict[str, Path] = {}
        self.present: dict[str, bool] = {}
        self.outside: dict[str, bool] = {}
        self.confine = Confinement(folder)
        self.linked: dict[str, str] = {}  # names inside as written, outside once links are followed: where they lead

    def path(self, name: str) -> Path:
        p = self.paths.get(name)
        if p is None:
            p = self.paths[name] = self.folder / name
        return p

    def is_file(self, name: str) -> bool:
        found = self.present.get(name)
        if found is None:
            found = self.present[name] = os.path.isfile(self.path(name))
        return found

    def is_outside(self, name: str) -> bool:
        """Whether `name` leaves the folder as written or once symbolic links are followed (a linked folder or
        file inside the data set pointing elsewhere): each folder is resolved once."""
        found = self.outside.get(name)
        if found is None:
            found = self.outside[name] = _outside(name) or not self._inside(name)
        return found

    def _inside(self, name: str) -> bool:
        where = self.confine.leads_out(self.path(name))
        if where is not None:
            self.linked[name] = f" (a link to {where!r})"
        return where is None


def scan_manifest(
    path: Path,
    require_target: bool,
    allow_outside: bool = False,
    require_prompt: bool = True,
    index_dir: str | os.PathLike | None = None,
    fields: tuple[SampleField, ...] = DEFAULT_FIELDS,
) -> Dataset:
    """The samples and problems of a .jsonl or .csv manifest (paths relative to its folder); without
    `require_prompt`, a row with no prompt has the prompt "". A row's key of each of `fields` names its image.

    Args:
        index_dir: where scans are remembered by the manifest's signature (`qie.data.manifest_index`); it is
            written only when its parent folder (the cache folder) exists. None: every scan parses the rows.
    """
    if index_dir is None:
        return _scan_rows(path, require_target, allow_outside, require_prompt, fields)[0]
    settings = json.dumps([str(path), require_target, allow_outside, require_prompt, [f.name for f in fields]])
    index = index_file.index_path(index_dir, path, settings)
    try:
        signature = manifest_index.manifest_signature(path)
    except OSError:
        signature = None
    if signature is not None and (found := manifest_index.load(index, signature, settings, path.parent)) is not None:
        return found
    data, files = _scan_rows(path, require_target, allow_outside, require_prompt, fields)
    try:
        unchanged = signature is not None and manifest_index.manifest_signature(path) == signature
    except OSError:
        unchanged = False
    if unchanged and index.parent.parent.is_dir():  # not while it was being written; only in a cache folder
        names = {id(p): name for name, p in files.paths.items()}
        manifest_index.save(index, signature, settings, data, files.present, names)
    return data


def _scan_rows(
    path: Path, require_target: bool, allow_outside: bool, require_prompt: bool, fields: tuple[SampleField, ...]
) -> tuple[Dataset, _Files]:
    data = Dataset()
    seen: set[str] = set()
    rows_seen: dict[tuple, int] = {}  # (target, controls, prompt) -> the row that first gave them
    files = _Files(path.parent)  # the folder computed once: pathlib's `parent` builds a new object per call
    for n, row in _manifest_rows(path):
        read = row if isinstance(row, str) else _row_fields(row, fields)
        if isinstance(read, str):
            rid = str(row.get("id") or f"row{n:06d}") if isinstance(row, dict) else f"row{n:06d}"
            data.problems.append(DataProblem(rid, f"{path}:{n}", f"manifest row {n} {read}"))
            continue
        controls, target, prompt, mask, layers, extra = read
        missing = [] if (prompt or "").strip() or not require_prompt else ["prompt"]
        if require_target and not target:
            missing.append("target")
        rid = str(row.get("id") or f"row{n:06d}")
        if missing:
            empty = "an empty" if missing[0] == "prompt" and prompt is not None else "no"
            fix = f": {NO_CAPTION_FIX}" if missing[0] == "prompt" else ""
            data.problems.append(DataProblem(rid, f"{path}:{n}", f"manifest row {n} has {empty} {missing[0]!r}{fix}"))
            continue
        named = [*controls, target, mask, *layers, *(p for _, p in extra)]
        outside = [] if allow_outside else [c for c in named if c and files.is_outside(c)]
        if outside:
            data.problems.append(
                DataProblem(
                    rid,
                    f"{path}:{n}",
                    f"manifest row {n}: {outside[0]!r}{files.linked.get(outside[0], '')} lies outside the manifest's "
                    f"folder {str(path.parent)!r}: move it inside, or set data.allow_outside_paths=true",
                )
            )
            continue
        bad = [files.path(c) for c in named if c and not files.is_file(c)]
        if bad:
            data.problems.append(
                DataProblem(rid, str(bad[0]), f"manifest row {n}: image {str(bad[0])!r} does not exist")
            )
            continue
        same = rows_seen.setdefault((target, tuple(controls), (prompt or "").strip(), mask, tuple(layers), extra), n)
        if same != n:  # the same example twice would be trained twice as often: keep the first
            data.problems.append(
                DataProblem(
                    rid, f"{path}:{n}", f"manifest row {n} repeats row {same} (same images and prompt): used once"
                )
            )
            continue
        first = target or (controls[0] if controls else None)
        sample_id = str(row.get("id") or (Path(first).with_suffix("").as_posix() if first else f"row{n:06d}"))
        if sample_id in seen:  # one target with several instructions: ids stay unique
            sample_id = f"{sample_id}#{n}"
        seen.add(sample_id)
        data.samples.append(
            Sample(
                id=sample_id,
                target=files.path(target) if target else None,
                controls=tuple(files.path(c) for c in controls),
                prompt=(prompt or "").strip(),
                mask=files.path(mask) if mask else None,
                layers=tuple(files.path(p) for p in layers),
                field_images=tuple((name, files.path(p)) for name, p in extra),
            )
        )
    return data, files
