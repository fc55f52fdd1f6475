"""A data set folder's scan remembered by what it depends on, so a warm start lists no folder and reads no caption.

Scanning a folder of 100k samples (a listing per folder, ~200k paths, a caption read per sample) takes seconds;
its result depends only on the names in the folders the scan lists or tests, on the captions it reads, and on
its settings. The index keeps that result (samples and problems, in the scan's order) with:

- for each folder a scan of either layout lists or tests (the data set folder, training_images/,
  control_images/, masks/, rejected_images/, images/, layers/; a sample field's image is in training_images/):
  whether it is a folder and, for one that is,
  its (mtime_ns, ctime_ns, inode): adding, removing or renaming a name in a folder moves its mtime and ctime;
- for each caption the scan read (or tested): its (size, mtime_ns, ctime_ns, inode), or that it was no file:
  a write in place moves its ctime, which no tool can set back.

A later scan with the same settings stats those folders and each caption once; when all are as they were, the
remembered result is the scan's result. Anything else scans the folder again (and remembers the new result).

Kept beside the manifest indexes as `<folder>/<digest of the data set folder's path and settings>.safetensors`
(`qie.data.index_file`); the caption signatures as integer columns beside the sample columns.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from qie.data import index_file
from qie.data.fields import DEFAULT_FIELDS, FIELD_FOLDERS, SampleField
from qie.data.samples import CaptionFiles, Dataset, read_folder

FORMAT = "qie-folder-index/3"  # 2: images leading out through links are problems; 3: sample fields' images
# Every folder a scan of either layout lists or tests, relative to the data set folder ("": the folder itself).
FOLDERS = ("", "training_images", "control_images", "masks", *FIELD_FOLDERS, "images", "layers")
# The signature of a caption path that was no regular file (missing, a folder, unreadable).
NOT_A_FILE = (-1, 0, 0, 0)


def folder_signatures(root: Path) -> str:
    """For each of FOLDERS (symbolic links followed), "mtime_ns ctime_ns inode" when it is a folder and "-"
    when it is none, as JSON: what says whether any name in them came, went or was renamed."""
    out = []
    for name in FOLDERS:
        try:
            st = os.stat(root / name if name else root)
        except (OSError, ValueError):
            out.append("-")
            continue
        out.append(f"{st.st_mtime_ns} {st.st_ctime_ns} {st.st_ino}" if stat.S_ISDIR(st.st_mode) else "-")
    return json.dumps(out)


def file_signature(path: str | os.PathLike) -> tuple[int, int, int, int]:
    """(size, mtime_ns, ctime_ns, inode) of the regular file at `path` (symbolic links followed); NOT_A_FILE
    when there is none."""
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return NOT_A_FILE
    if not stat.S_ISREG(st.st_mode):
        return NOT_A_FILE
    return (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)


class _NotedCaptions(CaptionFiles):
    """Caption files looked at as a plain scan does, each one's signature noted first: a write during the scan
    then shows as a change at the next start, never as a remembered stale text."""

    def __init__(self) -> None:
        self.seen: dict[str, tuple[int, int, int, int]] = {}

    def read(self, path: Path | str) -> str:
        self.seen[str(path)] = file_signature(path)
        return super().read(path)

    def is_file(self, path: Path) -> bool:
        self.seen[str(path)] = file_signature(path)
        return super().is_file(path)


def scan_folder(
    root: Path,
    require_target: bool,
    require_prompt: bool,
    index_dir: str | os.PathLike,
    allow_outside: bool = False,
    fields: tuple[SampleField, ...] = DEFAULT_FIELDS,
) -> Dataset:
    """`qie.data.scan.scan_folder`'s result: remembered in `index_dir` when nothing it depends on changed,
    else scanned (and remembered, when the folders did not change during the scan and `index_dir`'s parent, the
    cache folder, exists)."""
    names = [f.name for f in fields]
    settings = json.dumps(["folder", str(root), require_target, require_prompt, *(["outside"] * allow_outside), names])
    index = index_file.index_path(index_dir, root, settings)
    folders = folder_signatures(root)
    found = load(index, settings, folders, root)
    if found is not None:
        return found
    captions = _NotedCaptions()
    data = read_folder(root, require_target, require_prompt, captions, allow_outside, fields)
    if folder_signatures(root) == folders and index.parent.parent.is_dir():  # not while it changed; in a cache
        save(index, settings, folders, root, data, captions.seen)
    return data


def save(
    path: Path, settings: str, folders: str, root: Path, data: Dataset, captions: dict[str, tuple[int, int, int, int]]
) -> None:
    """Remember `data`, scanned from `root` under `settings` while its folders had the signatures `folders`.

    Args:
        captions: each caption path the scan looked at -> its `file_signature` from before it was read.

    Paths are kept relative to `root` (the index is found by its absolute path and the settings, which hold
    `root` as given). A failure is logged, not raised: the index only saves time.
    """
    import numpy as np

    heads = {str(root / name): name for name in FOLDERS if name}
    table: dict[str, int] = {}

    def relative(path: str) -> str:
        head, _, base = path.rpartition("/")
        return f"{heads[head]}/{base}"

    def number(path: Path) -> int:
        return table.setdefault(relative(str(path)), len(table))

    try:
        columns = index_file.sample_columns(data.samples, number)
        tensors = {
            **columns,
            "names": index_file.blob(list(table)),
            "captions": index_file.blob([relative(p) for p in captions]),
            "caption_stats": np.array([s[:3] for s in captions.values()], np.int64).reshape(-1, 3),
            "caption_inodes": np.array([s[3] for s in captions.values()], np.uint64),
        }
    except (KeyError, ValueError):  # a path outside the scanned folders, or a NUL in a prompt: not kept
        return
    meta = {
        "format": FORMAT,
        "settings": settings,
        "folders": folders,
        "names": str(len(table)),
        "samples": str(len(data.samples)),
        "captions": str(len(captions)),
    }
    index_file.save(path, tensors, meta, data.problems, "folder index")


def load(path: Path, settings: str, folders: str, root: Path) -> Dataset | None:
    """The remembered scan, when the index holds one for these settings and folder signatures and each caption
    it read has the signature it had; None otherwise (an unreadable index is logged and ignored)."""

    def decode(meta: dict[str, str], arrays: dict) -> Dataset | None:
        captions = index_file.texts(arrays["captions"], int(meta["captions"]))
        stats, inodes = arrays["caption_stats"].tolist(), arrays["caption_inodes"].tolist()
        if not len(stats) == len(inodes) == len(captions):
            raise ValueError("columns differ in length")
        prefix = f"{root}/"
        if [file_signature(prefix + name) for name in captions] != [(*s, i) for s, i in zip(stats, inodes)]:
            return None  # a caption was written, replaced, came or went
        paths = index_file.paths(root, index_file.texts(arrays["names"], int(meta["names"])))
        return Dataset(index_file.columns_samples(arrays, int(meta["samples"]), paths), index_file.read_problems(meta))

    expect = {"format": FORMAT, "settings": settings, "folders": folders}
    return index_file.load(path, expect, "folder index", decode)
