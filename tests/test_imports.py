"""Import hygiene: the layers load only what they need, and the packages import each other without cycles."""

from __future__ import annotations

import ast
import json
import re
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


# One process: every entry point imported, then a typo, an out-of-range value, a bad choice, `--help` and `--cfg job`
# each run through `python -m qie.train`'s main, and what was loaded after each.
ENTRY_POINTS = """
import contextlib, io, json, sys
HEAVY = ("torch", "diffusers", "transformers")
def heavy():
    return sorted(m for m in sys.modules if m.split(".")[0] in HEAVY)
import qie.train
out = {"import qie.train": heavy()}
for name in ("precompute", "infer", "eval", "caption", "plan", "export", "extract_lora", "cache_admin", "demo"):
    __import__(f"qie.{name}" if name != "demo" else "qie.demo.__main__")
out["import every entry point"] = heavy()
for case in (["train.max_step=5"], ["train.max_steps=-5"], ["cache=nvme"], ["--help"], ["--cfg", "job"]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        sys.argv = ["qie.train", *case]
        try:
            qie.train.main_of(qie.train.main, "train")
            code = 0
        except SystemExit as e:
            code = e.code
    out[" ".join(case)] = {"exit": code, "stderr": err.getvalue().strip().splitlines(), "heavy": heavy()}
print(json.dumps(out))
"""


