"""The `cache` node against its backend's class, checked when the config is composed: the backend's own keys (under
`cache.backend`) its constructor takes, and a backend's key written at the stages' level named where it goes. The
class is imported (`qie.config.backend.backend_class`), nothing is built."""

from __future__ import annotations

from omegaconf import DictConfig

from qie.config.backend import SCHEMA_KEYS, STAGE_KEYS, backend_class, constructor_keywords


def backend_problem(node: DictConfig) -> str | None:
    """Why `node.backend` (`cfg.cache.backend`) does not fit its class (one line), or None; builds nothing: a key
    the stages give (`dir`, `verify_reads`), or a key its constructor does not take."""
    target = node.backend.get("_target_")
    named, any_keyword = constructor_keywords(backend_class(target))
    own = list(node.backend.keys())
    for key in own:
        if key in STAGE_KEYS:
            return f"cache.backend.{key} is the stages' setting: set cache.{key} (a backend that takes it is given it)"
    unknown = [k for k in own if k != "_target_" and k not in named and not any_keyword]
    if not unknown:
        return None
    takes = ", ".join(sorted(named - set(STAGE_KEYS) - {"read_ahead"})) or "no settings"
    return f"unknown key cache.backend.{unknown[0]}: {target} takes {takes}"


def misplaced_problem(node: DictConfig) -> str | None:
    """A key added to `cache` itself (`+cache.url=...`) that is a setting of its backend: where it belongs."""
    named, _ = constructor_keywords(backend_class(node.backend.get("_target_")))
    for key in node.keys():
        if key not in SCHEMA_KEYS and key in named:
            return f"cache.{key} is a setting of the backend: write cache.backend.{key}=... (its settings are there)"
    return None


__all__ = ["backend_problem", "misplaced_problem"]
