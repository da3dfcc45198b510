"""Another library's private name is used only where ``celery_idem.compat.PRIVATE_NAMES`` lists it.

``PRIVATE_NAMES`` is the one inventory: each entry names the module (``where``) that uses the
name, with the versions checked and the fallback. This test reads every module's source
(``ast``) for:

* imports of a private module or name of those libraries (``celery._state``,
  ``from kombu.x import _y``);
* ``obj._name`` (or ``getattr(obj, "_name")``) where ``obj`` is not a module of our own
  package, ``_name`` is not a dunder, is defined somewhere in those libraries (``def``,
  ``class`` or an assignment), and is not defined by celery_idem itself (a definition that
  overrides a listed library name, such as ``_put``, does not count as our own);

and requires each finding to be listed for its module. :data:`ALLOWED` holds the one exception:
Django's documented ``Model._meta``.
"""

from __future__ import annotations

import ast
import functools
import importlib.machinery
import re
from pathlib import Path

import pytest

import celery_idem
from celery_idem.compat import PRIVATE_NAMES, PrivateName

PACKAGE = Path(celery_idem.__file__).parent
LIBRARIES = ("celery", "kombu", "redis", "sqlalchemy", "psycopg", "mcp")

#: (module path under celery_idem/, private name) allowed unlisted: Django's documented
#: ``Model._meta`` (a name SQLAlchemy defines too, so the scan sees it), and the MCP SDK's session
#: table, which only an add-on uses and the core's inventory cannot name (test_architecture: the
#: core names no add-on); its versions and fallback are at its use in contrib/mcp.py.
ALLOWED = frozenset({
    ("contrib/django/admin.py", "_meta"),
    ("contrib/mcp.py", "_server_instances"),
})


#: A library's definitions of a name: def/class, or an assignment (``_x =``, ``self._x =``).
_DEFINITION = re.compile(
    rb"(?:def|class)\s+(_[A-Za-z]\w*)|\.(_[A-Za-z]\w*)\s*(?::[^=\n]*)?=(?!=)"
    rb"|^\s*(_[A-Za-z]\w*)\s*(?::[^=\n]*)?=(?!=)", re.M)


@functools.cache
def library_private_names() -> frozenset[str]:
    """Every private name the libraries define (a regex over their source: 0.5 s, not ast)."""
    names: set[str] = set()
    for library in LIBRARIES:
        # PathFinder, not importlib.util.find_spec: celery and kombu replace their imported
        # module objects with lazy ones that have no __spec__.
        spec = importlib.machinery.PathFinder.find_spec(library)
        if spec is None or spec.origin is None:  # pragma: no cover - psycopg is a dev dependency
            continue
        for path in Path(spec.origin).parent.rglob("*.py"):
            for m in _DEFINITION.finditer(path.read_bytes()):
                names.add((m[1] or m[2] or m[3]).decode())
    return frozenset(names)


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _modules() -> dict[str, ast.Module]:
    return {
        path.relative_to(PACKAGE).as_posix(): ast.parse(path.read_text("utf-8"))
        for path in sorted(PACKAGE.rglob("*.py"))
    }


def _own_names(trees: dict[str, ast.Module]) -> set[str]:
    """The private names celery_idem defines itself, but the listed libraries' ones it overrides."""
    own: set[str] = set()
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                own.add(node.id)
            elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                  and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                own.add(node.attr)
            elif isinstance(node, ast.arg):
                own.add(node.arg)
    return own - {name for entry in PRIVATE_NAMES for name in _listed(entry)}


def _listed(entry: PrivateName) -> set[str]:
    """The names an entry covers: each private part (``_put``, ``_publish_batch``) and, for a
    private module, its dotted name (``celery._state``); an attribute by its last part
    (``request_stack``)."""
    dotted = entry.name.split(" ")[0]
    return {*re.findall(r"_\w+", entry.name), dotted, dotted.split(".")[-1]}


def listed_by_module() -> dict[str, set[str]]:
    """Module path under celery_idem/ -> the private names PRIVATE_NAMES lists for it."""
    out: dict[str, set[str]] = {}
    for entry in PRIVATE_NAMES:
        out.setdefault(entry.where.split(":")[0], set()).update(_listed(entry))
    return out


def _own_module_aliases(tree: ast.Module) -> set[str]:
    """The names a module binds to modules of celery_idem (``from . import x``, ``import celery_idem.x``)."""
    aliases: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("celery_idem")):
            aliases.update(a.asname or a.name for a in node.names)  # a module or a class of ours
        elif isinstance(node, ast.Import):
            aliases.update((a.asname or a.name).split(".")[0] for a in node.names
                           if a.name.startswith("celery_idem"))
    return aliases


