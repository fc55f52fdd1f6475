"""docs/api.md runs: every python block, in order, in one namespace (tiny model, CPU)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parent.parent / "docs" / "api.md"


def test_api_doc_examples_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_path: Path) -> None:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    assert len(blocks) >= 5
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    for n, block in enumerate(blocks):
        try:
            exec(compile(block, f"{DOC.name}[block {n}]", "exec"), namespace)
        except Exception as e:  # name the failing block
            raise AssertionError(f"docs/api.md block {n} failed: {e!r}\n{block}") from e
