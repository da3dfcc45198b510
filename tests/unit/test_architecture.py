"""The package's import graph, and docs/architecture.md held to the tree.

* No import cycle, imports inside functions and by-name imports included. What counts as an
  import is ``scripts/architecture.py``'s docstring: every ``import`` and ``from ... import``
  wherever it is (relative ones resolved, ``from . import x`` to the submodule ``x`` when it is
  one), an edge to the module named and not to the packages above it, and a string constant
  that is exactly a celery_idem submodule's dotted name (``importlib.import_module`` by name is
  an import like any other). Imports under ``if TYPE_CHECKING:`` never run and are left out.
* No import from a lower group of the page's flowchart (core < seam < add-ons) into a higher
  one, and no ``contrib`` name in the code of the core (add-ons are found through entry point
  groups); every module is in a group; each arrow the flowchart draws is backed by an import.
* The page's tree and sizes are what ``python scripts/architecture.py`` writes: every module
  listed with its line count, none listed that does not exist.
* Every core module with logic has a test module named after it (``_test_file``), or is
  in ``TESTED_ELSEWHERE`` with the test module that holds its tests.
"""

from __future__ import annotations

import ast
import importlib.util
import itertools
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

# No Celery, kombu or redis-py code runs here: make test-compat runs it on its first Celery only.
pytestmark = pytest.mark.celery_independent

