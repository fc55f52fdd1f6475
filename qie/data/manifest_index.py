"""A manifest's scan remembered by the manifest file's signature, so a warm start parses no row.

Scanning a manifest of a million rows (JSON per row, checks per field, a path per image) takes tens of
seconds; its result depends only on the manifest's bytes, the scan's settings and which of the images it
names exist. The index keeps that result (samples and problems) with the manifest's (size, mtime_ns,
ctime_ns, inode) and, for every image path the rows name, whether it was a file. A later scan of the same
manifest with the same settings stats each named image once; when each is still a file exactly where one was,
the remembered result is the scan's result. Any change of the manifest (its ctime changes with every write,
and no tool can set it back) or of which images exist scans the rows again.

Kept as `<folder>/<digest of manifest path and settings>.safetensors` (numpy arrays and UTF-8 blobs; the
problems, usually few, as JSON in the file's metadata).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
from pathlib import Path

from qie.data.samples import DataProblem, Dataset, Sample, child_path

log = logging.getLogger(__name__)

FORMAT = "qie-manifest-index/2"
# Problems are kept in the file's metadata: a manifest with more is scanned each time.
MAX_PROBLEMS = 10_000


def manifest_signature(path: Path) -> str:
    """(size, mtime_ns, ctime_ns, inode) of the manifest file.

    Raises:
        OSError: it cannot be stat'ed.
    """
    st = os.stat(path)
    return f"{st.st_size} {st.st_mtime_ns} {st.st_ctime_ns} {st.st_ino}"


def index_path(folder: str | os.PathLike, manifest: Path, settings: str) -> Path:
    """Where the index of `manifest` scanned with `settings` lives in `folder`."""
    text = f"{os.path.abspath(manifest)}\0{settings}".encode("utf-8", "surrogatepass")
    return Path(folder) / f"{hashlib.blake2b(text, digest_size=12).hexdigest()}.safetensors"


def _blob(texts: list[str]):
    import numpy as np

    return np.frombuffer("\0".join(texts).encode("utf-8", "surrogatepass"), dtype=np.uint8)


def _texts(array, count: int) -> list[str]:
    texts = array.tobytes().decode("utf-8", "surrogatepass").split("\0") if count else []
    if len(texts) != count:
        raise ValueError("text column has the wrong count")
    return texts


def save(path: Path, signature: str, settings: str, data: Dataset, present: dict[str, bool],
         names: dict[int, str]) -> None:  # fmt: skip
    """Remember `data`, scanned from a manifest with `signature` under `settings`.

    Args:
        present: each image name the rows named (as written in the manifest) -> whether it was a file.
        names: `id()` of each sample path object -> its name in `present`.

    A failure is logged, not raised: the index only saves time.
    """
    import numpy as np
    from safetensors.numpy import save_file

    samples = sorted(data.samples, key=lambda s: s.id)  # the order scan_dataset sorts into
    texts = [*present, *(s.id for s in samples), *(s.prompt for s in samples)]
    if len(data.problems) > MAX_PROBLEMS or any("\0" in t for t in texts):
        return
    number = {name: i for i, name in enumerate(present)}

    def refs(paths) -> list[int]:
        return [number[names[id(p)]] for p in paths]

    def column(lists: list[list[int]]) -> tuple:
        offsets = np.zeros(len(lists) + 1, dtype=np.int64)
        np.cumsum([len(x) for x in lists], out=offsets[1:])
        return offsets, np.array([i for x in lists for i in x], dtype=np.int64)

    control_offsets, controls = column([refs(s.controls) for s in samples])
    layer_offsets, layers = column([refs(s.layers) for s in samples])
    tensors = {
        "names": _blob(list(present)),
        "present": np.array(list(present.values()), dtype=np.uint8),
        "ids": _blob([s.id for s in samples]),
        "prompts": _blob([s.prompt for s in samples]),
        "target": np.array([number[names[id(s.target)]] if s.target is not None else -1 for s in samples], np.int64),
        "mask": np.array([number[names[id(s.mask)]] if s.mask is not None else -1 for s in samples], np.int64),
        "rejected": np.array([number[names[id(s.rejected)]] if s.rejected is not None else -1 for s in samples],
                             np.int64),
        "control_offsets": control_offsets,
        "controls": controls,
        "layer_offsets": layer_offsets,
        "layers": layers,
    }
    meta = {
        "format": FORMAT,
        "manifest": signature,
        "settings": settings,
        "names": str(len(present)),
        "samples": str(len(samples)),
        "problems": json.dumps([[p.id, p.path, p.reason] for p in data.problems]),
    }
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(tmp), metadata=meta)
        os.replace(tmp, path)
    except OSError as e:
        log.warning("could not save the manifest index %s (%s)", path, e)
        tmp.unlink(missing_ok=True)


def load(path: Path, signature: str, settings: str, folder: Path) -> Dataset | None:
    """The remembered scan, when the index holds one for this manifest signature and settings and every image
    name is a file exactly where one was; None otherwise (an unreadable index is logged and ignored)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="numpy") as f:
            meta = f.metadata() or {}
            if meta.get("format") != FORMAT or meta.get("manifest") != signature or meta.get("settings") != settings:
                return None
            arrays = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is no mapping)
        names = _texts(arrays["names"], int(meta["names"]))
        count = int(meta["samples"])
        ids, prompts = _texts(arrays["ids"], count), _texts(arrays["prompts"], count)
        problems = [DataProblem(*p) for p in json.loads(meta["problems"])]
        present = arrays["present"].tolist()
        target, mask, rejected = arrays["target"].tolist(), arrays["mask"].tolist(), arrays["rejected"].tolist()
        control_offsets, controls = arrays["control_offsets"].tolist(), arrays["controls"].tolist()
        layer_offsets, layers = arrays["layer_offsets"].tolist(), arrays["layers"].tolist()
        if len(present) != len(names) or not (len(target) == len(mask) == len(rejected) == count
                                                == len(control_offsets) - 1
                                                == len(layer_offsets) - 1):  # fmt: skip
            raise ValueError("columns differ in length")
    except FileNotFoundError:
        return None
    except Exception as e:  # safetensors raises its own error types for a damaged file
        log.warning("manifest index %s is unreadable (%s); scanning the manifest", path, e)
        return None
    paths = _paths(folder, names)
    isfile = os.path.isfile
    if any(isfile(p) != bool(was) for p, was in zip(paths, present)):
        return None  # an image came or went: the rows are scanned again
    none, empty = [None] * count, ()
    targets = [paths[j] if j >= 0 else None for j in target] if any(j >= 0 for j in target) else none
    masks, rejects = ([paths[j] if j >= 0 else None for j in column] if any(j >= 0 for j in column) else none
                      for column in (mask, rejected))
    return Dataset(
        [
            _sample(*fields)
            for fields in zip(
                ids,
                targets,
                _tuples(paths, controls, control_offsets, count),
                prompts,
                masks,
                _tuples(paths, layers, layer_offsets, count) if layers else [empty] * count,
                rejects,
            )
        ],
        problems,
    )


