"""The package's layering, checked: the gate loads no Celery, no module uses another's privates."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# No Celery, kombu or redis-py code runs here: make test-compat runs it on its first Celery only.
pytestmark = pytest.mark.celery_independent

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "celery_idem"

#: Private names used across modules: none (keep it that way).
ALLOWED: set[tuple[str, str]] = set()


def test_importing_the_gate_loads_no_celery_and_no_kombu() -> None:
    code = ("import celery_idem.gate, sys; "
            "loaded = sorted(m for m in sys.modules if m == 'celery' "
            "or m.startswith(('celery.', 'kombu'))); "
            "assert not loaded, loaded")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr


def test_the_core_below_the_seam_loads_no_celery_either() -> None:
    # Everything the gate stands on, and the in-process store, without the task seam
    code = ("import celery_idem.gate, celery_idem.stores.memory, celery_idem.codec, "
            "celery_idem.config, celery_idem.lease, celery_idem.events, celery_idem.keys, "
            "celery_idem.exceptions, sys; "
            "celery_idem.stores.memory.MemoryStore(prefix='x:').get('k'); "
            "loaded = sorted(m for m in sys.modules if m == 'celery' "
            "or m.startswith(('celery.', 'kombu'))); "
            "assert not loaded, loaded")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr


def _modules() -> Iterator[tuple[str, Path]]:
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        yield ".".join(parts), path


def _resolve(module: str, path: Path, node: ast.ImportFrom) -> str:
    """The absolute module name an ``ImportFrom`` names (relative levels resolved)."""
    if not node.level:
        return node.module or ""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{node.module}" if node.module else package


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _crossings(module: str, path: Path) -> Iterator[str]:
    """``module.name`` of every private name ``module`` takes from another celery_idem module."""
    tree = ast.parse(path.read_text(), str(path))
    aliases: dict[str, str] = {}  # local name -> celery_idem module it is bound to
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            source = _resolve(module, path, node)
            if not source.startswith("celery_idem"):
                continue
            for alias in node.names:
                if _private(alias.name):
                    yield f"{source}.{alias.name}"
                else:
                    # Maybe a submodule (``from . import task``): track it for attribute access.
                    aliases[alias.asname or alias.name] = f"{source}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("celery_idem"):
                    aliases[alias.asname or alias.name] = alias.name
    known = {name for name, _ in _modules()}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and _private(node.attr):
            target = aliases.get(node.value.id)
            if target in known and target != module:
                yield f"{target}.{node.attr}"


def test_no_private_imports_across_modules() -> None:
    found = {
        (module, name)
        for module, path in _modules()
        for name in _crossings(module, path)
        if name.rpartition(".")[0] != module
    }
    assert found - ALLOWED == set(), "private names used across modules: " + ", ".join(
        f"{module} uses {name}" for module, name in sorted(found - ALLOWED))
    assert ALLOWED - found == set(), f"no longer used, drop from ALLOWED: {sorted(ALLOWED - found)}"


def test_the_checker_sees_a_private_import_and_a_private_attribute(tmp_path: Path) -> None:
    source = tmp_path / "mod.py"
    source.write_text("from .gate import _no_emit\nfrom . import task\ntask._gate\n")
    assert sorted(_crossings("celery_idem.mod", source)) == [
        "celery_idem.gate._no_emit", "celery_idem.task._gate"]
