"""Preference pairs (and samples with other sample fields' images) that can train, judged at start.

- A pair whose rejected image is its target (the same file, or the same bytes) has the loss ln 2 at every step,
  whatever the weights: it trains nothing useful, so it is left out, named.
- A source that encodes (`cache.mode=lazy` or live) reads a rejected image only when its batch comes: its header
  is read at start instead (remembered by the image-size index, so a warm start stats it), so an unreadable one,
  or one of another size than its target once resized, is found before the first step, not midway. So is the image
  of any other sample field (`qie.data.fields`), which is encoded as the target is too.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from qie.cache.keys import FileHasher
from qie.data.buckets import ImageSizeIndex
from qie.data.fields import field_named
from qie.data.images import ImageError, fit_area
from qie.data.samples import Sample


@dataclass
class PairCheck:
    """How pairs are judged: `hasher` compares bytes; with `sizes` the images' headers are read (a source that
    encodes) at the training target's area (`target_pixels`, `multiple_of`)."""

    hasher: FileHasher
    sizes: ImageSizeIndex | None
    target_pixels: int
    multiple_of: int

    def problem(self, sample: Sample) -> tuple[str, str] | None:
        """(the file at fault, why) when `sample`, a preference pair (or a sample with a field's image), cannot
        train; None when it can (or has no field's image)."""
        target = sample.target
        if target is None:
            return None
        for name, image in sample.field_images:
            if (why := self.field_problem(target, name, image)) is not None:
                return why
        return None

    def field_problem(self, target: os.PathLike, name: str, image: os.PathLike) -> tuple[str, str] | None:
        """(the file at fault, why) when the image of the field `name` cannot train beside `target`."""
        if field_named(name).result and self.same_bytes(target, image):
            return str(image), (
                f"its {name} image {str(image)!r} is its target {str(target)!r} (the same bytes): a pair of "
                "equal results has the loss ln 2 whatever the weights and trains nothing; give a worse result"
            )
        if self.sizes is None:
            return None
        try:
            want = fit_area(*self.sizes.size(target), self.target_pixels, self.multiple_of)
            size = fit_area(*self.sizes.size(image), self.target_pixels, self.multiple_of)
        except ImageError as e:
            return str(getattr(e, "path", None) or image), str(e)
        except OSError as e:  # gone or unreadable since the scan
            return str(e.filename or image), f"cannot read {e.filename!r} ({e.strerror})"
        if size != want:
            return str(image), (
                f"{name} image {str(image)!r} is {size[0]}x{size[1]} once resized, its target "
                f"{want[0]}x{want[1]}: make them one shape"
            )
        return None

    def same_bytes(self, a: os.PathLike, b: os.PathLike) -> bool:
        """Whether files `a` and `b` hold the same bytes: one file, or equal sizes and hashes (hashed only then)."""
        try:
            sa, sb = os.stat(a), os.stat(b)
            if (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino):
                return True
            return sa.st_size == sb.st_size and self.hasher.hash(a) == self.hasher.hash(b)
        except OSError:  # a file that cannot be read is judged where it is read
            return False
