"""Package lookups that libraries repeat on every training step, answered once per process.

accelerate's wrapped optimizer asks `is_lomo_available()` twice in every `step()`; each answer searches
`sys.path` (`importlib.util.find_spec`) and reads package metadata. Whether a package is installed does not
change while a run trains, so the answer is kept after the first lookup.
"""

from __future__ import annotations

import functools


def remember_package_lookups() -> None:
    """Make accelerate's per-step optional-package checks look the package up once (idempotent)."""
    import accelerate.optimizer as optimizer

    check = optimizer.is_lomo_available
    if not isinstance(check, functools._lru_cache_wrapper):
        optimizer.is_lomo_available = functools.cache(check)
