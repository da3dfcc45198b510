"""The documentation as a reader meets it: the built site offline, and the snippets.

* The scenarios page of the built site, opened in headless Chromium with no network but
  127.0.0.1, shows its sequence diagrams rendered (SVG), not raw text: mermaid is served by the
  site itself (scripts/mkdocs_hooks.py).
* Every ``python`` block of README.md and docs/*.md parses; the quickstart (the same in both)
  has no unused import, and it runs: its ``shop.py`` under a real worker started with its own
  command line, and its producer snippet against it.

The site is built with ``mkdocs`` from the docs toolchain (``make test`` installs it, as ``make
docs`` does; ``CELERY_IDEM_MKDOCS`` names another binary). Without it the site test is skipped
locally and fails in CI.
"""

from __future__ import annotations

import ast
import functools
import http.server
import os
import re
import shutil
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import IN_CI, REDIS_URL, require
from tests.integration.harness import ROOT, Worker, wait_for

DOCS = sorted((ROOT / "docs").glob("*.md"))
BLOCK = re.compile(r"^```(?P<lang>\w+)\n(?P<code>.*?)^```", re.S | re.M)


def _blocks(path: Path, lang: str) -> list[str]:
    return [m["code"] for m in BLOCK.finditer(path.read_text()) if m["lang"] == lang]


# -- the built site, offline ------------------------------------------------------------------


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    mkdocs = os.environ.get("CELERY_IDEM_MKDOCS") or shutil.which(
        "mkdocs", path=str(Path(sys.executable).parent))
    if not mkdocs:
        message = "mkdocs is not installed (make docs installs docs/requirements.txt)"
        if IN_CI:
            pytest.fail(message)
        pytest.skip(message)
    out = tmp_path_factory.mktemp("site")
    build = subprocess.run([mkdocs, "build", "--strict", "-q", "-d", str(out)], cwd=ROOT,
                           env={**os.environ, "NO_MKDOCS_2_WARNING": "1"}, capture_output=True,
                           text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-3000:]
    return out


