"""Sample keys remembered by the signature of a sample's inputs, so a warm start stats instead of hashing.

A sample's cache keys depend on its prompt, the bytes of its image files and the KeyContext. The FileHasher
remembers each image's hash by the file's stat signature; this memo goes one step further and remembers the
sample's keys by (prompt, each image's path and stat signature) under a token of the KeyContext. An unchanged
sample then costs one stat per image and a dictionary lookup: no image hash index to load, no key to hash.
A changed image changes its signature (its ctime, which no tool can set back), so its sample misses and its
keys are computed again, exactly as without the memo.

Kept in the cache folder as `sample_keys/<context token>.safetensors`: one row of fixed-size bytes per
sample (a 16-byte signature digest; the 32-byte keys of its stored entry types, zeros for a type it lacks).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import secrets
from collections.abc import Callable, Sequence
from pathlib import Path

from qie.data.keys import KeyContext
from qie.data.samples import Sample

log = logging.getLogger(__name__)

# The stored entry types whose keys a row holds; a mask type shares its embedding's key.
ROW_TYPES = ("pixel_latent", "control_latent", "layer_latent", "prompt_embed", "empty_prompt_embed")
MASK_OF = {"prompt_embed": "prompt_embeds_mask", "empty_prompt_embed": "empty_prompt_embeds_mask"}
SIG_BYTES, KEY_BYTES = 16, 32
ROW_BYTES = KEY_BYTES * len(ROW_TYPES)
_ABSENT = bytes(KEY_BYTES)


def context_token(ctx: KeyContext) -> str:
    """A name for everything besides the sample that keys depend on."""
    text = json.dumps(dataclasses.asdict(ctx), sort_keys=True)
    return hashlib.blake2b(text.encode(), digest_size=12).hexdigest()


def input_signature(sample: Sample, seen: dict[str, str | OSError] | None = None) -> bytes:
    """Digest of the sample's prompt and each image's absolute path and (size, mtime_ns, ctime_ns, inode).

    Args:
        seen: image signatures already taken in this pass (path -> signature text, or the stat's error);
            filled in. Samples sharing an image (several prompts on one image pair) stat it once per pass.

    Raises:
        OSError: an image cannot be stat'ed.
    """
    parts = [sample.prompt]
    if sample.target is not None:
        parts.append("t" + _image_signature(sample.target, seen))
    parts += ["c" + _image_signature(p, seen) for p in sample.controls]
    parts += ["l" + _image_signature(p, seen) for p in sample.layers]
    return hashlib.blake2b("\0\0".join(parts).encode("utf-8", "surrogatepass"), digest_size=SIG_BYTES).digest()


def _image_signature(path: str | os.PathLike, seen: dict[str, str | OSError] | None) -> str:
    p = os.fspath(path)
    if seen is not None and (known := seen.get(p)) is not None:
        if isinstance(known, OSError):
            raise known
        return known
    full = p if p.startswith("/") else os.path.abspath(p)
    try:
        st = os.stat(full)
    except OSError as e:
        if seen is not None:
            seen[p] = e
        raise
    text = f"{full}\0{st.st_size} {st.st_mtime_ns} {st.st_ctime_ns} {st.st_ino}"
    if seen is not None:
        seen[p] = text
    return text


def _row(keys: dict[str, str]) -> bytes | None:
    """The keys of the stored types as one row; None when a key is not a 64-digit hex digest."""
    try:
        parts = [bytes.fromhex(keys[t]) if t in keys else _ABSENT for t in ROW_TYPES]
    except ValueError:
        return None
    return b"".join(parts) if all(len(p) == KEY_BYTES for p in parts) else None


_ABSENT_HEX = _ABSENT.hex()
_HEX = 2 * KEY_BYTES
_SLOTS = [(i * _HEX, (i + 1) * _HEX, t, MASK_OF.get(t)) for i, t in enumerate(ROW_TYPES)]


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

    Args:
        folder: where the memo files live (`cache.dir/sample_keys`).
        context: the key context the keys are computed under (it names the file).
        compute: the sample's keys the slow way (image hashes + entry keys); called on a miss.
    """

    def __init__(self, folder: str | os.PathLike | None, context: KeyContext,
                 compute: Callable[[Sample], dict[str, str]]) -> None:  # fmt: skip
        self.path = Path(folder) / f"{context_token(context)}.safetensors" if folder is not None else None
        self.compute = compute
        self._rows: dict[bytes, bytes] | None = None
        self._new = 0
        self.hits = self.misses = 0

    def keys(self, sample: Sample) -> dict[str, str]:
        """The sample's keys (type -> key), as `compute` gives them.

        Raises:
            OSError: an image cannot be stat'ed or read.
        """
        return self._keys(sample, None)

    def keys_all(self, samples: Sequence[Sample]) -> list[dict[str, str] | OSError]:
        """Each sample's keys, or the error that kept it from being keyed (an image that cannot be stat'ed or
        read); an image shared by several samples is stat'ed once in this pass."""
        seen: dict[str, str | OSError] = {}
        out: list[dict[str, str] | OSError] = []
        for sample in samples:
            try:
                out.append(self._keys(sample, seen))
            except OSError as e:
                out.append(e)
        return out

    def _keys(self, sample: Sample, seen: dict[str, str | OSError] | None) -> dict[str, str]:
        rows = self._load()
        sig = input_signature(sample, seen)
        row = rows.get(sig)
        if row is not None:
            self.hits += 1
            return _keys(row)
        self.misses += 1
        keys = self.compute(sample)
        # Stat again after hashing: a file rewritten meanwhile is not remembered under its old signature.
        if (row := _row(keys)) is not None and input_signature(sample) == sig:
            rows[sig] = row
            self._new += 1
        return keys

    def save(self) -> None:
        """Write the memo (atomically) when this object learnt new rows; a failure is logged, not raised: the
        memo only saves time."""
        if self.path is None or not self._new or self._rows is None:
            return
        import numpy as np
        from safetensors.numpy import save_file

        sigs = np.frombuffer(b"".join(self._rows), dtype=np.uint8).reshape(-1, SIG_BYTES)
        rows = np.frombuffer(b"".join(self._rows.values()), dtype=np.uint8).reshape(-1, ROW_BYTES)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            save_file({"signatures": sigs, "keys": rows}, str(tmp), metadata={"format": "qie-sample-keys/1"})
            os.replace(tmp, self.path)
            self._new = 0
        except OSError as e:
            log.warning("could not save the sample key memo %s (%s)", self.path, e)
            tmp.unlink(missing_ok=True)

    def _load(self) -> dict[bytes, bytes]:
        if self._rows is None:
            self._rows = _read(self.path) if self.path is not None else {}
        return self._rows


def _read(path: Path) -> dict[bytes, bytes]:
    """The memo's rows; an unreadable memo is logged and treated as empty."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="numpy") as f:
            if (f.metadata() or {}).get("format") != "qie-sample-keys/1":
                raise ValueError("unknown format")
            sigs, rows = f.get_tensor("signatures").tobytes(), f.get_tensor("keys").tobytes()
    except FileNotFoundError:
        return {}
    except Exception as e:  # safetensors raises its own error types for a damaged file
        log.warning("sample key memo %s is unreadable (%s); computing keys without it", path, e)
        return {}
    n = len(sigs) // SIG_BYTES
    if len(rows) != n * ROW_BYTES:
        log.warning("sample key memo %s is damaged (columns differ); computing keys without it", path)
        return {}
    return {sigs[i * SIG_BYTES : (i + 1) * SIG_BYTES]: rows[i * ROW_BYTES : (i + 1) * ROW_BYTES] for i in range(n)}
