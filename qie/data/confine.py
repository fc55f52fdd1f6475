"""Whether a data set's image paths stay inside its folder once symbolic links are followed.

Every layout (a data set folder, a manifest, a Hugging Face data set naming local files) reads only files inside
its folder unless `data.allow_outside_paths=true`: an image that is a link to a file elsewhere (`/etc/passwd`),
or lies in a linked folder that leads elsewhere, is a problem of its sample, named with where it leads. Each
folder is resolved once; a file is resolved only when it is a link.
"""

from __future__ import annotations

import os

FIX = "move it inside, or set data.allow_outside_paths=true"


class Confinement:
    """Paths checked against `folder` (its symbolic links followed once)."""

    def __init__(self, folder: str | os.PathLike) -> None:
        self.folder = str(folder)
        self.real = os.path.realpath(folder).rstrip(os.sep) + os.sep
        self.real_dirs: dict[str, str] = {}

    def leads_out(self, path: str | os.PathLike, is_link: bool | None = None) -> str | None:
        """Where `path` leads (links followed) when that is outside the folder; None when it stays inside.

        Args:
            is_link: whether the file itself is a symbolic link, when the caller knows it (a folder listing
                says so without a stat); None: looked up.
        """
        parent, base = os.path.split(os.path.abspath(path))
        real_parent = self.real_dirs.get(parent)
        if real_parent is None:
            real_parent = self.real_dirs[parent] = os.path.realpath(parent)
        real = os.path.join(real_parent, base)
        if is_link or (is_link is None and os.path.islink(real)):
            real = os.path.realpath(real)
        return None if real.startswith(self.real) else real

    def folder_leads_out(self, folder: str | os.PathLike) -> str | None:
        """Where the folder `folder` leads when that is outside (a linked folder); None when inside."""
        real = os.path.realpath(folder)
        self.real_dirs[os.path.abspath(folder)] = real
        return None if (real + os.sep).startswith(self.real) else real
