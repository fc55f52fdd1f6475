"""The cache backend a `cache` config node names, built by `hydra.utils.instantiate` at a stage's edge.

The node holds two kinds of keys: those of the `CacheConfig` schema (the stages' `mode`, `on_missing`, `types`,
encoder devices, ...; `dir`, `verify_reads` and the remote backend's settings) and the backend's own. A schema key
goes to a backend whose constructor names it (`dir` and `verify_reads` also to one that takes `**kwargs`); every
key the schema does not know is the backend's own, so a backend from outside qie is configured as
`cache._target_=pkg.Cls +cache.param=value`.
"""

from __future__ import annotations

import inspect
from dataclasses import fields
from typing import Any

from omegaconf import DictConfig, OmegaConf

from qie.cache.base import CacheBackend
from qie.config.cache import CacheConfig
from qie.config.targets import target_class
from qie.errors import ConfigError, QieError

# Schema keys passed to a constructor that takes any keyword (`**kwargs`); others only where named.
SHARED_KEYS = ("dir", "verify_reads")
SCHEMA_KEYS = frozenset(f.name for f in fields(CacheConfig))


def backend_class(target: str) -> type:
    """The class `cache._target_` names.

    Raises:
        ConfigError: no importable class at that dotted path.
    """
    return target_class("cache._target_", target, "a dotted path such as 'qie.cache.ssd.SsdBackend'")


def _parameters(cls: type) -> tuple[set[str], bool]:
    """The keyword parameters of `cls`'s constructor, and whether it takes any keyword (`**kwargs`)."""
    params = inspect.signature(cls).parameters.values()
    named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return named, any(p.kind is p.VAR_KEYWORD for p in params)


def own_keys(node: DictConfig) -> list[str]:
    """The keys of a `cache` node that the schema does not know: the backend's own settings."""
    return [k for k in node.keys() if k not in SCHEMA_KEYS]


def backend_problem(node: DictConfig) -> str | None:
    """Why the backend's own keys of `node` do not fit its constructor (one line), or None; builds nothing."""
    extra = own_keys(node)
    if not extra:
        return None
    target = node.get("_target_")
    named, any_keyword = _parameters(backend_class(target))
    unknown = [k for k in extra if k not in named and not any_keyword]
    if not unknown:
        return None
    return (
        f"unknown key cache.{unknown[0]}: valid keys of 'cache' are {', '.join(sorted(SCHEMA_KEYS))}, and "
        f"{target}'s parameters: {', '.join(sorted(named)) or 'none'}"
    )


def backend_arguments(node: DictConfig, **overrides: Any) -> dict[str, Any]:
    """The constructor arguments of the backend `node` names: the schema's keys its constructor names (`dir` and
    `verify_reads` also for `**kwargs`), the node's own keys, and `overrides` (stage decisions such as precompute's
    `verify_reads`)."""
    named, any_keyword = _parameters(backend_class(node.get("_target_")))
    args = {k: node.get(k) for k in SCHEMA_KEYS if k in named or (any_keyword and k in SHARED_KEYS)}
    args.update({k: v for k, v in overrides.items() if k in named or any_keyword})
    args.update({k: node[k] for k in own_keys(node)})
    return {k: OmegaConf.to_container(v, resolve=True) if OmegaConf.is_config(v) else v for k, v in args.items()}


def build_backend(node: DictConfig, **overrides: Any) -> CacheBackend:
    """The backend of a `cache` config node, built with `hydra.utils.instantiate`.

    Args:
        node: `cfg.cache`.
        overrides: settings the stage decides (e.g. `verify_reads=True` for precompute's `cache.repair`); passed
            only to a constructor that names them.

    Raises:
        ConfigError: `_target_` names no class, the constructor refuses the arguments, or the object built does
            not implement `CacheBackend`; a backend's own QieError (e.g. `cache.dir` not set) as it is.
    """
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    target = node.get("_target_")
    args = backend_arguments(node, **overrides)
    try:
        backend = instantiate({"_target_": target, **args})
    except InstantiationException as e:
        cause = e.__cause__
        if isinstance(cause, QieError):
            raise cause from None
        shown = ", ".join(f"{k}={v!r}" for k, v in args.items())
        raise ConfigError(f"cache._target_={target!r} cannot be built with ({shown}): {cause or e}") from None
    if not isinstance(backend, CacheBackend):
        raise ConfigError(f"cache._target_={target!r} does not implement the CacheBackend protocol")
    return backend


def default_backend(dir: str) -> CacheBackend:
    """The backend the `cache` schema names by default, on the folder `dir` (the notebook API's cache)."""
    return build_backend(OmegaConf.structured(CacheConfig(dir=str(dir))))


__all__ = ["backend_class", "backend_problem", "build_backend", "default_backend", "own_keys"]