ROOT = Path(__file__).resolve().parents[2]
RUN = "run `python scripts/architecture.py` and commit docs/architecture.md"


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("architecture_script",
                                                  ROOT / "scripts" / "architecture.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


arch = _script()


def _edges_text(cycles: list[list[str]], graph: dict[str, dict[str, int]]) -> str:
    return "; ".join(
        " -> ".join(f"{a} (line {graph[a][b]})" for a, b in itertools.pairwise(cycle))
        + f" -> {cycle[-1]}" for cycle in cycles)


# -- cycles ---------------------------------------------------------------------------------------


def test_no_import_cycles() -> None:
    graph = arch.graph()
    found = arch.cycles(graph)
    assert found == [], "import cycles (each import's line in the module before it): " + \
        _edges_text(found, graph)


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    package = tmp_path / "celery_idem"
    for name, text in files.items():
        path = package / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return package


def test_the_checker_sees_imports_inside_functions_relative_and_by_name(tmp_path: Path) -> None:
    package = _package(tmp_path, {
        "__init__.py": "def __getattr__(name):\n    from . import a\n    return a\n",
        "a.py": "from .sub import b\n",
        "sub/__init__.py": "",
        "sub/b.py": "def f():\n    from .. import c\n",
        "c.py": "import importlib\nimportlib.import_module('celery_idem.a')\n",
        # Under TYPE_CHECKING: no edge. A logger named after the package: no edge either.
        "d.py": "import logging\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                "    from . import e\nlogger = logging.getLogger('celery_idem')\n",
        "e.py": "from . import d\n",
        "f.py": "from celery_idem import d\n",
    })
    graph = arch.graph(package)
    assert graph["celery_idem"] == {"celery_idem.a": 2}
    assert graph["celery_idem.sub.b"] == {"celery_idem.c": 2}
    assert graph["celery_idem.c"] == {"celery_idem.a": 2}
    assert graph["celery_idem.d"] == {}
    assert graph["celery_idem.f"] == {"celery_idem.d": 1}
    assert arch.cycles(graph) == [["celery_idem.a", "celery_idem.sub.b", "celery_idem.c",
                                   "celery_idem.a"]]


# -- groups and the flowchart ---------------------------------------------------------------------


def test_no_import_from_a_lower_group_to_a_higher_one() -> None:
    graph = arch.graph()
    upward = {
        (module, target): line
        for module, targets in graph.items() for target, line in targets.items()
        if arch.group_of(module) in arch.RANKS and arch.group_of(target) in arch.RANKS
        and arch.RANKS[arch.group_of(module)] < arch.RANKS[arch.group_of(target)]
    }
    assert not upward, "imports from a lower group into a higher one: " + ", ".join(
        f"{a} (line {line}) -> {b}" for (a, b), line in sorted(upward.items()))


def _code_strings(path: Path) -> list[tuple[int, str]]:
    """The string constants of a module that are not docstrings, with their lines."""
    tree = ast.parse(path.read_text(), str(path))
    docs = {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and node.body and isinstance(node.body[0], ast.Expr)
            and isinstance(node.body[0].value, ast.Constant)}
    return [(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs]


def test_the_core_names_no_add_on() -> None:
    # Neither an import nor a name to load one by: add-ons come through the entry point groups.
    named = {
        f"{name} (line {line})"
        for name, path in arch.modules().items() if arch.group_of(name) != "addons"
        for line, text in _code_strings(path) if "contrib" in text
    }
    named |= {f"{name} imports {target}" for name, targets in arch.graph().items()
              if arch.group_of(name) != "addons" for target in targets
              if arch.group_of(target) == "addons"}
    assert not named, f"the core names contrib: {sorted(named)}"


def test_the_add_on_check_sees_a_name_in_code_and_not_in_a_docstring(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text('"""Loads celery_idem.contrib.otel."""\nX = "celery_idem.contrib.otel"\n')
    assert _code_strings(module) == [(2, "celery_idem.contrib.otel")]


def test_every_module_is_in_a_group_and_the_seam_names_modules_that_exist() -> None:
    names = set(arch.modules())
    assert names >= arch.SEAM, f"not modules, drop from SEAM: {arch.SEAM - names}"
    assert {arch.group_of(name) for name in names} <= set(arch.RANKS)


def _flowchart() -> tuple[dict[str, str], dict[str, set[str]], list[tuple[str, str]]]:
    """``(group of each subgraph, modules of each node, arrows)`` of the page's flowchart."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    chart = re.search(r"```mermaid\nflowchart TD\n(.*?)```", text, re.S)
    assert chart, "docs/architecture.md has no mermaid flowchart"
    known = arch.modules()
    subgraphs: dict[str, str] = {}
    nodes: dict[str, set[str]] = {}
    members: dict[str, set[str]] = {}
    arrows: list[tuple[str, str]] = []
    current = None
    for line in chart.group(1).splitlines():
        line = line.strip()
        if m := re.match(r"subgraph (\w+)\[", line):
            current = m.group(1)
            subgraphs[current] = current
            members[current] = set()
        elif line == "end":
            current = None
        elif m := re.match(r"(\w+)\[(.*)\]$", line):
            node, label = m.groups()
            paths = re.findall(r"([\w/]+(?:\.py|/))", label.split(":")[0])
            mods: set[str] = set()
            directory = ""  # `contrib/cli.py + cli_output.py`: the second in the first's
            for path in paths:
                if "/" in path.rstrip("/"):
                    directory = path.rstrip("/").rpartition("/")[0] + "/"
                elif not path.endswith("/"):
                    path = directory + path
                dotted = "celery_idem." + path.removesuffix(".py").strip("/").replace("/", ".")
                mods |= {name for name in known if name == dotted
                         or (path.endswith("/") and name.startswith(dotted + "."))}
            assert mods, f"flowchart node {node}[{label}] names no module of celery_idem/"
            nodes[node] = mods
            if current:
                members[current] |= mods
        elif "-->" in line:
            left, right = (side.split("&") for side in line.split("-->"))
            arrows += [(a.strip(), b.strip()) for a in left for b in right]
    nodes.update(members)
    return subgraphs, nodes, arrows


def test_the_flowchart_groups_are_the_checked_ones_and_its_arrows_hold() -> None:
    subgraphs, nodes, arrows = _flowchart()
    assert list(subgraphs) == sorted(arch.RANKS, key=arch.RANKS.get, reverse=True), \
        "the flowchart's subgraphs, top to bottom, must be scripts/architecture.py's RANKS"
    for group in subgraphs:
        wrong = {name for name in nodes[group] if arch.group_of(name) != group}
        assert not wrong, f"flowchart group {group} shows modules of another group: {wrong}"
    graph = arch.graph()
    for a, b in arrows:
        assert a in nodes and b in nodes, f"flowchart arrow {a} --> {b}: unknown node"
        backed = any(target in nodes[b] for module in nodes[a] for target in graph.get(module, {}))
        assert backed, f"flowchart arrow {a} --> {b}: no module of {a} imports one of {b}"


# -- the generated part of the page ---------------------------------------------------------------


def test_the_page_is_what_the_script_writes() -> None:
    page = (ROOT / "docs" / "architecture.md").read_text()
    assert arch.BEGIN in page and arch.END in page, f"the generated part's markers are gone; {RUN}"
    assert arch.rewrite() == page, f"docs/architecture.md's tree or sizes are stale: {RUN}"


def test_the_tree_lists_every_module_and_no_other() -> None:
    part = arch.generated()
    listed: set[str] = set()
    stack: list[str] = []
    tree = re.search(r"```text\n.*?\n(.*?)```", part, re.S)
    assert tree
    for line in tree.group(1).splitlines():
        m = re.match(r"((?:[│ ] {3})*)[├└]── (\S+)", line)
        if not m:
            continue
        depth = len(m.group(1)) // 4
        del stack[depth:]
        name = m.group(2)
        if name.endswith("/"):
            stack.append(name.rstrip("/"))
        else:
            listed.add(".".join(["celery_idem", *stack, name.removesuffix(".py")])
                       .removesuffix(".__init__"))
    assert listed == set(arch.modules())


@pytest.mark.parametrize("name", ["extra/__init__.py", "extra/wire.py"])
def test_a_new_package_is_listed_by_the_script(tmp_path: Path, name: str) -> None:
    package = _package(tmp_path, {"__init__.py": '"""Root."""\n', "extra/__init__.py":
                                  '"""The extras. Off with one switch."""\n',
                                  "extra/wire.py": '"""A wire client."""\nX = 1\n'})
    part = arch.generated(package)
    assert name.split("/")[-1] in part and "extra/" in part
    assert "| core | 2 | 3 |" in part


def test_no_module_is_over_600_lines() -> None:
    over = {name: n for name, path in arch.modules().items()
            if (n := len(path.read_text().splitlines())) > 600}
    assert over == {}, f"modules over 600 lines (split them): {over}"


#: The core's lines (celery_idem/ without contrib/, the fast paths and the intents included, as
#: ``wc -l`` counts them): a core a newcomer reads in an afternoon. The aim is 7,500: lower it as
#: the core shrinks, and let a feature that grows the core pay for its lines there first.
CORE_LIMIT = 8_150


def test_the_core_is_not_over_its_limit() -> None:
    core = {name: len(path.read_text().splitlines()) for name, path in arch.modules().items()
            if arch.group_of(name) != "addons"}
    assert sum(core.values()) <= CORE_LIMIT, (
        f"the core (celery_idem/ without contrib/) is {sum(core.values()):,} lines, over "
        f"CORE_LIMIT {CORE_LIMIT:,}: move what is not the contract to contrib/, delete a fast "
        f"path that does not pay, or say it in fewer lines")



# -- a test module for each core module -----------------------------------------------------------

#: Core modules whose tests live in a test module named otherwise, and where.
TESTED_ELSEWHERE = {
    "celery_idem": "tests/unit/test_public_api.py",  # its lazily imported names
    # The store contract, run against every store kind: the memory store is one of them.
    "celery_idem.stores.base": "tests/stores/test_contract.py",
    "celery_idem.stores.memory": "tests/stores/test_contract.py",
    "celery_idem.stores.sql_records": "tests/stores/test_contract.py",
    "celery_idem.stores.redis_intents": "tests/stores/test_intents_contract.py",
    "celery_idem.stores.sql_intents": "tests/stores/test_intents_contract.py",
}


def _test_file(name: str) -> str:
    """The test module's file name for module ``name``: ``celery_idem.enqueue`` ->
    ``test_enqueue.py``, ``celery_idem.stores.redis`` -> ``test_redis.py`` (in tests/stores),
    ``celery_idem.stores.sql.store`` -> ``test_sql_store.py``, ``celery_idem.stores`` ->
    ``test_stores.py``."""
    parts = name.split(".")[1:]
    if parts[:1] == ["stores"] and len(parts) > 1:
        parts = parts[1:]
    return "test_" + "_".join(parts) + ".py"



def _has_logic(path: Path) -> bool:
    return any(isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
               for node in ast.walk(ast.parse(path.read_text(), str(path))))


def test_every_core_module_with_logic_has_a_test_module() -> None:
    missing, stale = [], []
    for name, path in sorted(arch.modules().items()):
        if arch.group_of(name) == "addons" or not _has_logic(path):
            continue
        if name in TESTED_ELSEWHERE:
            if not (ROOT / TESTED_ELSEWHERE[name]).is_file():
                stale.append(f"{name}: {TESTED_ELSEWHERE[name]}")
            continue
        file = _test_file(name)
        if not any((ROOT / "tests" / folder / file).is_file() for folder in ("unit", "stores")):
            missing.append(f"{name}: tests/unit/{file} or tests/stores/{file}")
    assert not missing, f"core modules without a test module of their own: {missing}"
    assert not stale, f"TESTED_ELSEWHERE names a test module that does not exist: {stale}"


def test_the_test_module_names() -> None:
    assert [_test_file(name) for name in (
        "celery_idem.enqueue", "celery_idem.stores", "celery_idem.stores.redis",
        "celery_idem.stores.sql.store")] == [
        "test_enqueue.py", "test_stores.py", "test_redis.py", "test_sql_store.py"]
