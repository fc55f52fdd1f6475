"""Where the YAML config tree is on disk, for Hydra's search path.

The entry points hand this folder to `@hydra.main` as its primary config path (a `file://` entry of Hydra's search
path), and `qie.compose` to `initialize_config_dir`; plug-ins add their own trees the same way Hydra's apps do
(`hydra.searchpath`). Nothing is imported to find it: an installed qie holds the tree as `qie/conf/` beside its
modules; a checkout (run with `PYTHONPATH=.` or installed editable) has it at the repository root, `conf/`.
"""

from __future__ import annotations

from pathlib import Path

from qie.errors import ConfigError

# A file every tree has: a folder without it (a stale `qie/conf/__pycache__` of a checkout) is no tree.
_MARKER = "train.yaml"


def conf_dir() -> Path:
    """The config tree's folder: `qie/conf/` of an installed qie, else the checkout's `conf/`.

    Raises:
        ConfigError: neither holds the tree (an installation missing its package data).
    """
    package = Path(__file__).resolve().parents[1]
    for folder in (package / "conf", package.parent / "conf"):
        if (folder / _MARKER).is_file():
            return folder
    raise ConfigError(
        f"qie's config tree is missing: neither {package / 'conf'} nor {package.parent / 'conf'} holds {_MARKER}; "
        "reinstall qie (pip install -e . from its checkout)"
    )


def conf_path() -> str:
    """`conf_dir()` as `@hydra.main`'s `config_path` (an absolute folder)."""
    return str(conf_dir())


__all__ = ["conf_dir", "conf_path"]