def _findings(module: str, tree: ast.Module, libs: frozenset[str], own: set[str]) -> set[tuple[str, str]]:
    # self/cls are read as any object: a private name they do not define is inherited from
    # the library's class (Task._dump_pydantic_arguments on an IdempotentTask).
    ours = _own_module_aliases(tree)
    found: set[tuple[str, str]] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] in LIBRARIES and any(_private(p) for p in parts):
                    found.add((module, alias.name))
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            parts = node.module.split(".")
            if parts[0] in LIBRARIES:
                if any(_private(p) for p in parts):
                    found.add((module, node.module))
                found.update((module, a.name) for a in node.names if _private(a.name))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr", "setattr") and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
              and _private(node.args[1].value) and node.args[1].value in libs
              and not (isinstance(node.args[0], ast.Name) and node.args[0].id in ours)):
            found.add((module, node.args[1].value))  # getattr(obj, "_name"): the same access
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            if isinstance(node.value, ast.Name) and node.value.id in ours:
                continue
            if node.attr in libs and node.attr not in own:
                found.add((module, node.attr))
    return found


def private_uses() -> set[tuple[str, str]]:
    trees = _modules()
    own, libs = _own_names(trees), library_private_names()
    found: set[tuple[str, str]] = set()
    for module, tree in trees.items():
        found |= _findings(module, tree, libs, own)
    return found


def test_every_private_name_is_used_only_where_private_names_lists_it() -> None:
    listed = listed_by_module()
    found = private_uses()
    unlisted = sorted((module, name) for module, name in found - ALLOWED
                      if name not in listed.get(module, set()))
    assert not unlisted, (
        "private names of celery/kombu/redis/sqlalchemy/psycopg/mcp not listed for their module in "
        f"celery_idem.compat.PRIVATE_NAMES (list each, with its versions and fallback): {unlisted}")
    # The allow-list shrinks as names move: an entry no longer used must go (one the installed
    # libraries do not define, as an older Celery's compat run, cannot be found: not stale).
    libs = library_private_names()
    assert sorted(entry for entry in ALLOWED - found if entry[1] in libs) == []


def test_every_entry_names_a_module_that_uses_it() -> None:
    stale = []
    for entry in PRIVATE_NAMES:
        path = PACKAGE / entry.where.split(":")[0]
        last = re.findall(r"_\w+", entry.name)[-1] if "_" in entry.name else entry.name
        if not path.is_file() or last.split(".")[-1] not in path.read_text("utf-8"):
            stale.append(entry)
    assert stale == []


@pytest.mark.parametrize("source, expected", [
    ("from celery._state import get_current_app\n", {("m.py", "celery._state")}),
    ("import kombu.transport._x\n", {("m.py", "kombu.transport._x")}),
    ("from celery.app.task import _something\n", {("m.py", "_something")}),
    ("def f(channel):\n    return channel._q_for_pri\n", {("m.py", "_q_for_pri")}),
    ("def f(r):\n    r._maybe_set_cache()\n", {("m.py", "_maybe_set_cache")}),
    ("class A:\n    def f(self):\n        return self._q_for_pri\n", {("m.py", "_q_for_pri")}),  # inherited
    ("from . import stores\nx = stores._q_for_pri\n", set()),  # a module of ours
    ("def f(r):\n    return r.__dict__, r._not_a_library_name_at_all\n", set()),
    ("def f(t):\n    return getattr(t, '_q_for_pri', None)\n",  # kombu 5.4-5.7
     {("m.py", "_q_for_pri")}),
])
def test_the_scan_finds_what_it_must(source: str, expected: set[tuple[str, str]]) -> None:
    tree = ast.parse(source)
    assert _findings("m.py", tree, library_private_names(), set()) == expected


#: Names the scan above cannot see: a library's private method that a class of ours overrides
#: (a def is our own name to the scan), and a private attribute without an underscore
#: (``Task.request_stack``: ``push_request`` is the public verb). Each lives where it is listed.
WATCHED = ("_maybe_set_cache", "request_stack")


def test_watched_names_appear_only_where_listed() -> None:
    listed = listed_by_module()
    found = []
    for module, tree in _modules().items():
        for node in ast.walk(tree):
            name = (node.name if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                    else node.attr if isinstance(node, ast.Attribute) else None)
            if name in WATCHED and name not in listed.get(module, set()):
                found.append((module, name, node.lineno))
    assert found == [], f"move these behind celery_idem/compat.py: {found}"
