"""Sample keys remembered by the signature of a sample's inputs, so a warm start stats instead of hashing.

A sample's cache keys depend on its prompt, the bytes of its image files and the KeyContext. The FileHasher
remembers each image's hash by the file's stat signature; this memo goes one step further and remembers the
sample's keys by (prompt, each image's path and stat signature) under a token of the KeyContext. An unchanged
sample then costs one stat per image and a dictionary lookup: no image hash index to load, no key to hash.
A changed image changes its signature (its ctime, which no tool can set back), so its sample misses and its
keys are computed again, exactly as without the memo.

Kept in the cache folder as `sample_keys/<context token>.safetensors`: one row of fixed-size bytes per
sample (a 16-byte signature digest; the 32-byte keys of its stored entry types, zeros for a type it lacks). A
sample with the image of a sample field other than the built-in rejected result (`qie.data.fields`) has an entry
type a row has no place for: it is not remembered, its keys are computed at each start.

A whole list of samples is remembered too (`qie.data.sample_lists`, in `sample_keys/lists/`, the
rows of the list in its order): the digest covers every prompt, which image each sample names in each role, and
each distinct image's path and stat signature, so a list found again costs one stat per distinct image and a
pass over the samples' fields, not a signature and a lookup per sample (at a million samples, seconds).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import secrets
from collections.abc import Callable, Sequence
from itertools import chain
from operator import attrgetter
from pathlib import Path

from qie.data import file_stats, sample_lists
from qie.data.fields import field_named
from qie.data.keys import KeyContext
from qie.data.samples import Sample
from qie.types import TRAINING_TYPES

log = logging.getLogger(__name__)

# The stored entry types whose keys a row holds; a mask type shares its embedding's key.
ROW_TYPES = TRAINING_TYPES  # readiness reads a row's keys in this order
MASK_OF = {"prompt_embed": "prompt_embeds_mask", "empty_prompt_embed": "empty_prompt_embeds_mask"}
SIG_BYTES, KEY_BYTES = 16, 32
ROW_BYTES = KEY_BYTES * len(ROW_TYPES)
_ABSENT = bytes(KEY_BYTES)


def context_token(ctx: KeyContext) -> str:
    """A name for everything besides the sample that keys depend on."""
    text = json.dumps(dataclasses.asdict(ctx), sort_keys=True)
    return hashlib.blake2b(text.encode(), digest_size=12).hexdigest()


def input_signature(sample: Sample, seen: dict[str, str | OSError] | None = None, fresh: bool = False) -> bytes:
    """Digest of the sample's prompt and each image's absolute path and (size, mtime_ns, ctime_ns, inode).

    Args:
        seen: image signatures already taken in this pass (path -> signature text, or the stat's error);
            filled in. Samples sharing an image (several prompts on one image pair) stat it once per pass.
        fresh: stat each image now, not through `qie.data.file_stats` (a check after hashing them).

    Raises:
        OSError: an image cannot be stat'ed.
    """
    parts = [sample.prompt]
    if sample.target is not None:
        parts.append("t" + file_stats.signature(sample.target, seen, fresh))
    parts += ["c" + file_stats.signature(p, seen, fresh) for p in sample.controls]
    parts += ["l" + file_stats.signature(p, seen, fresh) for p in sample.layers]
    parts += [_field_letter(name) + file_stats.signature(p, seen, fresh) for name, p in sample.field_images]
    return hashlib.blake2b("\0\0".join(parts).encode("utf-8", "surrogatepass"), digest_size=SIG_BYTES).digest()


def _signatures(samples: Sequence[Sample], seen: dict[str, str | OSError] | None = None) -> list[bytes | OSError]:
    """`input_signature` of each sample (or the OSError of its first image that cannot be stat'ed), each image
    stat'ed once: samples that share an image share its path object (a manifest's scan), found by identity.
    `seen`: image signatures already taken in this pass (see `input_signature`)."""
    seen = {} if seen is None else seen
    held = []  # the path objects looked up, alive until the end of the pass (their ids stay theirs)
    known: tuple[dict[int, str], ...] = ({}, {}, {})  # target, control, layer texts
    fields: dict[tuple[str, int], str] = {}  # (field, id of its image) -> its text

    def image(path, role: int) -> str:
        """The role's letter and the image's signature text (raises the OSError of its stat)."""
        held.append(path)
        text = "tcl"[role] + file_stats.signature(path, seen)  # an OSError is remembered in `seen`
        known[role][id(path)] = text
        return text

    def field_image(name: str, path) -> str:
        held.append(path)
        text = fields[name, id(path)] = _field_letter(name) + file_stats.signature(path, seen)
        return text

    targets, controls, layers = (d.get for d in known)
    blake2b, out = hashlib.blake2b, []
    for s in samples:
        try:
            parts = [s.prompt]
            if (t := s.target) is not None:
                parts.append(targets(id(t)) or image(t, 0))
            for p in s.controls:
                parts.append(controls(id(p)) or image(p, 1))
            for p in s.layers:
                parts.append(layers(id(p)) or image(p, 2))
            for name, p in s.field_images:
                parts.append(fields.get((name, id(p))) or field_image(name, p))
        except OSError as e:
            out.append(e)
            continue
        out.append(blake2b("\0\0".join(parts).encode("utf-8", "surrogatepass"), digest_size=SIG_BYTES).digest())
    return out


def list_digest(samples: Sequence[Sample], seen: dict[str, str | OSError] | None = None) -> bytes | None:
    """A digest of everything the keys of `samples`, in their order, depend on besides the key context: each
    prompt, the images each sample names in each role (target, controls, layers, rejected), and each distinct
    image's `input_signature` text (absolute path, size, mtime_ns, ctime_ns, inode). None when an image cannot
    be stat'ed. Column-wise (C-level maps over the samples' fields), each distinct image stat'ed once; `seen` as
    in `input_signature`."""
    import numpy as np

    seen = {} if seen is None else seen
    h = hashlib.blake2b(sample_lists.FORMAT.encode(), digest_size=SIG_BYTES)
    prompts = list(map(attrgetter("prompt"), samples))
    h.update(np.fromiter(map(len, prompts), np.int64, len(prompts)).tobytes())
    h.update("\0".join(prompts).encode("utf-8", "surrogatepass"))
    number: dict[int, int] = {id(None): -1}
    images: list = []  # the distinct images, numbered in the order they are first named

    def refs(column: list) -> bytes:
        """The number of each path of `column` (-1 for None), new paths numbered as they come."""
        for key, path in dict(zip(map(id, column), column)).items():
            if key not in number:
                number[key] = len(images)
                images.append(path)
        return np.fromiter(map(number.__getitem__, map(id, column)), np.int64, len(column)).tobytes()

    for role in ("target", "controls", "layers"):
        column = list(map(attrgetter(role), samples))
        if role in ("controls", "layers"):  # tuples: their lengths, then their paths in a row
            h.update(np.fromiter(map(len, column), np.int64, len(column)).tobytes())
            column = list(chain.from_iterable(column))
        h.update(role.encode())
        h.update(refs(column))
    for name in sorted({name for s in samples for name, _ in s.field_images}):  # each field: one image or none
        h.update(f"field:{name}".encode())
        h.update(refs([dict(s.field_images).get(name) for s in samples]))
    texts = file_stats.signatures(images, seen)
    if texts is None:
        return None
    h.update("\0".join(texts).encode("utf-8", "surrogatepass"))
    return h.digest()


def _field_letter(name: str) -> str:
    """What marks the image of the sample field `name` in a signature (its declared `signature_mark`)."""
    return field_named(name).signature_mark


def _row(keys: dict[str, str]) -> bytes | None:
    """The keys of the stored types as one row; None when a key is not a 64-digit hex digest, or the sample has an
    entry type a row has no place for (a sample field's beyond the built-in one: such a sample is keyed each time)."""
    if any(t not in _ROW_OR_MASK for t in keys):
        return None
    try:
        parts = [bytes.fromhex(keys[t]) if t in keys else _ABSENT for t in ROW_TYPES]
    except ValueError:
        return None
    return b"".join(parts) if all(len(p) == KEY_BYTES for p in parts) else None


_ABSENT_HEX = _ABSENT.hex()
_HEX = 2 * KEY_BYTES
_SLOTS = [(i * _HEX, (i + 1) * _HEX, t, MASK_OF.get(t)) for i, t in enumerate(ROW_TYPES)]
_ROW_OR_MASK = frozenset((*ROW_TYPES, *MASK_OF.values()))


def _keys(row: bytes) -> dict[str, str]:
    text, keys = row.hex(), {}
    for start, end, t, mask in _SLOTS:
        key = text[start:end]
        if key != _ABSENT_HEX:
            keys[t] = key
            if mask is not None:
                keys[mask] = key
    return keys


class KeyMemo:
    """Sample keys by input signature; `folder` None keeps them in this object only.

    The remembered rows are kept as arrays sorted by signature (a million rows load in a fraction of a second,
    where a dictionary of them took many); `keys_all` looks every sample up at once.

    Args:
        folder: where the memo files live (`cache.dir/state/sample_keys`).
        context: the key context the keys are computed under (it names the file).
        compute: the sample's keys the slow way (image hashes + entry keys); called on a miss.
    """

    def __init__(
        self, folder: str | os.PathLike | None, context: KeyContext, compute: Callable[[Sample], dict[str, str]]
    ) -> None:
        self.path = Path(folder) / f"{context_token(context)}.safetensors" if folder is not None else None
        self.compute = compute
        self._table: _Table | None = None
        self._new: dict[bytes, bytes] = {}  # rows learnt by this object, not yet in the table
        lists = self.path.parent / "lists" if self.path is not None else None
        self.lists = sample_lists.RememberedLists(lists, context_token(context), ROW_BYTES)
        self.hits = self.misses = 0

    def keys(self, sample: Sample) -> dict[str, str]:
        """The sample's keys (type -> key), as `compute` gives them.

        Raises:
            OSError: an image cannot be stat'ed or read.
        """
        sig = input_signature(sample)
        row = self._new.get(sig) or self._load().find([sig])[0]
        if row is not None:
            self.hits += 1
            return _keys(row)
        return self._miss(sample, sig)

    def rows_all(self, samples: Sequence[Sample]):
        """The remembered keys of every sample as one (n, ROW_BYTES) uint8 array (each sample's keys of
        ROW_TYPES, zeros for a type it lacks), when every sample is remembered; None when one is not (a changed
        or unreadable image, a new sample: `keys_all` then keys them)."""
        import numpy as np

        if self._new:
            return None
        seen: dict[str, str | OSError] = {}
        digest = list_digest(samples, seen) if samples else None
        if digest is not None and (rows := self.lists.find(digest, len(samples))) is not None:
            self.hits += len(samples)
            return rows
        sigs = _signatures(samples, seen)
        if not all(isinstance(s, bytes) for s in sigs):  # an OSError: an image cannot be stat'ed
            return None
        table = self._load()
        if not len(table.sigs) and sigs:
            return None
        rows = np.empty((len(sigs), ROW_BYTES), np.uint8)
        for lo in range(0, len(sigs), _CHUNK):
            pos, hit = table.positions(sigs[lo : lo + _CHUNK])
            if not hit.all():
                return None
            rows[lo : lo + len(pos)] = table.rows[pos]
        self.hits += len(sigs)
        if digest is not None:
            self.lists.learn(digest, rows)
        return rows

    def keys_all(self, samples: Sequence[Sample]) -> list[dict[str, str] | OSError]:
        """Each sample's keys, or the error that kept it from being keyed (an image that cannot be stat'ed or
        read); an image shared by several samples is stat'ed once in this pass."""
        sigs = _signatures(samples)
        table, out = self._load(), []
        for lo in range(0, len(samples), _CHUNK):
            chunk = sigs[lo : lo + _CHUNK]
            rows = table.find([b"" if isinstance(sig, OSError) else sig for sig in chunk])
            for sample, sig, row in zip(samples[lo : lo + _CHUNK], chunk, rows):
                if isinstance(sig, OSError):
                    out.append(sig)
                    continue
                if row is None:
                    row = self._new.get(sig)
                if row is not None:
                    self.hits += 1
                    out.append(_keys(row))
                    continue
                try:
                    out.append(self._miss(sample, sig))
                except OSError as e:
                    out.append(e)
        return out

    def _miss(self, sample: Sample, sig: bytes) -> dict[str, str]:
        self.misses += 1
        keys = self.compute(sample)
        # Stat again after hashing: a file rewritten meanwhile is not remembered under its old signature.
        if (row := _row(keys)) is not None and input_signature(sample, fresh=True) == sig:
            self._new[sig] = row
        return keys

    def save(self) -> None:
        """Write the memo (atomically) when this object learnt new rows; a failure is logged, not raised: the
        memo only saves time."""
        self.lists.save()
        if self.path is None or not (self._new or (self._table is not None and self._table.resorted)):
            return
        import numpy as np
        from safetensors.numpy import save_file

        table = self._load()
        new_sigs = np.frombuffer(b"".join(self._new), dtype=np.uint8).reshape(-1, SIG_BYTES)
        new_rows = np.frombuffer(b"".join(self._new.values()), dtype=np.uint8).reshape(-1, ROW_BYTES)
        merged = _Table(
            np.concatenate([table.sigs.view(np.uint8).reshape(-1, SIG_BYTES), new_sigs]),
            np.concatenate([table.rows, new_rows]),
        )
        sigs = merged.sigs.view(np.uint8).reshape(-1, SIG_BYTES)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            save_file({"signatures": sigs, "keys": merged.rows}, str(tmp), metadata={"format": "qie-sample-keys/1"})
            os.replace(tmp, self.path)
            self._table, self._new = merged, {}
        except OSError as e:
            log.warning("could not save the sample key memo %s (%s)", self.path, e)
            tmp.unlink(missing_ok=True)

    def _load(self) -> _Table:
        if self._table is None:
            self._table = _read(self.path) if self.path is not None else _Table.empty()
        return self._table


_CHUNK = 1 << 16  # samples looked up at once


class _Table:
    """Rows of keys sorted by their signatures (rows of a memo written unsorted are sorted here), searched by
    the signatures' first 8 bytes and confirmed on all 16."""

    def __init__(self, sigs, rows) -> None:
        """`sigs` (n, SIG_BYTES) and `rows` (n, ROW_BYTES) uint8 arrays."""
        import numpy as np

        sigs, rows = np.ascontiguousarray(sigs), np.ascontiguousarray(rows)
        order = _order(sigs)
        # Written sorted by this version; a memo of an earlier one is sorted here (and saved sorted).
        self.resorted = len(order) > 1 and not bool(np.all(order[1:] >= order[:-1]))
        if self.resorted:
            by = np.argsort(order, kind="stable")
            sigs, rows, order = sigs[by], rows[by], order[by]
        self.sigs = sigs.view(f"V{SIG_BYTES}").reshape(-1)
        self.rows, self.order = rows, order

    @classmethod
    def empty(cls) -> _Table:
        import numpy as np

        return cls(np.zeros((0, SIG_BYTES), np.uint8), np.zeros((0, ROW_BYTES), np.uint8))

    def find(self, sigs: list[bytes]) -> list[bytes | None]:
        """The row of each signature, None where it has none (a signature that is not SIG_BYTES long has none)."""
        if not len(self.sigs) or not sigs:
            return [None] * len(sigs)
        pos, hit = self.positions(sigs)
        blob = self.rows[pos].tobytes()
        return [blob[i * ROW_BYTES : (i + 1) * ROW_BYTES] if h else None for i, h in enumerate(hit.tolist())]

    def positions(self, sigs: list[bytes]):
        """(where each signature's row would be, whether it is there) as arrays; the table is not empty."""
        import numpy as np

        sized = [len(s) == SIG_BYTES for s in sigs]
        wanted = np.frombuffer(b"".join(s if ok else bytes(SIG_BYTES) for s, ok in zip(sigs, sized)), np.uint8)
        wanted = wanted.reshape(-1, SIG_BYTES)
        pos = np.minimum(np.searchsorted(self.order, _order(wanted)), len(self.sigs) - 1)
        hit = (self.sigs[pos] == wanted.view(f"V{SIG_BYTES}").reshape(-1)) & np.array(sized)
        return pos, hit


def _order(sigs):
    """The sort key of (n, SIG_BYTES) signatures: their first 8 bytes as a number."""
    import numpy as np

    return np.ascontiguousarray(sigs[:, :8]).view(">u8").reshape(-1).astype(np.uint64)


def _read(path: Path) -> _Table:
    """The memo's rows; an unreadable memo is logged and treated as empty."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="numpy") as f:
            if (f.metadata() or {}).get("format") != "qie-sample-keys/1":
                raise ValueError("unknown format")
            sigs, rows = f.get_tensor("signatures"), f.get_tensor("keys")
        if sigs.ndim != 2 or rows.ndim != 2 or sigs.shape[1] != SIG_BYTES or rows.shape[1] != ROW_BYTES:
            raise ValueError("unexpected shapes")
    except FileNotFoundError:
        return _Table.empty()
    except Exception as e:  # safetensors raises its own error types for a damaged file
        log.warning("sample key memo %s is unreadable (%s); computing keys without it", path, e)
        return _Table.empty()
    if len(sigs) != len(rows):
        log.warning("sample key memo %s is damaged (columns differ); computing keys without it", path)
        return _Table.empty()
    return _Table(sigs, rows)
