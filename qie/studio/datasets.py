"""The data tab: a data set's samples (targets, control images, prompts, masks, layers) read through qie's own data
code (`qie.data.formats.read_dataset`: a folder, a manifest or, with `datasets` installed, a Hugging Face data set),
the folders its images may be served from, and thumbnails of them."""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path

# A thumbnail's longer side, in pixels, at most.
THUMBNAIL = 256


@dataclass(kw_only=True)
class Page:
    """Which samples of a data set to show."""

    path: str
    offset: int = 0
    limit: int = 48


def browse(page: Page, images_dir: Path) -> dict:
    """`page`'s samples of the data set at `page.path`, with the counts the tab shows (samples, those without a
    prompt, problems).

    Raises:
        DataError: the path is no data set (qie's one-line message).
    """
    from qie.data.formats import DataSource, detect_format, read_dataset

    source = DataSource(path=page.path, images_dir=images_dir)
    data = read_dataset(source, require_target=False, require_prompt=False)
    shown = data.samples[page.offset : page.offset + page.limit]
    return {
        "path": page.path,
        "format": detect_format(page.path),
        "total": len(data.samples),
        "without_prompt": sum(1 for s in data.samples if not s.prompt.strip()),
        "problems": [{"id": p.id, "path": p.path, "reason": p.reason} for p in data.problems[:20]],
        "offset": page.offset,
        "samples": [
            {
                "id": s.id,
                "target": str(s.target) if s.target else None,
                "controls": [str(c) for c in s.controls],
                "prompt": s.prompt,
                "mask": str(s.mask) if s.mask else None,
                "layers": [str(p) for p in s.layers],
            }
            for s in shown
        ],
    }


def folder_of(path: str) -> Path:
    """The folder a data set's images are read from: the data set folder, a manifest's folder, or a glob's part
    before its first wildcard."""
    from qie.data.hf import GLOB_CHARACTERS  # the data code imports torch: when a data set is first read

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


def thumbnail(path: Path, size: int = THUMBNAIL) -> tuple[bytes, str]:
    """The image at `path`, read as training reads it (upright, alpha kept), shrunk to `size` pixels on its longer
    side: PNG bytes and their media type.

    Raises:
        ImageError: naming the file when it cannot be read as an image.
    """
    from qie.data.images import open_image

    image = open_image(path, alpha=True)
    image.thumbnail((size, size))
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue(), "image/png"


__all__ = ["Page", "browse", "folder_of", "thumbnail"]