def _tuples(paths: list[Path], column: list[int], offsets: list[int], count: int) -> list[tuple[Path, ...]]:
    """Per sample, the tuple of its paths in a column; samples naming the same single path share one tuple."""
    if len(column) == count and offsets == list(range(count + 1)):  # one path each (one control image)
        singles: dict[int, tuple[Path, ...]] = {}
        return [singles.get(j) or singles.setdefault(j, (paths[j],)) for j in column]
    named = [paths[j] for j in column]
    return [tuple(named[offsets[i] : offsets[i + 1]]) for i in range(count)]


def _sample(id, target, controls, prompt, mask, layers, rejected) -> Sample:  # noqa: A002 (Sample's own names)
    """`Sample(...)` without the frozen dataclass's seven guarded assignments (a second per million samples)."""
    s = object.__new__(Sample)
    s.__dict__.update(id=id, target=target, controls=controls, prompt=prompt, mask=mask, layers=layers,
                      rejected=rejected)
    return s


def _paths(folder: Path, names: list[str]) -> list[Path]:
    """`folder / name` for each name; plain relative names (no `.` or empty component) through pathlib's
    child constructor of their folder, built once per folder (what `qie.data.samples` uses for listings)."""
    makers: dict[str, object] = {}
    out = []
    for name in names:
        head, _, base = name.rpartition("/")
        if name.startswith("/") or "//" in name or "/." in f"/{name}" or not base:
            out.append(folder / name)
            continue
        make = makers.get(head)
        if make is None:
            make = makers[head] = child_path(folder / head if head else folder)
        out.append(make(base))
    return out
