"""An index segment of a remote cache as bytes (`qie.cache.remote_index`): safetensors columns of keys, sizes,
checksums and each entry's number in a table of distinct bases (`qie-remote-index/2`); segments of the JSON form
written before (`qie-remote-index/1`) are read too."""

from __future__ import annotations

import json
import re
import struct
from operator import itemgetter, methodcaller

FORMAT = "qie-remote-index/2"
FORMAT_JSON = "qie-remote-index/1"  # segments written before: read, and replaced by the next merge
SUFFIXES = (".safetensors", ".json")  # the segment names of each form, the written one first

# (size in bytes, checksum, base as "type/key/checksum" or "")
Record = tuple[int, str, str]


def encode(entries: dict[str, Record], type: str) -> bytes:
    """A segment of `type` holding `entries`: safetensors columns (keys, sizes, checksums, each entry's number in
    the table of distinct bases), read back by `decode` without a parse per entry. Keys that are all hex digests
    are kept as their bytes, checksums of one algorithm as their digests' bytes (a million entries: 48 MB, not
    117)."""
    import numpy as np
    from safetensors.numpy import save

    records = list(entries.values())
    bases = list(dict.fromkeys(map(itemgetter(2), records)))
    number = {b: i for i, b in enumerate(bases)}
    keys, key_prefix = _packed(list(entries))
    checksums, checksum_prefix = _packed(list(map(itemgetter(1), records)))
    tensors = {
        "keys": keys,
        "sizes": np.fromiter(map(itemgetter(0), records), np.int64, len(records)),
        "checksums": checksums,
        "bases": _blob(bases),
        "base_of": np.fromiter(map(number.__getitem__, map(itemgetter(2), records)), np.int32, len(records)),
    }
    meta = {"format": FORMAT, "type": type, "entries": str(len(records)), "bases": str(len(bases))}
    if key_prefix is not None:
        meta["keys"] = f"hex:{key_prefix}"
    if checksum_prefix is not None:
        meta["checksums"] = f"hex:{checksum_prefix}"
    return save(tensors, metadata=meta)


def decode(data: bytes, type: str) -> dict[str, Record]:
    """The entries of a segment of `type` (either form). Raises ValueError (or safetensors' own error) for bytes
    that are no segment of this type."""
    if data[:1] == b"{":  # the JSON form
        doc = json.loads(data)
        if doc.get("format") != FORMAT_JSON or doc.get("type") != type:
            raise ValueError("not an index segment of this type")
        return {k: (int(v[0]), str(v[1]), str(v[2])) for k, v in doc["entries"].items()}
    from safetensors.numpy import load

    (size,) = struct.unpack("<Q", data[:8])
    meta = json.loads(data[8 : 8 + size]).get("__metadata__") or {}
    if meta.get("format") != FORMAT or meta.get("type") != type:
        raise ValueError("not an index segment of this type")
    arrays, count, distinct = load(bytes(data)), int(meta["entries"]), int(meta["bases"])
    keys = _unpacked(arrays["keys"], count, meta.get("keys"))
    checksums = _unpacked(arrays["checksums"], count, meta.get("checksums"))
    bases, base_of = _texts(arrays["bases"], distinct), arrays["base_of"].tolist()
    sizes = arrays["sizes"].tolist()
    if len(sizes) != count or len(base_of) != count:
        raise ValueError("columns differ in length")
    if base_of and (min(base_of) < 0 or max(base_of) >= distinct):
        raise ValueError("a base number outside the table of bases")
    return dict(zip(keys, zip(sizes, checksums, map(bases.__getitem__, base_of))))


_HEX = re.compile(r"[0-9a-f]*")


def _packed(texts: list[str]) -> tuple:
    """(column, prefix): texts that are all one prefix (up to a ':') and the same number of lowercase hex digits
    as the digits' bytes, with the prefix; any others as a text column, with None."""
    first = texts[0] if texts else ""
    prefix = first[: first.find(":") + 1]
    width = len(first) - len(prefix)
    if (
        texts
        and width
        and width % 2 == 0
        and set(map(len, texts)) == {len(first)}
        and all(map(methodcaller("startswith", prefix), texts))
    ):
        digits = "".join(t[len(prefix) :] for t in texts) if prefix else "".join(texts)
        if _HEX.fullmatch(digits):
            import numpy as np

            return np.frombuffer(bytes.fromhex(digits), dtype=np.uint8), prefix
    return _blob(texts), None


def _unpacked(array, count: int, form: str | None) -> list[str]:
    """The texts of a column `_packed` made (`form`: "hex:<prefix>" for packed digits, None for a text column)."""
    if form is None:
        return _texts(array, count)
    if not form.startswith("hex:"):
        raise ValueError(f"unknown column form {form!r}")
    prefix, digits = form[4:], array.tobytes().hex()
    width = len(digits) // count if count else 0
    if width * count != len(digits):
        raise ValueError("a packed column has the wrong length")
    if prefix:
        return [prefix + digits[i : i + width] for i in range(0, len(digits), width)]
    return [digits[i : i + width] for i in range(0, len(digits), width)]


def _blob(texts: list[str]):
    import numpy as np

    return np.frombuffer("\n".join(texts).encode(), dtype=np.uint8)


def _texts(array, count: int) -> list[str]:
    texts = array.tobytes().decode().split("\n") if count else []
    if len(texts) != count:
        raise ValueError("a text column has the wrong count")
    return texts
