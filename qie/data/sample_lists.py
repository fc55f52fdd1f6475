"""Whole lists of samples remembered with their key rows, by a digest of everything the rows depend on
(`qie.data.key_memo.list_digest`): `<folder>/<context token>-<digest>.safetensors`, the newest `LISTS_KEPT` of a
context kept. A list found again costs reading one file, not a signature and a lookup per sample."""

from __future__ import annotations

import logging
import os
import secrets
from pathlib import Path

log = logging.getLogger(__name__)

FORMAT = "qie-sample-list/1"
LISTS_KEPT = 4  # remembered lists per context (the training set, its regularisation set, their text-only forms)


class RememberedLists:
    """The lists of one key context: found in this object or its folder, learnt, and saved.

    Args:
        folder: where the list files live (None: in this object only).
        stem: the key context's token (the start of each file's name).
        row_bytes: the bytes of one sample's row.
    """

    def __init__(self, folder: Path | None, stem: str, row_bytes: int) -> None:
        self.folder, self.stem, self.row_bytes = folder, stem, row_bytes
        self._learnt: dict[bytes, object] = {}  # digest -> its rows ((n, row_bytes) array), not yet saved

    def find(self, digest: bytes, count: int):
        """The rows of the list with `digest` and `count` samples, learnt or saved; None when neither holds them
        (an unreadable file is logged and ignored)."""
        if digest in self._learnt:
            return self._learnt[digest]
        if self.folder is None:
            return None
        from safetensors import safe_open

        path = self._file(digest)
        try:
            with safe_open(str(path), framework="numpy") as f:
                meta = f.metadata() or {}
                if meta.get("format") != FORMAT:
                    raise ValueError("unknown format")
                rows = f.get_tensor("keys")
            if rows.shape != (count, self.row_bytes) or int(meta.get("samples", -1)) != count:
                raise ValueError("unexpected shape")
        except FileNotFoundError:
            return None
        except Exception as e:  # safetensors raises its own error types for a damaged file
            log.warning("remembered sample list %s is unreadable (%s); looking its samples up one by one", path, e)
            return None
        return rows

    def learn(self, digest: bytes, rows) -> None:
        self._learnt[digest] = rows

    def save(self) -> None:
        """Write the lists learnt (atomically), keeping the `LISTS_KEPT` newest of this context; a failure is
        logged, not raised (the lists only save time)."""
        if self.folder is None or not self._learnt:
            return
        from safetensors.numpy import save_file

        for digest, rows in list(self._learnt.items()):
            path = self._file(digest)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
            try:
                self.folder.mkdir(parents=True, exist_ok=True)
                save_file({"keys": rows}, str(tmp), metadata={"format": FORMAT, "samples": str(len(rows))})
                os.replace(tmp, path)
            except OSError as e:
                log.warning("could not save the remembered sample list %s (%s)", path, e)
                tmp.unlink(missing_ok=True)
                return
            del self._learnt[digest]
        kept = sorted(self.folder.glob(f"{self.stem}-*.safetensors"), key=_mtime, reverse=True)
        for old in kept[LISTS_KEPT:]:
            old.unlink(missing_ok=True)

    def _file(self, digest: bytes) -> Path:
        return self.folder / f"{self.stem}-{digest.hex()}.safetensors"


def _mtime(path: Path) -> int:
    try:
        return path.stat().st_mtime_ns
    except OSError:
        return 0
