"""qie: LoRA fine-tuning of Qwen-Image-Edit with an embedding cache.

`qie.compose(stage, overrides)` builds the config a CLI stage would; `qie.Trainer(cfg)` runs the stages
from Python. Both are imported on first use, so `import qie` stays cheap.
"""

from typing import Any

__version__ = "0.1.0"


def _conf_from_checkout() -> None:
    """Serve the config tree at the repository root (`conf/`) as `qie.conf` when qie runs from its checkout
    (`PYTHONPATH=.`, or an editable install, whose finder maps `qie.conf` to the same folder by `package_dir` in
    setup.cfg). A wheel holds the tree as `qie/conf/` beside this file, and that one is used."""
    import importlib.util
    import os
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    tree = os.path.join(os.path.dirname(here), "conf")
    init = os.path.join(tree, "__init__.py")
    # A wheel's tree has its __init__.py; a checkout may still hold a stale qie/conf/__pycache__ from before the move.
    if os.path.isfile(os.path.join(here, "conf", "__init__.py")) or not os.path.isfile(init):
        return
    spec = importlib.util.spec_from_file_location(f"{__name__}.conf", init, submodule_search_locations=[tree])
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    globals()["conf"] = module  # as the import system binds a submodule it loads to its package


_conf_from_checkout()


def __getattr__(name: str) -> Any:
    if name == "compose":
        from qie.config import compose

        return compose
    if name in ("Trainer", "EditDataset", "cache_manager"):
        from qie import api

        return getattr(api, name)
    if name in ("EmbeddingCacheManager", "check_cache_exists"):
        from qie.embedding import manager as embedding_cache

        return getattr(embedding_cache, name)
    raise AttributeError(f"module 'qie' has no attribute {name!r}")


__all__ = [
    "compose",
    "Trainer",
    "EditDataset",
    "cache_manager",
    "EmbeddingCacheManager",
    "check_cache_exists",
    "__version__",
]
