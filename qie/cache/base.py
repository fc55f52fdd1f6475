"""The cache backend protocol, its report types, the checks every backend shares, and the entry codec.

An entry is stored as the bytes of one safetensors file (`encode`/`decode`), whatever holds the bytes.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import safetensors.torch
import torch

from qie.types import CACHE_TYPES, SCHEMA_VERSION

Entry = dict[str, torch.Tensor]

_KEY_RE = re.compile(r"[0-9A-Za-z_-]{2,128}")

_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "U16": torch.uint16,
    "F16": torch.float16, "BF16": torch.bfloat16, "I32": torch.int32, "U32": torch.uint32,
    "F32": torch.float32, "F64": torch.float64, "I64": torch.int64, "U64": torch.uint64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}  # fmt: skip
_json = json.JSONDecoder().decode


class CorruptError(Exception):
    """A cache file that does not hold a readable entry of the expected type."""


@dataclass
class CorruptEntry:
    """An entry that cannot be read back: where it is and why."""

    type: str
    key: str
    path: str
    reason: str


@dataclass
class VerifyReport:
    """What `verify` found: entries checked, the corrupt ones, and how many files it removed."""

    checked: int = 0
    corrupt: list[CorruptEntry] = field(default_factory=list)
    removed: int = 0
    # Temp files of writers that died mid-write; never entries, listed so `fix` can sweep them.
    stale_temp: list[str] = field(default_factory=list)
    temp_removed: int = 0

    @property
    def unfixed(self) -> int:
        """Corrupt entries still on disk."""
        return len(self.corrupt) - self.removed


@runtime_checkable
class CacheBackend(Protocol):
    """Stores entries (dicts of named tensors) under (type, key).

    `get` returns None on a miss and on an entry it cannot read (after logging a warning naming it);
    it never raises for a bad entry. Types are the names in `CACHE_TYPES`; `types=None` means all.
    """

    def get(self, type: str, key: str) -> Entry | None: ...

    def put(self, type: str, key: str, tensors: Entry) -> int: ...

    def exists(self, type: str, key: str) -> bool: ...

    def stats(self, types: Iterable[str] | None = None) -> dict[str, dict]: ...

    def clear(self, types: Iterable[str] | None = None) -> int: ...

    def verify(self, types: Iterable[str] | None = None, fix: bool = False) -> VerifyReport: ...


def check_type(type: str) -> str:
    """Return `type` if it is a cache type; raise ValueError naming the valid types otherwise."""
    if type not in CACHE_TYPES:
        raise ValueError(f"unknown cache type {type!r}: valid types are {', '.join(CACHE_TYPES)}")
    return type


def check_types(types: Iterable[str] | None) -> list[str]:
    """The cache types named by `types` (all of them for None), each checked, in canonical order."""
    if types is None:
        return list(CACHE_TYPES)
    if isinstance(types, str):
        types = [types]
    wanted = {check_type(t) for t in types}
    return [t for t in CACHE_TYPES if t in wanted]


def check_key(key: str) -> str:
    """Return `key` if it is safe as a file name (letters, digits, `_`, `-`); raise ValueError otherwise."""
    if not isinstance(key, str) or not _KEY_RE.fullmatch(key):
        raise ValueError(f"bad cache key {key!r}: expected 2-128 characters of [0-9A-Za-z_-]")
    return key


def check_entry(tensors: Entry) -> None:
    """Raise ValueError unless `tensors` is a non-empty dict of str -> torch.Tensor."""
    if not isinstance(tensors, dict) or not tensors:
        raise ValueError("a cache entry is a non-empty dict of name -> tensor")
    for name, t in tensors.items():
        if not isinstance(name, str) or not isinstance(t, torch.Tensor):
            raise ValueError(f"cache entry item {name!r}: expected a str name and a torch.Tensor")


def empty_stats(types: Iterable[str] | None) -> dict[str, dict]:
    """{type: {"count": 0, "bytes": 0}} for every requested type."""
    return {t: {"count": 0, "bytes": 0} for t in check_types(types)}


def cpu_copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU copy of `t` that shares no memory with it (dtype kept)."""
    return t.detach().to("cpu", copy=True, memory_format=torch.contiguous_format)


