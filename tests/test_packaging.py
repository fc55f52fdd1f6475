"""The config tree at the repository root (`conf/`) is what an installed qie serves as `qie.conf`: setuptools,
configured as for a wheel, places every file of the tree in the package (checked in-process, without a build)."""

from __future__ import annotations

import importlib
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _tree_files() -> set[str]:
    return {
        p.relative_to(ROOT / "conf").as_posix()
        for p in (ROOT / "conf").rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
    }


def test_the_checkout_serves_conf_as_qie_conf() -> None:
    import qie.conf

    assert Path(qie.conf.__file__).resolve() == ROOT / "conf" / "__init__.py"
    assert importlib.import_module("qie.conf") is qie.conf


def test_the_wheel_holds_every_file_of_the_config_tree(monkeypatch: pytest.MonkeyPatch) -> None:
    """setup.py and setup.cfg as setuptools reads them for a build: `qie.conf` is a package mapped to `conf/`, and
    build_py's files for it (its modules and package data) are every file under `conf/`."""
    from setuptools import distutils  # setuptools' own distutils, whose run_setup builds its Distribution

    run_setup = distutils.core.run_setup

    monkeypatch.chdir(ROOT)
    dist = run_setup(str(ROOT / "setup.py"), stop_after="config")
    assert "qie.conf" in dist.packages and "qie" in dist.packages
    assert dist.package_dir.get("qie.conf") == "conf"
    build_py = dist.get_command_obj("build_py")
    build_py.ensure_finalized()
    build_py.manifest_files = {}  # the patterns alone, as without a version-control file finder
    src = build_py.get_package_dir("qie.conf")
    assert Path(src).resolve() == ROOT / "conf"
    data = {Path(f).as_posix() for f in build_py.find_data_files("qie.conf", src)}
    modules = {Path(m[2]).name for m in build_py.find_package_modules("qie.conf", src)}
    shipped = {os.path.relpath(f, src).replace(os.sep, "/") for f in data} | modules
    missing = sorted(_tree_files() - shipped)
    assert not missing, f"files of conf/ a wheel would not hold (setup.cfg [options.package_data] qie.conf): {missing}"


def test_every_package_under_qie_is_packaged(monkeypatch: pytest.MonkeyPatch) -> None:
    from setuptools import distutils  # setuptools' own distutils, whose run_setup builds its Distribution

    run_setup = distutils.core.run_setup

    monkeypatch.chdir(ROOT)
    packages = set(run_setup(str(ROOT / "setup.py"), stop_after="config").packages)
    # Every folder of modules, with or without an `__init__.py` (setuptools' `find_packages` skips those without).
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "qie").rglob("*.py")}
    assert not found - packages, f"folders of qie/ a wheel would not hold: {sorted(found - packages)}"


@pytest.mark.parametrize("layout", ["checkout", "stale_checkout", "wheel"])
def test_qie_conf_is_the_tree_of_its_layout(layout: str, tmp_path: Path) -> None:
    """A checkout serves `conf/` (also with a `qie/conf/__pycache__` left from before the move); a wheel its
    own `qie/conf/`. A fresh interpreter on a copy of qie's `__init__.py` in each layout."""
    import shutil
    import subprocess
    import sys

    (tmp_path / "qie").mkdir()
    shutil.copy(ROOT / "qie" / "__init__.py", tmp_path / "qie" / "__init__.py")
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "__init__.py").write_text("")
    if layout == "stale_checkout":
        (tmp_path / "qie" / "conf" / "__pycache__").mkdir(parents=True)
    if layout == "wheel":
        (tmp_path / "qie" / "conf").mkdir()
        (tmp_path / "qie" / "conf" / "__init__.py").write_text("")
    code = (
        "import qie.conf, importlib.resources as r; "
        "print(qie.conf.__file__, (r.files('qie.conf') / '__init__.py').is_file())"
    )
    done = subprocess.run([sys.executable, "-S", "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                          env={"PYTHONPATH": str(tmp_path), "PYTHONDONTWRITEBYTECODE": "1"})  # fmt: skip
    assert done.returncode == 0, done.stderr
    expected = tmp_path / ("qie/conf" if layout == "wheel" else "conf") / "__init__.py"
    assert done.stdout.split() == [str(expected), "True"]
