"""Where the caption stage writes: `<stem>.txt` + `<stem>.caption.json` in a data set folder, or a new manifest.

Both outputs are resumable and never replace a caption that exists unless asked (`caption.overwrite`):
- folder: a caption file written is a sample done (its sidecar JSON is written first, both atomically);
- manifest (from a manifest or a Hugging Face data set): each process appends its rows to its own part file
  as it goes; the main process merges the finished manifest (every sample of the data set, in id order, its
  caption settings in the row's `caption` object) and removes the parts. A later run reads both.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from qie.data.samples import Sample

CAPTION_SUFFIX = ".txt"
SIDECAR_SUFFIX = ".caption.json"


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


class FolderOutput:
    """Captions beside the target images of a data set folder, as the folder layout reads them."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def _paths(self, sample: Sample) -> list[Path]:
        # The folder reader takes training_images/<stem>.txt, else control_images/<stem>.txt.
        return [
            self.root / "training_images" / f"{sample.id}{CAPTION_SUFFIX}",
            self.root / "control_images" / f"{sample.id}{CAPTION_SUFFIX}",
        ]

    def has_caption(self, sample: Sample) -> bool:
        return any(p.is_file() for p in self._paths(sample))

    def done(self) -> set[str]:
        """Ids captioned by an earlier run (nothing to remember: their files are there)."""
        return set()

    def where(self, sample: Sample) -> str:
        return str(self._paths(sample)[0])

    def write(self, sample: Sample, caption: str, info: dict[str, Any]) -> None:
        txt = self._paths(sample)[0]
        _write_atomic(txt.with_name(f"{sample.id}{SIDECAR_SUFFIX}"), json.dumps({"caption": caption, **info}, indent=2))
        _write_atomic(txt, caption + "\n")

    def finish(self, samples: list[Sample]) -> str:
        return f"captions in {self.root / 'training_images'} (<stem>.txt, settings in <stem>{SIDECAR_SUFFIX})"


class ManifestOutput:
    """A new .jsonl manifest: id, target, controls (paths relative to its folder where they lie inside it),
    prompt, and the caption's settings."""

    def __init__(self, path: Path, process: int) -> None:
        self.path = path
        self.part = path.with_name(f"{path.name}.part-{process}")
        self.rows = self._read_rows()

    def _read_rows(self) -> dict[str, dict]:
        """Rows of the manifest and of the parts of earlier (interrupted) runs, by id; a part's row wins."""
        rows: dict[str, dict] = {}
        parts = sorted(self.path.parent.glob(f"{self.path.name}.part-*"))
        for file in [self.path, *parts]:
            if not file.is_file():
                continue
            for line in file.read_text(encoding="utf-8").splitlines():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:  # a line cut by an interruption: that sample is captioned again
                    continue
                if isinstance(row, dict) and row.get("id"):
                    rows[str(row["id"])] = row
        return rows

    def has_caption(self, sample: Sample) -> bool:
        return bool(sample.prompt)

    def done(self) -> set[str]:
        return {i for i, row in self.rows.items() if row.get("prompt") and "caption" in row}

    def where(self, sample: Sample) -> str:
        return f"{self.path} (id {sample.id})"

    def _row(self, sample: Sample, prompt: str | None, info: dict | None) -> dict:
        row: dict[str, Any] = {"id": sample.id, "target": self._rel(sample.target) if sample.target else None}
        row["controls"] = [self._rel(c) for c in sample.controls]
        if prompt:
            row["prompt"] = prompt
        if info is not None:
            row["caption"] = info
        return row

    def _rel(self, path: Path) -> str:
        rel = os.path.relpath(Path(path).absolute(), self.path.parent.absolute())
        return Path(path).absolute().as_posix() if rel.startswith("..") else Path(rel).as_posix()

    def write(self, sample: Sample, caption: str, info: dict[str, Any]) -> None:
        row = self._row(sample, caption, info)
        self.rows[sample.id] = row
        with open(self.part, "a", encoding="utf-8") as f:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")

    def finish(self, samples: list[Sample]) -> str:
        """Merge (main process, after every process is done): every sample of the data set, captioned here,
        earlier, or already in the input; the parts are removed once the manifest is in place."""
        rows = self._read_rows()
        out = []
        for sample in sorted(samples, key=lambda s: s.id):
            row = rows.get(sample.id)
            out.append(row if row and row.get("prompt") else self._row(sample, sample.prompt or None, None))
        text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in out)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        _write_atomic(self.path, text)
        for part in self.path.parent.glob(f"{self.path.name}.part-*"):
            part.unlink(missing_ok=True)
        outside = any(not r["target"] or Path(r["target"]).is_absolute() for r in out if r.get("target"))
        hint = " (paths outside its folder: read it with data.allow_outside_paths=true)" if outside else ""
        missing = sum(1 for r in out if not r.get("prompt"))
        left = f"; {missing} rows without a prompt" if missing else ""
        return f"manifest {self.path} ({len(out)} rows{left}){hint}: train with data.path={self.path}"