@pytest.fixture
def served(site: Path) -> Iterator[str]:
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(Quiet, directory=str(site)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def rendered(browser: Any) -> int:
    """Diagrams drawn on the page: SVGs inside the shadow roots of Material's ``div.mermaid``.

    Material attaches them closed (invisible to page scripts), so the DevTools protocol, which
    pierces shadow roots, reads the tree.
    """
    doc = browser.execute_cdp_cmd("DOM.getDocument", {"depth": -1, "pierce": True})
    count = 0
    stack = [(doc["root"], False)]
    while stack:
        node, in_mermaid = stack.pop()
        if in_mermaid and node.get("nodeName", "").lower() == "svg":
            count += 1
            continue
        attrs = node.get("attributes", [])
        is_mermaid = node.get("nodeName") == "DIV" and "mermaid" in attrs[1::2]
        stack += [(r, True) for r in node.get("shadowRoots", []) if is_mermaid]
        stack += [(c, in_mermaid) for c in node.get("children", [])]
    return count


def test_the_scenarios_page_renders_its_diagrams_offline(
    served: str, site: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    from tests.browser import OFFLINE, chromium

    diagrams = (ROOT / "docs" / "scenarios.md").read_text().count("```mermaid")
    assert diagrams >= 10
    assert (site / "assets" / "javascripts" / "mermaid.min.js").stat().st_size > 1_000_000
    with chromium(tmp_path / "profile", monkeypatch, OFFLINE) as browser:
        # Given a reader with no network (every name but 127.0.0.1 fails to resolve)
        from selenium.common.exceptions import WebDriverException

        with pytest.raises(WebDriverException, match="ERR_NAME_NOT_RESOLVED"):
            browser.get("https://unpkg.com/")
        # When they open the scenarios page
        browser.get(f"{served}/scenarios/")
        # Then every diagram is drawn, and none is left as text
        wait_for(lambda: rendered(browser) == diagrams, timeout=30,
                 interval=0.2, what=f"{diagrams} rendered diagrams")
        assert browser.execute_script("return document.querySelectorAll('pre.mermaid').length") == 0
        # And nothing was loaded from anywhere but the site itself
        loaded = browser.execute_script(
            "return performance.getEntriesByType('resource').map(e => e.name)")
        assert [u for u in loaded if not u.startswith(served)] == [], loaded


# -- snippets ---------------------------------------------------------------------------------


def test_every_python_snippet_of_the_readme_and_the_docs_parses() -> None:
    for path in (ROOT / "README.md", *DOCS):
        for i, code in enumerate(_blocks(path, "python")):
            try:
                # Parsed, not compiled: an excerpt of a body may ``return`` at top level.
                ast.parse(code, f"{path.name}[python block {i}]")
            except SyntaxError as exc:
                raise AssertionError(f"{path.relative_to(ROOT)}: {exc}") from None


def _quickstart(path: Path) -> tuple[str, str, str]:
    """(shop.py, the worker command, the producer snippet) of the quickstart in ``path``."""
    python = _blocks(path, "python")
    shop = next(c for c in python if c.startswith("# shop.py"))
    producer = next(c for c in python if c.startswith("from shop import"))
    worker = next(line for c in _blocks(path, "sh") for line in c.splitlines()
                  if line.startswith("celery -A shop worker"))
    return shop, worker, producer


def test_the_quickstart_is_the_same_in_the_readme_and_the_docs_and_has_no_unused_import(
    tmp_path: Path,
) -> None:
    readme, docs = _quickstart(ROOT / "README.md"), _quickstart(ROOT / "docs" / "index.md")
    assert readme == docs
    shop, _, producer = docs
    for name, code in (("shop.py", shop), ("producer.py", producer)):
        (tmp_path / name).write_text(code)
    ruff = Path(sys.executable).parent / "ruff"
    out = subprocess.run([str(ruff), "check", "--isolated", "--select", "F", str(tmp_path)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout


@pytest.mark.worker
def test_the_quickstart_runs_under_a_real_worker(tmp_path: Path, redis_cleanup: None,
                                                 prefix: str) -> None:
    require(REDIS_URL, 6379, "Redis")
    shop, worker_line, producer = _quickstart(ROOT / "docs" / "index.md")
    # Its own queue and key prefix on the test Redis, so no other worker takes its tasks
    queue = f"quickstart-{uuid.uuid4().hex[:10]}"
    base = REDIS_URL.rstrip("/")
    shop = shop.replace("redis://127.0.0.1:6379/0", f"{base}/0").replace(
        "redis://127.0.0.1:6379/1", f"{base}/0")
    shop += f"\napp.conf.task_default_queue = {queue!r}\napp.conf.idempotency_key_prefix = {prefix!r}\n"
    (tmp_path / "shop.py").write_text(shop)
    env = {"PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}
    args = worker_line.split()
    assert args[:4] == ["celery", "-A", "shop", "worker"]
    worker = Worker(env, "quickstart", pool="solo", concurrency=1, app="shop",
                    extra=tuple(a for a in args[4:] if a not in ("-l", "INFO", "-E")))
    try:
        out = subprocess.run([sys.executable, "-c", producer + "\nprint(r1.id == r2.id, r1.get())"],
                             cwd=tmp_path, env={**os.environ, **env}, capture_output=True,
                             text=True, timeout=60)
    finally:
        worker.stop()
    assert out.returncode == 0, out.stderr[-3000:]
    same, result = out.stdout.split(" ", 1)
    assert result.startswith("{'order_id': 'ord_8891', 'charged': 4200")
    # One charge: the second enqueue was answered from the record (same id), or, when it was
    # published before the first finished, the worker's gate answered it as a duplicate
    assert same == "True" or worker.text().count("celery_idem duplicate key=shop.charge_card:") == 1
