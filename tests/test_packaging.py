"""The config tree at the repository root (`conf/`) is what qie serves through Hydra's search path, and what an
installed qie holds as `qie/conf/`: setuptools, configured as for a wheel, places every file of the tree there
(checked in-process, without a build)."""

from __future__ import annotations

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


def test_the_checkout_serves_conf_through_hydras_search_path() -> None:
    """The entry points' primary config path is the checkout's `conf/` (a `file://` entry of Hydra's search path),
    found without importing a `qie.conf` module."""
    import sys

    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from qie.config.tree import conf_dir, conf_path

    assert conf_dir() == ROOT / "conf" and conf_path() == str(ROOT / "conf")
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=conf_path(), version_base=None):
            sources = GlobalHydra.instance().config_loader().get_sources()
    finally:
        GlobalHydra.instance().clear()
    assert [(s.scheme(), s.path) for s in sources if s.provider == "main"] == [("file", str(ROOT / "conf"))]
    assert "qie.conf" not in sys.modules


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


@pytest.mark.parametrize("layout", ["checkout", "stale_checkout", "wheel", "none"])
def test_the_config_tree_is_the_one_of_its_layout(layout: str, tmp_path: Path, monkeypatch) -> None:
    """A checkout serves `conf/` (also with a `qie/conf/__pycache__` left from before the move); a wheel its own
    `qie/conf/`; an installation without either stops in one line naming both folders."""
    from qie.config import tree
    from qie.errors import ConfigError

    (tmp_path / "qie" / "config").mkdir(parents=True)
    (tmp_path / "conf").mkdir()
    if layout != "none":
        (tmp_path / "conf" / "train.yaml").write_text("")
    if layout == "stale_checkout":
        (tmp_path / "qie" / "conf" / "__pycache__").mkdir(parents=True)
    if layout == "wheel":
        (tmp_path / "qie" / "conf").mkdir()
        (tmp_path / "qie" / "conf" / "train.yaml").write_text("")
    monkeypatch.setattr(tree, "__file__", str(tmp_path / "qie" / "config" / "tree.py"))
    if layout == "none":
        with pytest.raises(ConfigError, match=f"neither {tmp_path / 'qie' / 'conf'} nor {tmp_path / 'conf'} holds"):
            tree.conf_dir()
        return
    assert tree.conf_dir() == tmp_path / ("qie/conf" if layout == "wheel" else "conf")
