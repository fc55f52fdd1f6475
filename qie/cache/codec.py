"""The entry codec: an entry is the bytes of one safetensors file, whatever holds the bytes.

The header metadata records the schema, the type, the entry's key, each tensor's dtype and shape (in insertion
order), a checksum of the tensor bytes (`xxh3_64`, ~20 GB/s) and the entry's own facts (`Entry.meta`). A reader
checks the header against the data and the key it looks up (another entry's file copied or renamed over this key's
is refused); with `verify` it also recomputes the checksum, which finds any bit flip in the tensor bytes. Entries
written before keys were recorded carry none and are read as before.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass

import safetensors.torch
import torch
import xxhash

from qie.types import SCHEMA_VERSION

_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "U16": torch.uint16,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I32": torch.int32,
    "U32": torch.uint32,
    "F32": torch.float32,
    "F64": torch.float64,
    "I64": torch.int64,
    "U64": torch.uint64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
_json = json.JSONDecoder().decode
CHECKSUM = "xxh3_64"


class CorruptError(Exception):
    """A cache file that does not hold a readable entry of the expected type."""


class Entry(dict):
    """An entry: tensors by name (a dict), `meta` (a few str -> str facts stored with them) and, for an
    entry read back, the `checksum` stored with it (not recomputed unless a read verifies)."""

    def __init__(self, tensors=(), meta: dict[str, str] | None = None, checksum: str | None = None) -> None:
        super().__init__(tensors)
        self.meta: dict[str, str] = dict(meta or {})
        self.checksum = checksum


def checksum(tensors) -> str:
    """`xxh3_64:<hex>` of the tensors' bytes, in the given order (a dict's insertion order)."""
    h = xxhash.xxh3_64()
    for t in tensors.values() if isinstance(tensors, dict) else tensors:
        if t.numel():
            h.update(memoryview(t.detach().reshape(-1).view(torch.uint8).numpy()))
    return f"{CHECKSUM}:{h.hexdigest()}"


def cpu_copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU copy of `t` that shares no memory with it (dtype kept)."""
    return t.detach().to("cpu", copy=True, memory_format=torch.contiguous_format)


def encode(
    tensors: dict[str, torch.Tensor], type: str, meta: dict[str, str] | None = None, key: str | None = None
) -> bytes:
    """Safetensors bytes of the entry, its header metadata describing and checksumming it (and naming `key`)."""
    # Clones: safetensors refuses tensors sharing memory, and views of big buffers would save the rest.
    flat = {k: cpu_copy(t) for k, t in tensors.items()}
    listing = {k: [dtype_name(t.dtype), list(t.shape)] for k, t in flat.items()}
    own = {"schema": str(SCHEMA_VERSION), "type": type, "tensors": json.dumps(listing), "checksum": checksum(flat)}
    own["meta"] = json.dumps(dict(meta or {}), sort_keys=True)
    if key is not None:
        own["key"] = key
    return safetensors.torch.save(flat, metadata=own)


@dataclass
class Header:
    """What a file's header says: its length, the checksum, the tensor spans and the entry's meta."""

    length: int
    checksum: str
    spans: list[tuple[int, int, str, torch.dtype, list[int]]]  # (start, end, name, dtype, shape), by offset
    names: list[str]  # in the order they were written
    meta: dict[str, str]
    key: str | None = None  # the key it was written under (None: written before keys were recorded)


def parse_header(head: bytes | memoryview, size: int, type: str, key: str | None = None) -> Header:
    """Check a file's leading bytes (at least its header) against its size, the expected type and (given) the key
    it is read under.

    Raises:
        CorruptError: with the reason, for a truncated, garbage, wrong-schema or wrong-type file, or one that holds
            the entry of another key.
    """
    if size < 8 or len(head) < 8:
        raise CorruptError(f"file is {size} bytes, too short for a safetensors header")
    hlen = int.from_bytes(head[:8], "little")
    if hlen > size - 8 or hlen > len(head) - 8:
        raise CorruptError(f"header length {hlen} exceeds the file size {size} (truncated?)")
    try:
        header = _json(bytes(head[8 : 8 + hlen]).decode("utf-8"))
        own = header.pop("__metadata__")
        schema, stored_type, listing = own["schema"], own["type"], _json(own["tensors"])
        if schema == str(SCHEMA_VERSION):
            digest, meta, stored_key = own["checksum"], _json(own["meta"]), own.get("key")
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CorruptError(f"unreadable header or metadata ({e.__class__.__name__}: {e})") from None
    if schema != str(SCHEMA_VERSION):
        raise CorruptError(f"schema {schema!r}, expected {SCHEMA_VERSION}")
    if stored_type != type:
        raise CorruptError(f"holds a {stored_type!r} entry, expected {type!r}")
    if key is not None and stored_key is not None and stored_key != key:
        raise CorruptError(wrong_key(stored_key))
    if not isinstance(listing, dict) or set(listing) != set(header):
        raise CorruptError("header tensors do not match the metadata's tensor list")
    if not (isinstance(digest, str) and digest.startswith(f"{CHECKSUM}:")) or not isinstance(meta, dict):
        raise CorruptError(f"bad checksum {digest!r} or meta field in the header metadata")
    try:
        spans = sorted(_span(name, spec, header[name]) for name, spec in listing.items())
    except (ValueError, KeyError, TypeError) as e:
        raise CorruptError(f"bad tensor header ({e.__class__.__name__}: {e})") from None
    pos = 0
    for start, end, name, _, _ in spans:
        if start != pos:
            raise CorruptError(f"tensor {name!r} starts at {start}, expected {pos}")
        pos = end
    if size - 8 - hlen != pos:
        raise CorruptError(f"data holds {size - 8 - hlen} bytes, the header describes {pos} (truncated?)")
    return Header(hlen, digest, spans, list(listing), meta, stored_key)


