"""The package's layout: each add-on has one import path, under ``celery_idem.contrib``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import celery_idem

# No Celery, kombu or redis-py code runs here: make test-compat runs it on its first Celery only.
pytestmark = pytest.mark.celery_independent

PACKAGE = Path(celery_idem.__file__).parent
CONTRIB = PACKAGE / "contrib"


def _names(folder: Path) -> set[str]:
    """The module and subpackage names directly in ``folder``."""
    return {p.stem for p in folder.glob("*.py") if p.stem != "__init__"} | {
        p.name for p in folder.iterdir() if (p / "__init__.py").is_file()}


def _imports_contrib(path: Path) -> bool:
    """Whether the module body (not a function, not ``if TYPE_CHECKING``) imports an add-on."""
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if (node.level == 1 and (module == "contrib" or module.startswith("contrib."))) \
                    or module.startswith("celery_idem.contrib"):
                return True
        elif isinstance(node, ast.Import) and any(
                a.name.startswith("celery_idem.contrib") for a in node.names):
            return True
    return False


def test_no_top_level_module_shares_a_name_with_an_add_on() -> None:
    names = _names(CONTRIB)
    assert {"saga", "flower", "tools", "mcp", "cli", "maintenance", "otel"} <= names
    assert not (PACKAGE / "saga.py").exists()
    assert _names(PACKAGE) & names == set()


def test_no_top_level_module_imports_an_add_on_when_loaded() -> None:
    # The core does not load the add-ons: a top-level module importing one is a re-export.
    offenders = [p.name for p in sorted(PACKAGE.glob("*.py")) if _imports_contrib(p)]
    assert offenders == []


def test_the_checks_see_a_shim(tmp_path: Path) -> None:
    (tmp_path / "contrib").mkdir()
    (tmp_path / "contrib" / "__init__.py").write_text("")
    (tmp_path / "contrib" / "saga.py").write_text("")
    (tmp_path / "saga.py").write_text("from .contrib.saga import *\n")
    (tmp_path / "lazy.py").write_text("def f():\n    from .contrib import saga\n")
    assert _names(tmp_path) & _names(tmp_path / "contrib") == {"saga"}
    assert _imports_contrib(tmp_path / "saga.py")
    assert not _imports_contrib(tmp_path / "lazy.py")
