"""What the remembered scans share (`qie.data.manifest_index`, `qie.data.folder_index`): a data set's samples and
problems kept as columns in a safetensors file, written atomically and read back without per-sample parsing.

Ids and prompts are UTF-8 blobs (texts joined by NUL); each image is a row number in the index's own table of
names (-1: none), controls and layers flat lists with offsets; the problems, usually few, JSON in the metadata.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from qie.data.samples import DataProblem, Sample, child_path

log = logging.getLogger(__name__)

# Problems are kept in the file's metadata: a data set with more is scanned each time.
MAX_PROBLEMS = 10_000

T = TypeVar("T")


def index_path(folder: str | os.PathLike, source: Path, settings: str) -> Path:
    """Where the index of `source` (a manifest or a data set folder) scanned with `settings` lives in `folder`:
    named by a digest of the source's absolute path and the settings."""
    text = f"{os.path.abspath(source)}\0{settings}".encode("utf-8", "surrogatepass")
    return Path(folder) / f"{hashlib.blake2b(text, digest_size=12).hexdigest()}.safetensors"


def blob(texts: list[str]):
    """`texts` as one UTF-8 array, joined by NUL (names that are not UTF-8 kept through their surrogates).

    Raises:
        ValueError: a text holds a NUL itself (it could not be split back).
    """
    import numpy as np

    joined = "\0".join(texts)
    if texts and joined.count("\0") != len(texts) - 1:
        raise ValueError("a text holds a NUL character")
    return np.frombuffer(joined.encode("utf-8", "surrogatepass"), dtype=np.uint8)


def texts(array, count: int) -> list[str]:
    """The `count` texts of a `blob`.

    Raises:
        ValueError: the blob holds another number of texts.
    """
    found = array.tobytes().decode("utf-8", "surrogatepass").split("\0") if count else []
    if len(found) != count:
        raise ValueError("text column has the wrong count")
    return found


def sample_columns(samples: list[Sample], number: Callable[[Path], int]) -> dict:
    """`samples`, in their order, as the index's columns; `number(path)` gives an image's row in the caller's
    table of names.

    Raises:
        ValueError: an id or prompt holds a NUL character.
    """
    import numpy as np

    def one(path: Path | None) -> int:
        return number(path) if path is not None else -1

    def column(lists: list[list[int]]) -> tuple:
        offsets = np.zeros(len(lists) + 1, dtype=np.int64)
        np.cumsum([len(x) for x in lists], out=offsets[1:])
        return offsets, np.array([i for x in lists for i in x], dtype=np.int64)

    control_offsets, controls = column([[number(p) for p in s.controls] for s in samples])
    layer_offsets, layers = column([[number(p) for p in s.layers] for s in samples])
    names = list(dict.fromkeys(name for s in samples for name, _ in s.field_images))  # in the order they come
    if any([n for n, _ in s.field_images] != [n for n in names if n in dict(s.field_images)] for s in samples):
        raise ValueError("samples name their fields in different orders")
    fields = {f"field:{n}": np.array([one(dict(s.field_images).get(n)) for s in samples], np.int64) for n in names}
    return {
        "ids": blob([s.id for s in samples]),
        "prompts": blob([s.prompt for s in samples]),
        "target": np.array([one(s.target) for s in samples], np.int64),
        "mask": np.array([one(s.mask) for s in samples], np.int64),
        "field_names": blob(names),
        "field_count": np.array([len(names)], np.int64),
        **fields,
        "control_offsets": control_offsets,
        "controls": controls,
        "layer_offsets": layer_offsets,
        "layers": layers,
    }


