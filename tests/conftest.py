"""Shared fixtures: a private QIE_HOME per test session, and the tiny models built once in it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session", autouse=True)
def qie_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    home = Path(os.environ.get("QIE_TEST_HOME") or tmp_path_factory.mktemp("qie_home"))
    os.environ["QIE_HOME"] = str(home)
    return home


@pytest.fixture(scope="session")
def tiny_path(qie_home: Path) -> Path:
    from qie.components.tiny import default_tiny_path, ensure_tiny_model

    return ensure_tiny_model(default_tiny_path("edit"), "edit")


@pytest.fixture(scope="session")
def tiny_plus_path(qie_home: Path) -> Path:
    from qie.components.tiny import default_tiny_path, ensure_tiny_model

    return ensure_tiny_model(default_tiny_path("edit_plus"), "edit_plus")


@pytest.fixture(scope="session")
def tiny_demo_path(qie_home: Path) -> Path:
    from qie.components.tiny import default_tiny_path, ensure_tiny_model

    return ensure_tiny_model(default_tiny_path("edit", "demo"), "edit", preset="demo")