def encode(tensors: Entry, type: str) -> bytes:
    """Safetensors bytes of the entry; the header metadata records schema, type and each tensor's
    dtype and shape (in insertion order) so a reader can check the file against what was written."""
    check_entry(tensors)
    # Clones: safetensors refuses tensors sharing memory, and views of big buffers would save the rest.
    flat = {k: cpu_copy(t) for k, t in tensors.items()}
    listing = {k: [_dtype_name(t.dtype), list(t.shape)] for k, t in flat.items()}
    meta = {"schema": str(SCHEMA_VERSION), "type": type, "tensors": json.dumps(listing)}
    return safetensors.torch.save(flat, metadata=meta)


def decode(buf: torch.Tensor, type: str) -> Entry:
    """Parse safetensors bytes (a uint8 tensor) into the entry, checking the header against the data
    and the metadata; the tensors are views of `buf`, so reading costs one copy from the OS.

    Raises:
        CorruptError: with the reason, for a truncated, garbage, wrong-schema or wrong-type file.
    """
    raw = buf.numpy()
    size = len(raw)
    if size < 8:
        raise CorruptError(f"file is {size} bytes, too short for a safetensors header")
    hlen = int.from_bytes(raw[:8].tobytes(), "little")
    if hlen > size - 8:
        raise CorruptError(f"header length {hlen} exceeds the file size {size} (truncated?)")
    try:
        header = _json(raw[8 : 8 + hlen].tobytes().decode("utf-8"))
        meta = header.pop("__metadata__")
        schema, stored_type, listing = meta["schema"], meta["type"], _json(meta["tensors"])
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CorruptError(f"unreadable header or metadata ({e.__class__.__name__}: {e})") from None
    if schema != str(SCHEMA_VERSION):
        raise CorruptError(f"schema {schema!r}, expected {SCHEMA_VERSION}")
    if stored_type != type:
        raise CorruptError(f"holds a {stored_type!r} entry, expected {type!r}")
    if not isinstance(listing, dict) or set(listing) != set(header):
        raise CorruptError("header tensors do not match the metadata's tensor list")
    try:
        spans = sorted(_span(name, spec, header[name]) for name, spec in listing.items())
    except (ValueError, KeyError, TypeError) as e:
        raise CorruptError(f"bad tensor header ({e.__class__.__name__}: {e})") from None
    base, data_size, pos = 8 + hlen, size - 8 - hlen, 0
    for start, end, name, _, _ in spans:
        if start != pos:
            raise CorruptError(f"tensor {name!r} starts at {start}, expected {pos}")
        pos = end
    if data_size != pos:
        raise CorruptError(f"data holds {data_size} bytes, the header describes {pos} (truncated?)")
    if sys.byteorder != "little":
        lib = safetensors.torch.load(raw.tobytes())
        return {name: lib[name] for name in listing}
    out = {}
    for start, end, name, dtype, shape in spans:
        if start == end:
            out[name] = torch.empty(shape, dtype=dtype)  # frombuffer refuses empty ranges
        elif (base + start) % dtype.itemsize:
            out[name] = buf[base + start : base + end].clone().view(dtype).reshape(shape)
        else:  # a view of `buf`: no copy
            out[name] = torch.frombuffer(raw, dtype=dtype, count=(end - start) // dtype.itemsize, offset=base + start)
            out[name] = out[name].reshape(shape)
    return {name: out[name] for name in listing}


def _span(name: str, spec: list, info: dict) -> tuple[int, int, str, torch.dtype, list[int]]:
    """(start, end, name, dtype, shape) of one tensor, checked against the metadata's [dtype, shape]."""
    dtype_name, shape = spec
    dtype = _DTYPES.get(info["dtype"])
    if not all(type(d) is int and d >= 0 for d in shape):
        raise ValueError(f"tensor {name!r}: bad shape {shape}")
    if dtype is None or info["dtype"] != dtype_name or info["shape"] != shape:
        raise ValueError(f"tensor {name!r}: header {info} disagrees with metadata {spec}")
    start, end = info["data_offsets"]
    numel = 1
    for d in shape:
        numel *= d
    if end - start != numel * dtype.itemsize:
        raise ValueError(f"tensor {name!r}: offsets {start}..{end} do not fit {dtype_name}{shape}")
    return start, end, name, dtype, shape


def _dtype_name(dtype: torch.dtype) -> str:
    for name, d in _DTYPES.items():
        if d == dtype:
            return name
    raise ValueError(f"dtype {dtype} cannot be stored in the cache")
