"""Rows' categories: the `category` key (column) of a manifest's rows, which evaluation reports its means by.

A row is matched to its sample by what makes the sample (target, control images, prompt), so ids made up by the
scan (a target's stem, `#N` for a second instruction) need not be known here. Folder layouts and rows without the
key have no category.
"""

from __future__ import annotations

from pathlib import Path

from qie.data.manifest import _manifest_rows
from qie.data.samples import Sample

MANIFEST_SUFFIXES = (".jsonl", ".json", ".csv")


def row_categories(path: str | Path, samples: list[Sample]) -> dict[str, str]:
    """Sample id -> its row's `category`, for the samples of the manifest `path` whose row has one ({} for a
    folder or Hugging Face data set)."""
    path = Path(path)
    if not path.is_file() or path.suffix.lower() not in MANIFEST_SUFFIXES:
        return {}
    found: dict[tuple, str] = {}
    for _, row in _manifest_rows(path):
        if not isinstance(row, dict) or not row.get("category") or not isinstance(row.get("target", ""), str):
            continue
        controls = row.get("controls") or ([row["control"]] if row.get("control") else [])
        controls = [controls] if isinstance(controls, str) else controls
        if not isinstance(controls, list) or not all(isinstance(c, str) for c in controls):
            continue
        target = path.parent / row["target"] if row.get("target") else None
        prompt = str(row.get("prompt") or "").strip()
        found.setdefault((target, tuple(path.parent / c for c in controls), prompt), str(row["category"]))
    categories = {}
    for sample in samples:
        category = found.get((sample.target, tuple(sample.controls), sample.prompt))
        if category is not None:
            categories[sample.id] = category
    return categories


__all__ = ["row_categories"]
