"""A sample's logical entries over what a backend stores: the image-token prefix stored once, masks derived.

Qwen2.5-VL is causal and sees the control images before the instruction, so a prompt's embedding and the
empty prompt's embedding of the same control images agree on their first rows (the image tokens and the
template around them): bitwise on CPU in fp32; a GPU may pick other kernels for another sequence length and
change a last bit. So the empty-prompt embedding is stored whole (it is the base of its control-image set),
and a prompt embedding keeps only the rows after the prefix it shares with that base (`suffix`), with the
base's key and checksum in its meta. The prefix is found by comparing the rows when writing: rows equal
within the dtype's rounding are shared, and the largest difference is recorded (`prefix_max_diff`).

The mask types are never stored: prompt embeddings are stored unpadded, so a mask is all ones over the
embedding's rows, derived on read under the embedding's key.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

import torch

from qie.cache.base import CacheBackend, Entry, base_of
from qie.cache.codec import checksum
from qie.types import FIELD_TYPES, TRAINING_TYPES

# What is stored, bases before the entries that extend them (and the types of sample fields declared beyond the
# built-in one, `stored_order`).
STORED_TYPES = (
    "pixel_latent",
    "control_latent",
    "layer_latent",
    "rejected_latent",
    "empty_prompt_embed",
    "prompt_embed",
)
# Each mask type is derived from this embedding type, under the embedding's key.
MASK_OF = {"prompt_embeds_mask": "prompt_embed", "empty_prompt_embeds_mask": "empty_prompt_embed"}
BASE_TYPE = "empty_prompt_embed"
Pieces = tuple[torch.Tensor, ...]

assert set(STORED_TYPES) == set(TRAINING_TYPES)


def stored_order(types: Iterable[str]) -> list[str]:
    """`types` (stored types) in the order they are written: STORED_TYPES', then other sample fields' types."""
    types = set(types)
    return [t for t in STORED_TYPES if t in types] + [t for t in FIELD_TYPES if t in types and t not in STORED_TYPES]


# Rows are "equal within the dtype's rounding" when every element differs by at most this many units of the
# dtype's epsilon, relative to the element (or to the row's RMS, for elements near zero): the rounding a
# different summation order leaves. A different token differs by the order of the values themselves.
ROUNDING_EPS = 8


def shared_rows(embed: torch.Tensor, base: torch.Tensor) -> tuple[int, float]:
    """How many leading rows `embed` shares with `base` (equal within the dtype's rounding), and the largest
    absolute difference over those rows."""
    n = min(embed.shape[0], base.shape[0])
    if n == 0 or embed.shape[1:] != base.shape[1:] or embed.dtype != base.dtype or not embed.is_floating_point():
        return 0, 0.0
    a, b = embed[:n].reshape(n, -1).double(), base[:n].reshape(n, -1).double()
    diff = (a - b).abs()
    scale = torch.maximum(torch.maximum(a.abs(), b.abs()), b.pow(2).mean(dim=1, keepdim=True).sqrt())
    same = (diff <= ROUNDING_EPS * torch.finfo(embed.dtype).eps * scale).all(dim=1)
    rows = n if bool(same.all()) else int((~same).nonzero()[0, 0])
    return rows, float(diff[:rows].max()) if rows else 0.0


def prompt_entry(embed: torch.Tensor, base: Entry | None, base_key: str) -> tuple[dict, dict[str, str]]:
    """(tensors, meta) to store for a prompt embedding: its suffix after the prefix it shares with `base`
    (the empty-prompt entry stored under `base_key`), or the whole embedding when they share no row."""
    rows, max_diff = shared_rows(embed, base["embed"]) if base is not None else (0, 0.0)
    if rows == 0:
        return {"embed": embed}, {}
    meta = {
        "base": f"{BASE_TYPE}/{base_key}",
        "base_checksum": base.checksum or checksum(base),
        "prefix_rows": str(rows),
        "prefix_max_diff": repr(max_diff),
    }
    return {"suffix": embed[rows:]}, meta


def prompt_pieces(entry: Entry, lookup: Callable[[str, str], Entry | None]) -> Pieces | None:
    """The prompt embedding of a stored prompt entry as (prefix view, suffix), or None when its base is
    missing or is not the one it was cut against. `lookup(type, key)` reads the base."""
    if "embed" in entry:
        return (entry["embed"],)
    base = base_of(entry.meta)
    if base is None or "suffix" not in entry:
        return None
    found = lookup(base[0], base[1])
    rows = int(entry.meta.get("prefix_rows", -1))
    if found is None or found.checksum != base[2] or "embed" not in found or not 0 < rows <= len(found["embed"]):
        return None
    return (found["embed"][:rows], entry["suffix"])


def join(pieces: Pieces) -> torch.Tensor:
    """One tensor of the pieces (no copy for a single piece)."""
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def write_entries(backend: CacheBackend, keys: dict[str, str], entries: dict[str, dict]) -> dict[str, int]:
    """Store a sample's entries (type -> dict of tensors) under `keys`, the prompt embedding sharing its
    prefix with the empty-prompt entry (the one given here, or the one stored); the padding masks are not
    stored, a prompt entry's other tensors (`image_mask`) are stored as given.

    Returns:
        Bytes written per type.
    """
    written: dict[str, int] = {}
    base: Entry | None = None
    for type in stored_order(entries):
        tensors, meta = entries[type], {}
        if type == BASE_TYPE:
            base = Entry(tensors, {}, checksum(tensors))
        elif type == "prompt_embed":
            if base is None and BASE_TYPE in keys:
                base = backend.get(BASE_TYPE, keys[BASE_TYPE])
            stored, meta = prompt_entry(tensors["embed"], base, keys.get(BASE_TYPE, ""))
            tensors = {**stored, **_extras(tensors)}
        written[type] = backend.put(type, keys[type], tensors, meta)
    return written


def read_entries(backend: CacheBackend, keys: dict[str, str], types: Iterable[str]) -> tuple[dict, list[str]]:
    """A sample's stored entries of `types` and the types missing; a prompt entry comes back as
    {"embed": pieces} (a tuple of tensors: the base's prefix rows and the suffix, not copied) with the
    entry's other tensors (`image_mask`) as stored."""
    found: dict[str, dict] = {}
    missing = []
    types = list(types)
    order = sorted(types, key=lambda t: t == "prompt_embed")  # the base first
    fetched = None
    if backend.remote_reads and len(order) > 1:  # each read a round trip: let their waits overlap
        fetched = dict(zip(order, _fetcher().map(lambda t: backend.get(t, keys[t]), order)))
    for type in order:
        entry = fetched[type] if fetched is not None else backend.get(type, keys[type])
        if entry is not None and type == "prompt_embed":
            pieces = prompt_pieces(entry, _lookup(backend, keys, found))
            entry = None if pieces is None else {"embed": pieces, **_extras(entry)}
        if entry is None:
            missing.append(type)
        else:
            found[type] = entry
    return found, [t for t in types if t in missing]


_FETCHER: tuple[int, ThreadPoolExecutor] | None = None


def _fetcher() -> ThreadPoolExecutor:
    """Threads that fetch a sample's entries from a remote backend at once (one pool per process: a loader
    worker forked from a process that had one makes its own)."""
    global _FETCHER
    if _FETCHER is None or _FETCHER[0] != os.getpid():
        _FETCHER = (os.getpid(), ThreadPoolExecutor(8, thread_name_prefix="qie-fetch"))
    return _FETCHER[1]


def _extras(tensors: dict) -> dict:
    """A prompt entry's tensors besides its embedding (2.1's `image_mask`): stored and read back verbatim."""
    return {name: t for name, t in tensors.items() if name not in ("embed", "suffix")}


def _lookup(backend: CacheBackend, keys: dict[str, str], found: dict) -> Callable[[str, str], Entry | None]:
    def lookup(type: str, key: str) -> Entry | None:
        if key == keys.get(type) and isinstance(found.get(type), Entry):
            return found[type]
        return backend.get(type, key)

    return lookup


def read_logical(backend: CacheBackend, type: str, key: str) -> torch.Tensor | list[torch.Tensor] | None:
    """What the public type `type` holds under `key`, whole: a latent, the control latents (a list), a
    prompt embedding joined from its pieces, or a mask derived from its embedding. None on a miss."""
    if type in MASK_OF:
        embed = read_logical(backend, MASK_OF[type], key)
        return None if embed is None else torch.ones(embed.shape[0], dtype=torch.long)
    entry = backend.get(type, key)
    if entry is None:
        return None
    if type in ("control_latent", "layer_latent"):
        return [entry[str(i)] for i in range(len(entry))]
    if type == "pixel_latent" or type in FIELD_TYPES:
        return entry["latent"]
    if type == "prompt_embed":
        pieces = prompt_pieces(entry, backend.get)
        return None if pieces is None else join(pieces)
    return entry["embed"]


def nonfinite(entries: dict[str, dict]) -> list[str]:
    """`type/name` of every floating tensor in `entries` holding a NaN or an infinity."""
    return [
        f"{type}/{name}"
        for type, tensors in entries.items()
        for name, t in tensors.items()
        if t.is_floating_point() and not bool(torch.isfinite(t).all())
    ]
