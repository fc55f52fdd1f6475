"""A picture of images side by side (the demo's, the eval stage's): rows of equal tiles, a title over each column, a
caption under each row. Transparent pixels (RGBA tiles: layers, alpha outputs) show a grey checkerboard."""

from __future__ import annotations

from collections.abc import Sequence

from PIL import Image, ImageDraw, ImageFont

TITLE_HEIGHT = 16
CAPTION_HEIGHT = 16
TEXT = (20, 20, 20)
# The checkerboard under transparent pixels: its two greys and its square's side in pixels of the tile.
CHECKER = ((204, 204, 204), (255, 255, 255))
CHECKER_SQUARE = 8


def grid_size(rows: int, columns: int, tile: int) -> tuple[int, int]:
    """(width, height) of a grid of `rows` x `columns` tiles of `tile` px with its titles and captions."""
    return columns * tile, TITLE_HEIGHT + rows * (tile + CAPTION_HEIGHT)


def checkerboard(width: int, height: int) -> Image.Image:
    """An RGBA checkerboard of CHECKER's greys, the top-left square the first."""
    board = Image.new("RGBA", (width, height), (*CHECKER[1], 255))
    draw = ImageDraw.Draw(board)
    for y in range(0, height, CHECKER_SQUARE):
        for x in range((y // CHECKER_SQUARE) % 2 * CHECKER_SQUARE, width, 2 * CHECKER_SQUARE):
            draw.rectangle((x, y, x + CHECKER_SQUARE - 1, y + CHECKER_SQUARE - 1), fill=(*CHECKER[0], 255))
    return board


def tile_image(image: Image.Image, tile: int) -> Image.Image:
    """`image` scaled to `tile` x `tile` (nearest neighbour: pixels stay sharp), RGB; with alpha, composited over
    a checkerboard."""
    scaled = image.resize((tile, tile), Image.Resampling.NEAREST)
    if "A" not in scaled.getbands():
        return scaled.convert("RGB")
    return Image.alpha_composite(checkerboard(tile, tile), scaled.convert("RGBA")).convert("RGB")


def captioned_grid(
    rows: Sequence[Sequence[Image.Image]], captions: Sequence[str], titles: Sequence[str], tile: int = 128
) -> Image.Image:
    """Each row's images scaled to `tile` x `tile` (`tile_image`), its caption under it.

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
            grid.paste(tile_image(image, tile), (x * tile, top))
        draw.text((4, top + tile + 2), caption, fill=TEXT, font=font)
    return grid