def columns_samples(arrays: dict, count: int, paths: list[Path]) -> list[Sample]:
    """The `count` samples of `sample_columns`' columns, each image the path of its row in `paths` (samples
    naming the same image share its path object).

    Raises:
        ValueError: the columns differ in length (a damaged index).
    """
    ids, prompts = texts(arrays["ids"], count), texts(arrays["prompts"], count)
    target, mask = arrays["target"].tolist(), arrays["mask"].tolist()
    names = texts(arrays["field_names"], int(arrays["field_count"][0]))
    by_field = [arrays[f"field:{n}"].tolist() for n in names]
    control_offsets, controls = arrays["control_offsets"].tolist(), arrays["controls"].tolist()
    layer_offsets, layers = arrays["layer_offsets"].tolist(), arrays["layers"].tolist()
    if not (len(target) == len(mask) == count == len(control_offsets) - 1 == len(layer_offsets) - 1) or any(
        len(c) != count for c in by_field
    ):
        raise ValueError("columns differ in length")
    none, empty = [None] * count, ()
    targets, masks = (
        [paths[j] if j >= 0 else None for j in column] if any(j >= 0 for j in column) else none
        for column in (target, mask)
    )
    extras = [empty] * count
    if by_field:
        extras = [tuple((n, paths[c[i]]) for n, c in zip(names, by_field) if c[i] >= 0) for i in range(count)]
    return [
        sample(*fields)
        for fields in zip(
            ids,
            targets,
            _tuples(paths, controls, control_offsets, count),
            prompts,
            masks,
            _tuples(paths, layers, layer_offsets, count) if layers else [empty] * count,
            extras,
        )
    ]


def _tuples(paths: list[Path], column: list[int], offsets: list[int], count: int) -> list[tuple[Path, ...]]:
    """Per sample, the tuple of its paths in a column; samples naming the same single path share one tuple."""
    if len(column) == count and offsets == list(range(count + 1)):  # one path each (one control image)
        singles: dict[int, tuple[Path, ...]] = {}
        return [singles.get(j) or singles.setdefault(j, (paths[j],)) for j in column]
    named = [paths[j] for j in column]
    return [tuple(named[offsets[i] : offsets[i + 1]]) for i in range(count)]


def sample(id, target, controls, prompt, mask, layers, field_images) -> Sample:  # noqa: A002 (Sample's own names)
    """`Sample(...)` without the frozen dataclass's seven guarded assignments (a second per million samples)."""
    s = object.__new__(Sample)
    s.__dict__.update(
        id=id, target=target, controls=controls, prompt=prompt, mask=mask, layers=layers, field_images=field_images
    )
    return s


def paths(folder: Path, names: list[str]) -> list[Path]:
    """`folder / name` for each name; plain relative names (no `.` or empty component) through pathlib's
    child constructor of their folder, built once per folder (what `qie.data.samples` uses for listings)."""
    makers: dict[str, object] = {}
    out = []
    text = "\0/" + "\0/".join(names) + "\0/"  # each name between "\0/" and "\0": one look for all of them
    plain = not any(bad in text for bad in ("//", "/.", "/\0"))
    for name in names:
        head, _, base = name.rpartition("/")
        if not plain and (name.startswith("/") or "//" in name or "/." in f"/{name}" or not base):
            out.append(folder / name)
            continue
        make = makers.get(head)
        if make is None:
            make = makers[head] = child_path(folder / head if head else folder)
        out.append(make(base))
    return out


def save(path: Path, tensors: dict, meta: dict[str, str], problems: list[DataProblem], what: str) -> None:
    """Write an index: `tensors`, and `meta` with the problems added; through a temporary file, so a reader
    sees the old index or the new one. Nothing is written for more than MAX_PROBLEMS problems (the scan is
    then done each time). A failure is logged, not raised: the index only saves time."""
    from safetensors.numpy import save_file

    if len(problems) > MAX_PROBLEMS:
        return
    meta = {**meta, "problems": json.dumps([[p.id, p.path, p.reason] for p in problems])}
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(tmp), metadata=meta)
        os.replace(tmp, path)
    except OSError as e:
        log.warning("could not save the %s %s (%s)", what, path, e)
        tmp.unlink(missing_ok=True)


def load(path: Path, expect: dict[str, str], what: str, decode: Callable[[dict[str, str], dict], T | None]) -> T | None:
    """`decode(metadata, arrays)` of the index at `path` when its metadata holds each of `expect` (its format,
    the settings, the source's signature); None when there is no such index, or `decode` finds it out of date.
    An index that cannot be read or decoded (damaged) is logged and ignored: the caller scans again.
    """
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="numpy") as f:
            meta = f.metadata() or {}
            if any(meta.get(key) != value for key, value in expect.items()):
                return None
            arrays = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is no mapping)
        return decode(meta, arrays)
    except FileNotFoundError:
        return None
    except Exception as e:  # safetensors raises its own error types for a damaged file
        log.warning("%s %s is unreadable (%s); scanning again", what, path, e)
        return None


def read_problems(meta: dict[str, str]) -> list[DataProblem]:
    """The problems `save` kept in the metadata."""
    return [DataProblem(*p) for p in json.loads(meta["problems"])]