@pytest.mark.subprocess
def test_an_entry_point_answers_a_mistake_before_importing_the_model_libraries(tmp_path: Path) -> None:
    """The entry points import Hydra, OmegaConf, the schemas and the checker only: a typo (Hydra's unknown key), an
    out-of-range value (qie's range check) and a bad choice (a preset that does not exist) each end in one
    `qie: error:` line and exit 2 with none of torch, diffusers or transformers imported; `--help` and `--cfg job`
    answer without them too."""
    run = subprocess.run([sys.executable, "-c", ENTRY_POINTS], capture_output=True, text=True, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert out["import qie.train"] == [] and out["import every entry point"] == []
    expected = {
        "train.max_step=5": "qie: error: unknown key train.max_step: did you mean train.max_steps?",
        "train.max_steps=-5": "qie: error: train.max_steps=-5 is out of range: it must lie in [0, inf]",
        "cache=nvme": "qie: error: cache=nvme is not a preset of cache: choose one of memory, none, remote, ssd",
    }
    for case, line in expected.items():
        assert out[case] == {"exit": 2, "stderr": [line], "heavy": []}, case
    for case in ("--help", "--cfg job"):
        assert out[case]["exit"] == 0 and out[case]["heavy"] == [], (case, out[case])


def _package(module: str) -> str:
    """The package a qie module belongs to (`qie.cache.ssd` -> `cache`); top-level modules stand alone."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "qie"


# Calls that import what a string names: their constant string arguments are import edges too.
LOADERS = {"import_module", "target_class", "locate", "_locate", "instantiate", "run_module", "import_named"}
# A qie module (or a class or function in one) named by a string: "qie.cache.ssd.SsdBackend", "qie.models.x:build".
DOTTED = re.compile(r"^qie(\.\w+)+(:\w+)?$")


def _node_of(path: Path) -> tuple[str, str]:
    """The module a file is and the node it counts as: its package (`qie.cache.ssd` -> `cache`); a top-level module
    (`qie/train.py`) and a package's `__main__` (an entry point, which nothing imports) each stand alone."""
    rel = path.relative_to(QIE.parent).with_suffix("")
    module = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
    if len(rel.parts) == 2 and rel.name != "__init__":
        return module, rel.name
    return module, module if rel.name == "__main__" else _package(module)


def _constants(tree: ast.Module) -> dict[str, list[str]]:
    """Module-level names bound to a string, or to a tuple or list of strings."""
    out: dict[str, list[str]] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            values = node.value.elts if isinstance(node.value, ast.Tuple | ast.List) else [node.value]
            strings = [v.value for v in values if isinstance(v, ast.Constant) and isinstance(v.value, str)]
            if strings:
                out[node.targets[0].id] = strings
    return out


def _loader_strings(tree: ast.Module) -> list[str]:
    """The qie modules a module loads by a string: constant strings (or module-level constants, also through a loop
    over one) given to a loader call, and every "qie.module:attribute" string (what `import_named` resolves)."""
    constants = _constants(tree)
    for node in ast.walk(tree):  # a loop over a constant binds its variable to the constant's strings
        if isinstance(node, ast.For) and isinstance(node.target, ast.Name) and isinstance(node.iter, ast.Name):
            constants.setdefault(node.target.id, constants.get(node.iter.id, []))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and ":" in node.value:
            found.append(node.value)
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        if name not in LOADERS:
            continue
        for arg in [*node.args, *(k.value for k in node.keywords)]:
            for sub in ast.walk(arg):
                if isinstance(sub, ast.Constant) and isinstance(sub.value, str):
                    found.append(sub.value)
                elif isinstance(sub, ast.Name):
                    found += constants.get(sub.id, [])
    return [s for s in found if DOTTED.match(s)]


def _imports(loaders: bool = True) -> dict[str, set[str]]:
    """package -> the qie packages its modules import (at any depth, function-local imports included; with
    `loaders`, what they load by a string too)."""
    graph: dict[str, set[str]] = {}
    for path in QIE.rglob("*.py"):
        module, here = _node_of(path)
        tree = ast.parse(path.read_text(encoding="utf-8"))
        names = _loader_strings(tree) if loaders else []
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names += [a.name for a in node.names]
        for name in names:
            name = name.split(":")[0]
            if name.startswith("qie.") and (
                (QIE / Path(*name.split(".")[1:2])).exists() or (QIE / f"{name.split('.')[1]}.py").exists()
            ):
                target = name.split(".")[1]
                if target != here:
                    graph.setdefault(here, set()).add(target)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[str]:
    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        for nxt in graph.get(start, ()):
            if nxt == goal or (nxt not in seen and reaches(nxt, goal, seen | {nxt})):
                return True
        return False

    return sorted(f"{a} <-> {b}" for a in graph for b in graph[a] if reaches(b, a, {b}))


def test_packages_import_each_other_without_cycles() -> None:
    """No cycle between packages, counting function-local imports and what a module loads by a string (a
    `_target_`, `import_module`, a "module:attribute" name): a string must not hide a cycle."""
    assert _cycles(_imports()) == []


def test_loader_strings_are_edges_of_the_import_graph() -> None:
    """The string edges are read: the cache's `python -m` entry runs the admin entry point by name, and a family
    names its processor class as "module:attribute"; a cycle through a string is counted."""
    strings, plain = _imports(), _imports(loaders=False)
    assert "cache_admin" in strings["qie.cache.__main__"] and "cache_admin" not in plain.get("qie.cache.__main__", ())
    assert "cache" in strings["config"] and "cache" in plain["config"]  # config/backend.py: an import as well
    looped = {**strings, "cache_admin": strings.get("cache_admin", set()) | {"qie.cache.__main__"}}
    assert _cycles(looped) == ["cache_admin <-> qie.cache.__main__", "qie.cache.__main__ <-> cache_admin"]


def test_no_module_below_the_stages_imports_the_config_checker() -> None:
    """`qie.checks` (compose, the rules, the components' checks) is imported by the entry points, the stages, the
    demo, the studio (which checks a job's config before it queues it) and the Python API only; the schemas
    (`qie.config`) import nothing of qie above them."""
    graph = _imports()
    users = sorted(p for p, targets in graph.items() if "checks" in targets)
    above = {
        "stages",
        "demo",
        "studio",
        "api",
        "cli",
        "qie",
        "qie.demo.__main__",
        "qie.studio.__main__",
    } | ENTRY_MODULES
    assert [p for p in users if p not in above] == []
    assert graph["config"] <= {"errors", "entry_types", "sampling_fields", "cache"}, graph["config"]


ENTRY_MODULES = {"train", "precompute", "infer", "eval", "caption", "plan", "export", "extract_lora", "cache_admin"}


def test_nothing_imports_an_entry_point() -> None:
    graph = _imports(loaders=False)
    assert sorted(p for p, targets in graph.items() if targets & ENTRY_MODULES) == []
