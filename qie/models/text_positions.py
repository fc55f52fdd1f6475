"""How many prompt tokens a transformer can take beside its images: its rotary tables have a fixed number of
positions, and the images take some of them.

Qwen-Image (`QwenEmbedRope`, `QwenEmbedLayer3DRope`): text token i sits at position max_vid_index + i of a
4,096-row table, max_vid_index being the largest half side (in tokens) of any image frame (Layered: at least the
layer count). Qwen-Image-2.1 (`QwenImage21Rope`): text and image blocks advance one shared position, an image
block by its longer side, in an 8,192-row table. A longer prompt makes the transformer fail inside its rotary
embedding; the Edit and 2.1 pipelines do not cut prompts (text-to-image and Layered cut at 512 tokens), so qie
refuses such a prompt in one line, naming the sample.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache

from qie.errors import DataError
from qie.types import Batch

Frame = tuple[int, int, int]  # (frames, height, width) in transformer tokens, as `img_shapes` lists them


# What to do about a prompt met in training: it may come from a cache filled before the check existed.
FIX_CACHED = "shorten it (and run precompute again for a cached sample)"


class PromptTooLong(DataError):
    """A prompt longer than the text positions the transformer has beside its images."""


@cache
def _table_rows(kind: str) -> int:
    """Rows of diffusers' rotary position table (read off the class, not written down here)."""
    if kind == "qwen_image":
        from diffusers.models.transformers.transformer_qwenimage import QwenEmbedRope

        return int(QwenEmbedRope(theta=10000, axes_dim=[2, 2, 2], scale_rope=True).pos_freqs.shape[0])
    from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21Rope

    rope = QwenImage21Rope(theta=10000, axes_dim=[2])
    return int(rope.freqs[0].shape[0] - 1024)  # the positive positions; 1,024 negative ones follow


def qwen_image(frames: Sequence[Frame], layered: bool = False) -> int:
    """Text tokens Qwen-Image's transformer takes beside `frames` (it uses `scale_rope=True`)."""
    used = max((max(h // 2, w // 2) for _, h, w in frames), default=0)
    if layered:
        used = max(used, len(frames) - 1)
    return _table_rows("qwen_image") - used


def qwen_image_21(frames: Sequence[Frame]) -> int:
    """Text tokens (image slots aside) Qwen-Image-2.1's transformer takes beside `frames`."""
    return _table_rows("qwen_image_21") - sum(max(h, w) for _, h, w in frames)


def check_batch(batch: Batch, limit: int) -> None:
    """Raise PromptTooLong naming the first sample of `batch` whose prompt has more than `limit` text tokens
    (its image slots aside)."""
    rows = len(batch.ids)
    mask = batch.prompt_embeds_mask
    lengths = [int(batch.prompt_embeds.shape[1])] * rows if mask is None else mask.sum(dim=1).tolist()
    if batch.prompt_image_mask is not None:
        lengths = [n - int(k) for n, k in zip(lengths, batch.prompt_image_mask.sum(dim=1).tolist())]
    for sample, tokens in zip(batch.ids, lengths):
        check(int(tokens), limit, f"sample {sample!r}", "its prompt (caption)", FIX_CACHED)


def check(tokens: int, limit: int, who: str, what: str = "its prompt", fix: str = "shorten it") -> None:
    """Raise PromptTooLong naming `who` (a sample or a setting) when `tokens` exceeds `limit`."""
    if tokens > limit:
        raise PromptTooLong(
            f"{who}: {what} is {tokens:,} tokens, more than the {limit:,} text positions the transformer has "
            f"beside its images at this size: {fix}"
        )
