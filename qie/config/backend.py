"""The cache backend a `cache` config node names, built by `hydra.utils.instantiate` at a stage's edge.

The node holds the stages' settings (the `CacheConfig` schema: `dir`, `mode`, `verify_reads`, `on_missing`,
`types`, encoder devices, ...) and, under `cache.backend`, the backend's own: `_target_` names its class and every
other key is an argument of its constructor, instantiated as written (`cache=remote cache.backend.url=s3://...`;
a backend from outside qie: `cache.backend._target_=pkg.Cls +cache.backend.param=value`). The stages give two of
their settings to a constructor that names them (or takes `**kwargs`): `dir` (`cache.dir`, the cache's folder on
this node) and `verify_reads`, and a stage may decide more (`build_backend`'s `overrides`). Its keys are checked
against the class's constructor when the config is (`qie.checks.backend`).
"""

from __future__ import annotations

import inspect
from dataclasses import fields
from typing import Any

from qie.cache.base import CacheBackend
from qie.config.cache import CacheConfig
from qie.config.targets import target_class
from qie.errors import ConfigError, QieError

# The stages' settings a backend's constructor is given when it names them (or takes any keyword).
STAGE_KEYS = ("dir", "verify_reads")
SCHEMA_KEYS = frozenset(f.name for f in fields(CacheConfig))  # the stages' own settings


def backend_class(target: str) -> type:
    """The class `cache.backend._target_` names.

    Raises:
        ConfigError: no importable class at that dotted path.
    """
    return target_class("cache.backend._target_", target, "a dotted path such as 'qie.cache.ssd.SsdBackend'")


def constructor_keywords(cls: type) -> tuple[set[str], bool]:
    """The keyword parameters of `cls`'s constructor, and whether it takes any keyword (`**kwargs`)."""
    params = inspect.signature(cls).parameters.values()
    named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return named, any(p.kind is p.VAR_KEYWORD for p in params)


def backend_arguments(cache: CacheConfig, **overrides: Any) -> dict[str, Any]:
    """The constructor arguments of the backend `cache` names: its own keys as written, and the stages' `dir` and
    `verify_reads` and `overrides` (stage decisions such as precompute's `verify_reads`) where it takes them."""
    backend = cache.backend
    target = backend.get("_target_")
    named, any_keyword = constructor_keywords(backend_class(target))
    given = {"dir": cache.dir, "verify_reads": cache.verify_reads, **overrides}
    args = {k: v for k, v in given.items() if k in named or any_keyword}
    args.update({k: v for k, v in backend.items() if k != "_target_"})
    return args


def build_backend(cache: CacheConfig, **overrides: Any) -> CacheBackend:
    """The backend of a typed `cache` group (`qie.config.typed(cfg.cache)`), built with `hydra.utils.instantiate`.

    Args:
        cache: the cache group.
        overrides: settings the stage decides (e.g. `verify_reads=True` for precompute's `cache.repair`); passed
            only to a constructor that names them.

    Raises:
        ConfigError: `_target_` names no class, the constructor refuses the arguments, or the object built does
            not implement `CacheBackend`; a backend's own QieError (e.g. `cache.dir` not set) as it is.
    """
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    target = cache.backend.get("_target_")
    args = backend_arguments(cache, **overrides)
    try:
        backend = instantiate({"_target_": target, **args}, _convert_="all")
    except InstantiationException as e:
        cause = e.__cause__
        if isinstance(cause, QieError):
            raise cause from None
        shown = ", ".join(f"{k}={v!r}" for k, v in args.items())
        raise ConfigError(f"cache.backend._target_={target!r} cannot be built with ({shown}): {cause or e}") from None
    if not isinstance(backend, CacheBackend):
        raise ConfigError(f"cache.backend._target_={target!r} does not implement the CacheBackend protocol")
    return backend


def default_backend(dir: str) -> CacheBackend:
    """The backend the `cache` schema names by default, on the folder `dir` (the notebook API's cache)."""
    return build_backend(CacheConfig(dir=str(dir)))


__all__ = [
    "SCHEMA_KEYS",
    "STAGE_KEYS",
    "backend_class",
    "build_backend",
    "constructor_keywords",
    "default_backend",
]
