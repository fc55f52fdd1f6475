"""The HTML of a report page: one self-contained file (styles, pictures and charts inline) that any browser opens
from the disk. A small script marks on the page whether every picture decoded (`data-images-ok` and
`data-images-failed` on the body), which a headless browser's DOM dump shows."""

from __future__ import annotations

import base64
import html
import io
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

from qie.data.images import ImageError, open_image

THUMBNAIL = 192  # px, the longer side of a picture in a strip

STYLE = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 0 auto; max-width: 1400px; padding: 1em 2em; color: #222; }
h1 { font-size: 1.5em; } h2 { border-bottom: 1px solid #ddd; padding-bottom: .2em; margin-top: 1.6em; }
table { border-collapse: collapse; margin: .5em 0; } td, th { border: 1px solid #ddd; padding: .25em .6em; }
th { background: #f4f4f4; text-align: left; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
pre { background: #f6f6f6; padding: .8em; overflow-x: auto; white-space: pre-wrap; word-break: break-all; }
.charts { display: flex; flex-wrap: wrap; gap: 1em; } .charts img { max-width: 100%; }
.strip { overflow-x: auto; } .strip td { text-align: center; vertical-align: top; font-size: 12px; }
.strip img { display: block; margin: auto; image-rendering: auto; } .muted { color: #777; }
"""

# Whether each <img> decoded, written onto the body once the page has loaded.
CHECK_IMAGES = """
window.addEventListener("load", function () {
  var ok = 0, failed = [];
  document.querySelectorAll("img").forEach(function (img) {
    if (img.complete && img.naturalWidth > 0) { ok += 1; } else { failed.push(img.alt || img.src.slice(0, 40)); }
  });
  document.body.setAttribute("data-images-ok", String(ok));
  document.body.setAttribute("data-images-failed", String(failed.length));
  if (failed.length) { document.body.setAttribute("data-images-failed-names", failed.join("; ")); }
});
"""


class Raw(str):
    """A table cell's HTML, put in as it is (a link); any other cell is escaped."""


def page(title: str, sections: Iterable[str]) -> str:
    """A whole HTML document titled `title` holding `sections` (HTML fragments)."""
    body = "\n".join(s for s in sections if s)
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{esc(title)}</title><style>{STYLE}</style></head>\n<body>\n{body}\n"
        f"<script>{CHECK_IMAGES}</script>\n</body></html>\n"
    )


def esc(text: object) -> str:
    return html.escape(str(text), quote=True)


def section(title: str, *parts: str, anchor: str = "") -> str:
    """A titled section of the parts that are not empty ("" when none is)."""
    kept = [p for p in parts if p]
    if not kept:
        return ""
    anchor = anchor or re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")
    return f'<section id="{esc(anchor)}"><h2>{esc(title)}</h2>{"".join(kept)}</section>'


def table(head: Sequence[str] | None, rows: Iterable[Sequence[object]]) -> str:
    """A table (with a header row unless `head` is None); numbers right-aligned, to four significant digits."""
    lines = [] if head is None else ["<tr>" + "".join(f"<th>{esc(h)}</th>" for h in head) + "</tr>"]
    for row in rows:
        lines.append("<tr>" + "".join(_cell(c) for c in row) + "</tr>")
    return f"<table>{''.join(lines)}</table>"


def charts(uris: Iterable[tuple[str, str | None]]) -> str:
    """Charts side by side: (alt text, data URI or None)."""
    images = [f'<img src="{uri}" alt="{esc(alt)}">' for alt, uri in uris if uri]
    return f'<div class="charts">{"".join(images)}</div>' if images else ""


def preformatted(text: str) -> str:
    return f"<pre>{esc(text)}</pre>"


def details(summary: str, inner: str, open_: bool = False) -> str:
    return f"<details{' open' if open_ else ''}><summary>{esc(summary)}</summary>{inner}</details>"


def strip(head: Sequence[str], rows: Sequence[tuple[str, Sequence[Path | None]]]) -> str:
    """Pictures in a grid to scan: a row per (label, pictures), a column per `head` entry; None leaves a cell empty."""
    cells = "<th></th>" + "".join(f"<th>{esc(h)}</th>" for h in head)
    lines = [f"<tr>{cells}</tr>"]
    for label, paths in rows:
        images = "".join(f"<td>{picture(p, f'{label} {h}')}</td>" for h, p in zip(head, paths))
        lines.append(f"<tr><th>{esc(label)}</th>{images}</tr>")
    return f'<div class="strip"><table>{"".join(lines)}</table></div>'


def picture(path: Path | None, alt: str, size: int = THUMBNAIL) -> str:
    """An <img> of the picture at `path`, shrunk to `size` px on its longer side, inline; a note if unreadable."""
    if path is None:
        return ""
    try:
        shown = open_image(path, alpha=True)
    except ImageError:
        return f'<span class="muted">{esc(path.name)}: unreadable</span>'
    if shown.getchannel("A").getextrema() == (255, 255):  # opaque
        shown = shown.convert("RGB")
    shown.thumbnail((size, size))
    buffer = io.BytesIO()
    kind = "png" if shown.mode == "RGBA" else "jpeg"  # JPEG keeps a run's many pictures small; PNG keeps alpha
    shown.save(buffer, format=kind, **({"quality": 90} if kind == "jpeg" else {"optimize": True}))
    uri = f"data:image/{kind};base64," + base64.b64encode(buffer.getvalue()).decode("ascii")
    return f'<img src="{uri}" alt="{esc(alt)}" width="{shown.width}" height="{shown.height}">'


def _cell(value: object) -> str:
    if isinstance(value, Raw):
        return f"<td>{value}</td>"
    if isinstance(value, float):
        return f'<td class="num">{value:.4g}</td>'
    if isinstance(value, int) and not isinstance(value, bool):
        return f'<td class="num">{value}</td>'
    return f"<td>{esc('-' if value is None else value)}</td>"
