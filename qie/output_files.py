"""Files a stage writes where the user said (an export folder, an extracted LoRA, a run's report), written so that
nothing the user has is lost by accident: each file is written under a fresh temporary name beside its place and
renamed onto it, so a link there is replaced and never written through, and a failed write leaves what was there
(and no temporary file); each gets the user's usual mode (0666 less the umask, as the shell's own files), not the
0600 of a temporary file or of safetensors' writer.

What may be replaced is the caller's to check first: `inputs_problem` (an output that is, or lies inside, one of
the command's inputs) and `existing_problem` (files already there, replaced only when the user says so).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from qie.errors import ConfigError


def user_mode() -> int:
    """The mode a new file of this process gets from the shell's habits: 0666 less the umask (read from
    /proc/self/status where Linux gives it; else set and set back, which other threads could see for a moment)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            mask = next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError, IndexError):
        mask = os.umask(0o022)
        os.umask(mask)
    return 0o666 & ~mask


def inside(path: Path, folder: Path) -> bool:
    """Whether `path` is `folder` or lies inside it, links resolved."""
    path, folder = path.resolve(), folder.resolve()
    return path == folder or folder in path.parents


def inputs_problem(outputs: Iterable[Path], inputs: Mapping[str, Path | None], key: str) -> str | None:
    """Why one of `outputs` would overwrite an input (one line), or None: an output that is an input file, or lies
    inside an input folder. `inputs` maps what each input is (the setting that names it) to its path (None: not
    local); `key` is the setting that names the outputs."""
    for out in outputs:
        for name, given in inputs.items():
            if given is None or not given.exists():
                continue
            if inside(out, given):
                what = "is" if out.resolve() == given.resolve() else "lies inside"
                return (
                    f"{key}: {out} {what} {name} ({given}), an input of this command: writing it would overwrite "
                    f"what is read; choose another {key}"
                )
    return None


def existing_problem(outputs: Iterable[Path], key: str, overwrite: str) -> str | None:
    """Why the `outputs` cannot be written without the setting `overwrite` (one line), or None: one exists."""
    there = [p for p in outputs if p.exists() or p.is_symlink()]
    if not there:
        return None
    more = f" (and {len(there) - 1} more)" if len(there) > 1 else ""
    return f"{key}: {there[0]}{more} exists already: set {overwrite}=true to replace it, or choose another {key}"


def replace_file(target: Path, write: Callable[[Path], object], what: str) -> Path:
    """Write `target` by `write(temporary path)`, then give it the user's mode and rename it onto `target` (a link
    there is replaced, not followed). Returns `target`.

    Raises:
        ConfigError: `target` is a folder (`what` names the setting or file in the message); the temporary file
            is removed, what was at `target` kept.
    """
    if target.is_dir() and not target.is_symlink():
        raise ConfigError(f"{what} {target} is a folder: remove it or choose another path")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        write(tmp)
        os.chmod(tmp, user_mode())
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return target


def real_folder(folder: Path) -> Path:
    """`folder` as a folder of its own: a link in its place is removed (never written through), the folder made."""
    if folder.is_symlink():
        folder.unlink()
    folder.mkdir(parents=True, exist_ok=True)
    return folder


__all__ = ["existing_problem", "inputs_problem", "inside", "real_folder", "replace_file", "user_mode"]
