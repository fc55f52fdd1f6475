"""Import hygiene: the layers load only what they need, and the packages import each other without cycles."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

QIE = Path(__file__).resolve().parents[1] / "qie"

CHECK = """
import sys
import {module}
loaded = sorted(m for m in sys.modules if m.split(".")[0] in {libs} or m.startswith({packages}))
print("\\n".join(loaded))
"""


def _loaded(module: str, libs: tuple[str, ...], packages: tuple[str, ...]) -> list[str]:
    code = CHECK.format(module=module, libs=repr(libs), packages=repr(packages))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=QIE.parent)
    return out.stdout.split()


@pytest.mark.subprocess
def test_the_training_step_loads_no_hydra_cache_or_encoder() -> None:
    for step in ("qie.training.loop", "qie.models.qwen_image", "qie.models.qwen_image_21"):
        assert (
            _loaded(
                step,
                ("hydra", "omegaconf"),
                ("qie.cache", "qie.embedding", "qie.stages", "qie.cli"),
            )
            == []
        ), step


@pytest.mark.subprocess
def test_the_cache_loads_no_model_library_config_or_data_code() -> None:
    libs = ("hydra", "omegaconf", "diffusers", "transformers", "peft")
    assert _loaded("qie.cache", libs, ("qie.data", "qie.stages", "qie.embedding.encode", "qie.config")) == []


@pytest.mark.subprocess
def test_the_plugin_surface_loads_torch_alone() -> None:
    """`qie.extend` (what a plug-in imports: the objective base, the reward and backend protocols, the batch) loads no
    model library, no config and no stage."""
    libs = ("hydra", "omegaconf", "diffusers", "transformers", "peft")
    loaded = _loaded("qie.extend", libs, ("qie.",))
    assert not [m for m in loaded if m.split(".")[0] in libs or m.startswith(("qie.config", "qie.stages"))], loaded
    assert {"qie.training.objectives.flow_matching", "qie.evaluation.reward", "qie.cache.base"} <= set(loaded)


def _package(module: str) -> str:
    """The package a qie module belongs to (`qie.cache.ssd` -> `cache`); top-level modules stand alone."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "qie"


def _imports() -> dict[str, set[str]]:
    """package -> the qie packages its modules import (at any depth, function-local imports included)."""
    graph: dict[str, set[str]] = {}
    for path in QIE.rglob("*.py"):
        rel = path.relative_to(QIE.parent).with_suffix("")
        module = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        if len(rel.parts) == 2 and rel.name != "__init__":  # qie/x.py: its own node
            here = rel.name
        elif rel.name == "__main__":  # `python -m qie.cache`: an entry point, which nothing imports
            here = module
        else:
            here = _package(module)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for name in names:
                if (
                    name.startswith("qie.")
                    and (QIE / Path(*name.split(".")[1:2])).exists()
                    or (name.startswith("qie.") and (QIE / f"{name.split('.')[1]}.py").exists())
                ):
                    target = name.split(".")[1]
                    if target != here:
                        graph.setdefault(here, set()).add(target)
    return graph


def test_packages_import_each_other_without_cycles() -> None:
    graph = _imports()

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        for nxt in graph.get(start, ()):
            if nxt == goal or (nxt not in seen and reaches(nxt, goal, seen | {nxt})):
                return True
        return False

    cycles = sorted(f"{a} <-> {b}" for a in graph for b in graph[a] if reaches(b, a, {b}))
    assert cycles == []


def test_nothing_imports_an_entry_point() -> None:
    entry_points = {"train", "precompute", "infer", "eval"}
    graph = _imports()
    assert sorted(p for p, targets in graph.items() if targets & entry_points) == []
