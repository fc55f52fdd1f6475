"""A manifest's scan remembered by the manifest file's signature, so a warm start parses no row.

Scanning a manifest of a million rows (JSON per row, checks per field, a path per image) takes tens of
seconds; its result depends only on the manifest's bytes, the scan's settings and which of the images it
names exist. The index keeps that result (samples and problems) with the manifest's (size, mtime_ns,
ctime_ns, inode) and, for every image path the rows name, whether it was a file. A later scan of the same
manifest with the same settings stats each named image once; when each is still a file exactly where one was,
the remembered result is the scan's result. Any change of the manifest (its ctime changes with every write,
and no tool can set it back) or of which images exist scans the rows again.

Kept as `<folder>/<digest of manifest path and settings>.safetensors` (`qie.data.index_file`: numpy arrays and
UTF-8 blobs; the problems, usually few, as JSON in the file's metadata).
"""

from __future__ import annotations

import os
from pathlib import Path

from qie.data import file_stats, index_file
from qie.data.samples import Dataset

FORMAT = "qie-manifest-index/3"  # 3: the images of sample fields, a column each


def manifest_signature(path: Path) -> str:
    """(size, mtime_ns, ctime_ns, inode) of the manifest file.

    Raises:
        OSError: it cannot be stat'ed.
    """
    st = os.stat(path)
    return f"{st.st_size} {st.st_mtime_ns} {st.st_ctime_ns} {st.st_ino}"


def save(
    path: Path, signature: str, settings: str, data: Dataset, present: dict[str, bool], names: dict[int, str]
) -> None:
    """Remember `data`, scanned from a manifest with `signature` under `settings`.

    Args:
        present: each image name the rows named (as written in the manifest) -> whether it was a file.
        names: `id()` of each sample path object -> its name in `present`.

    A failure is logged, not raised: the index only saves time.
    """
    import numpy as np

    samples = sorted(data.samples, key=lambda s: s.id)  # the order scan_dataset sorts into
    number = {name: i for i, name in enumerate(present)}
    try:
        tensors = {
            "names": index_file.blob(list(present)),
            "present": np.array(list(present.values()), dtype=np.uint8),
            **index_file.sample_columns(samples, lambda p: number[names[id(p)]]),
        }
    except ValueError:  # a name or prompt holds a NUL character: not kept
        return
    meta = {
        "format": FORMAT,
        "manifest": signature,
        "settings": settings,
        "names": str(len(present)),
        "samples": str(len(samples)),
    }
    index_file.save(path, tensors, meta, data.problems, "manifest index")


def load(path: Path, signature: str, settings: str, folder: Path) -> Dataset | None:
    """The remembered scan, when the index holds one for this manifest signature and settings and every image
    name is a file exactly where one was; None otherwise (an unreadable index is logged and ignored)."""

    def decode(meta: dict[str, str], arrays: dict) -> Dataset | None:
        names = index_file.texts(arrays["names"], int(meta["names"]))
        present = arrays["present"].tolist()
        if len(present) != len(names):
            raise ValueError("columns differ in length")
        problems = index_file.read_problems(meta)
        paths = index_file.paths(folder, names)
        isfile = file_stats.isfile  # the stat the key memo takes of each image next
        if any(isfile(p) != bool(was) for p, was in zip(paths, present)):
            return None  # an image came or went: the rows are scanned again
        return Dataset(index_file.columns_samples(arrays, int(meta["samples"]), paths), problems)

    expect = {"format": FORMAT, "manifest": signature, "settings": settings}
    return index_file.load(path, expect, "manifest index", decode)
