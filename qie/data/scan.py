"""Reading a data set folder (qie's layout) or a manifest into samples: the one entry both layouts share."""

from __future__ import annotations

import gc
import os
from operator import attrgetter
from pathlib import Path

from qie.data import folder_index
from qie.data.fields import DEFAULT_FIELDS, SampleField
from qie.data.manifest import scan_manifest
from qie.data.samples import IMAGE_EXTENSIONS, Dataset, read_folder
from qie.errors import DataError


def scan_dataset(
    path: str | Path,
    format: str = "auto",
    require_target: bool = True,
    allow_outside: bool = False,
    require_prompt: bool = True,
    index_dir: str | os.PathLike | None = None,
    fields: tuple[SampleField, ...] = DEFAULT_FIELDS,
) -> Dataset:
    """Find the samples of a data set folder or manifest.

    Args:
        path: a folder in the folder layout, or a .jsonl / .csv manifest.
        format: "auto", "folder" or "manifest".
        require_target: whether a sample without a target image is a problem (training) or fine (infer).
        allow_outside: accept manifest rows naming files outside the manifest's folder (`..`, absolute
            paths), and images of either layout that lead outside its folder through a symbolic link; otherwise
            such a sample is a problem (`data.allow_outside_paths`).
        index_dir: where scans are remembered (`cache.dir/state/manifests`), a manifest's by the manifest's signature
            (`qie.data.manifest_index`), a folder's by its folders' and captions' signatures
            (`qie.data.folder_index`); None: every scan reads the data set.
        fields: the sample fields whose images are read (`qie.data.fields`).

    Returns:
        The samples in a stable order (sorted by id) and the problems found.

    Raises:
        DataError: the path does not exist, is not a data set, or holds no usable sample.
    """
    root = Path(path).expanduser()
    if not root.exists():
        raise DataError(f"data.path {str(root)!r} does not exist: point data.path at a data set folder or manifest")
    if format == "auto":
        format = "folder" if root.is_dir() else "manifest"
    # No garbage collection passes while a few hundred thousand paths and samples are made (none is cyclic):
    # they cost about a third of the scan of a 100k-sample folder.
    gc_was_on = gc.isenabled()
    gc.disable()
    try:
        if format == "folder":
            data = scan_folder(root, require_target, require_prompt, index_dir, allow_outside, fields)
        else:
            data = scan_manifest(root, require_target, allow_outside, require_prompt, index_dir, fields)
    finally:
        if gc_was_on:
            gc.enable()
    if not data.samples:
        detail = "".join(f"\n  {p.path}: {p.reason}" for p in data.problems[:5])
        if len(data.problems) > 5:
            detail += f"\n  ... and {len(data.problems) - 5} more"
        if not data.problems:
            detail = f"\n  it holds no samples (images are {', '.join(IMAGE_EXTENSIONS)})"
        raise DataError(f"no usable sample in {str(root)!r}{detail}\nSee README 'Data sets' for the layouts.")
    data.samples.sort(key=attrgetter("id"))
    data.problems.sort(key=attrgetter("id"))
    return data


def scan_folder(
    root: Path,
    require_target: bool,
    require_prompt: bool = True,
    index_dir: str | os.PathLike | None = None,
    allow_outside: bool = False,
    fields: tuple[SampleField, ...] = DEFAULT_FIELDS,
) -> Dataset:
    """The samples (sorted by id) and problems of a data set folder (either layout); without `require_prompt`,
    a sample without a caption has the prompt "". An image that leads outside `root` through a symbolic link
    (a linked file or folder) is a problem of its sample unless `allow_outside` (`qie.data.confine`).

    Args:
        index_dir: where scans are remembered by the folders' and captions' signatures
            (`qie.data.folder_index`): a repeat scan of an unchanged folder stats each caption instead of listing
            the folders and reading the captions. Written only when its parent folder (the cache folder)
            exists. None: every scan lists and reads.
    """
    if index_dir is not None:
        return folder_index.scan_folder(root, require_target, require_prompt, index_dir, allow_outside, fields)
    return read_folder(root, require_target, require_prompt, None, allow_outside, fields)
