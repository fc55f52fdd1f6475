"""The demo's picture: one row of equal tiles per sample, a title over each column, a caption under each row."""

from __future__ import annotations

from collections.abc import Sequence

from PIL import Image, ImageDraw, ImageFont

TITLE_HEIGHT = 16
CAPTION_HEIGHT = 16
TEXT = (20, 20, 20)


def grid_size(rows: int, columns: int, tile: int) -> tuple[int, int]:
    """(width, height) of a grid of `rows` x `columns` tiles of `tile` px with its titles and captions."""
    return columns * tile, TITLE_HEIGHT + rows * (tile + CAPTION_HEIGHT)


def captioned_grid(
    rows: Sequence[Sequence[Image.Image]], captions: Sequence[str], titles: Sequence[str], tile: int = 128
) -> Image.Image:
    """Each row's images scaled to `tile` x `tile` (nearest neighbour: pixels stay sharp), its caption under it.

    Raises:
        ValueError: rows of different lengths, or counts of captions or titles that do not match.
    """
    columns = len(titles)
    if len(captions) != len(rows) or any(len(row) != columns for row in rows):
        raise ValueError(f"{len(rows)} rows, {len(captions)} captions and {columns} titles do not match")
    grid = Image.new("RGB", grid_size(len(rows), columns, tile), "white")
    draw = ImageDraw.Draw(grid)
    font = ImageFont.load_default()
    for x, title in enumerate(titles):
        draw.text((x * tile + 4, 2), title, fill=TEXT, font=font)
    for y, (row, caption) in enumerate(zip(rows, captions)):
        top = TITLE_HEIGHT + y * (tile + CAPTION_HEIGHT)
        for x, image in enumerate(row):
            grid.paste(image.convert("RGB").resize((tile, tile), Image.Resampling.NEAREST), (x * tile, top))
        draw.text((4, top + tile + 2), caption, fill=TEXT, font=font)
    return grid