def wrong_key(stored_key: str) -> str:
    """Why a file holding the entry of `stored_key` is no entry of the key it is stored under."""
    return f"holds the entry of key {stored_key} (another entry's file was copied or renamed here)"


def quick_header(head: bytes, size: int, type: str, key: str | None = None) -> tuple[str, dict[str, str]] | None:
    """(checksum, meta) when the header names this schema, type and (when it records one) `key`, and the file is as
    long as it says; None otherwise. The cheap check of `intact` (a tenth of `parse_header`'s work); reads check the
    rest."""
    try:
        hlen = int.from_bytes(head[:8], "little")
        if size < 8 or hlen > size - 8 or hlen > len(head) - 8:
            return None
        header = _json(head[8 : 8 + hlen].decode("utf-8"))
        own = header.pop("__metadata__")
        if own["schema"] != str(SCHEMA_VERSION) or own["type"] != type or not header:
            return None
        if key is not None and own.get("key", key) != key:
            return None
        end = max(int(info["data_offsets"][1]) for info in header.values())
        if size != 8 + hlen + end or not own["checksum"].startswith(f"{CHECKSUM}:"):
            return None
        return own["checksum"], (_json(own["meta"]) if own["meta"] != "{}" else {})
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError):
        return None


def decode(buf: torch.Tensor, type: str, verify: bool = False, key: str | None = None) -> Entry:
    """Parse safetensors bytes (a uint8 tensor) into the entry; the tensors are views of `buf`, so
    reading costs one copy from the OS. With `verify`, the checksum of the tensor bytes is checked too.

    Raises:
        CorruptError: with the reason, for a truncated, garbage, wrong-schema or wrong-type file, one that holds
            the entry of another key than `key` (when given), or (with `verify`) tensor bytes that do not match
            their checksum.
    """
    raw = buf.numpy()
    head = parse_header(memoryview(raw), len(raw), type, key)
    if sys.byteorder != "little":
        lib = safetensors.torch.load(raw.tobytes())
        return Entry({name: lib[name] for name in head.names}, head.meta, head.checksum)
    out = {}
    base = 8 + head.length
    for start, end, name, dtype, shape in head.spans:
        if start == end:
            out[name] = torch.empty(shape, dtype=dtype)  # frombuffer refuses empty ranges
        elif (base + start) % dtype.itemsize:
            out[name] = buf[base + start : base + end].clone().view(dtype).reshape(shape)
        else:  # a view of `buf`: no copy
            count = (end - start) // dtype.itemsize
            out[name] = torch.frombuffer(raw, dtype=dtype, count=count, offset=base + start).reshape(shape)
    entry = Entry({name: out[name] for name in head.names}, head.meta, head.checksum)
    if verify and checksum(entry) != head.checksum:
        raise CorruptError(f"checksum mismatch: the tensor bytes changed after they were written ({head.checksum})")
    return entry


def _span(name: str, spec: list, info: dict) -> tuple[int, int, str, torch.dtype, list[int]]:
    """(start, end, name, dtype, shape) of one tensor, checked against the metadata's [dtype, shape]."""
    dtype_name_, shape = spec
    dtype = _DTYPES.get(info["dtype"])
    if not all(type(d) is int and d >= 0 for d in shape):
        raise ValueError(f"tensor {name!r}: bad shape {shape}")
    if dtype is None or info["dtype"] != dtype_name_ or info["shape"] != shape:
        raise ValueError(f"tensor {name!r}: header {info} disagrees with metadata {spec}")
    start, end = info["data_offsets"]
    numel = 1
    for d in shape:
        numel *= d
    if end - start != numel * dtype.itemsize:
        raise ValueError(f"tensor {name!r}: offsets {start}..{end} do not fit {dtype_name_}{shape}")
    return start, end, name, dtype, shape


def dtype_name(dtype: torch.dtype) -> str:
    for name, d in _DTYPES.items():
        if d == dtype:
            return name
    raise ValueError(f"dtype {dtype} cannot be stored in the cache")
