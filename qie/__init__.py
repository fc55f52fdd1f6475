"""qie: LoRA fine-tuning of Qwen-Image-Edit with an embedding cache.

`qie.compose(stage, overrides)` builds the config a CLI stage would; `qie.Trainer(cfg)` runs the stages
from Python. Both are imported on first use, so `import qie` stays cheap.
"""

from typing import Any

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "compose":
        from qie.checks import compose

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
