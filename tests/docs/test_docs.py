"""The documentation as a reader meets it: the built site offline, and the snippets.

* The scenarios page of the built site, opened in headless Chromium with no network but
  127.0.0.1, shows its sequence diagrams rendered (SVG), not raw text: mermaid is served by the
  site itself (scripts/mkdocs_hooks.py).
* Every ``python`` block of README.md and docs/*.md parses; the quickstart (the same in both)
  has no unused import, and it runs: its ``shop.py`` under a real worker started with its own
  command line, and its producer snippet against it.
* The README for a first hour: the two set-up commands first, then Why, Install, Quick start (its
  own queue and Redis databases, the worker's log lines in the format and at the levels the
  worker logs them), Flower (a declared extra), the demo; a link to every docs page, Measured
  kept short, contributor material in docs/contributing.md; the Python versions CI runs.
* What the operator reads: no page shows a fencing token as a small number (tokens are
  clock-derived); ``waited`` and ``duplicate`` side by side in operations.md; configuration.md's
  re-queue bound is the code's ``REQUEUE_DELAY_CAP``, and its recovery table has the pool column.

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
        browser.get(f"{served}/scenarios.html")
        # Then every diagram is drawn, and none is left as text
        wait_for(lambda: rendered(browser) == diagrams, timeout=30,
                 interval=0.2, what=f"{diagrams} rendered diagrams")
        assert browser.execute_script("return document.querySelectorAll('pre.mermaid').length") == 0
        # And nothing was loaded from anywhere but the site itself
        loaded = browser.execute_script(
            "return performance.getEntriesByType('resource').map(e => e.name)")
        assert [u for u in loaded if not u.startswith(served)] == [], loaded
        # And each diagram keeps its natural size (scrolled sideways when wider than the page),
        # not shrunk to fit: mermaid's useMaxWidth is off (docs/assets/javascripts/mermaid-wide.js)
        sizes = diagram_sizes(browser)
        assert len(sizes) == diagrams
        assert all(width is not None and "max-width" not in style for width, style in sizes), sizes


def diagram_sizes(browser: Any) -> list[tuple[str | None, str]]:
    """(width attribute, style attribute) of every drawn diagram's SVG (see :func:`rendered`)."""
    doc = browser.execute_cdp_cmd("DOM.getDocument", {"depth": -1, "pierce": True})
    found: list[tuple[str | None, str]] = []
    stack = [(doc["root"], False)]
    while stack:
        node, in_mermaid = stack.pop()
        attrs = node.get("attributes", [])
        if in_mermaid and node.get("nodeName", "").lower() == "svg":
            pairs = dict(zip(attrs[::2], attrs[1::2], strict=True))
            width = pairs.get("width")
            found.append((width if width and width != "100%" else None, pairs.get("style", "")))
            continue
        is_mermaid = node.get("nodeName") == "DIV" and "mermaid" in attrs[1::2]
        stack += [(r, True) for r in node.get("shadowRoots", []) if is_mermaid]
        stack += [(c, in_mermaid) for c in node.get("children", [])]
    return found


#: The navigation's groups, in order: guides first, contributor pages apart.
NAV_GROUPS = ["Start", "Guides", "Operations", "Reference", "Project"]


def test_the_navigation_is_grouped_and_lists_every_page_once() -> None:
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    # mkdocs.yml names a Python function (!!python/name:); only its structure matters here.
    Loader.add_multi_constructor("tag:yaml.org,2002:python/", lambda *_: None)
    conf = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=Loader)
    assert conf["use_directory_urls"] is False
    nav = conf["nav"]
    assert [next(iter(group)) for group in nav] == NAV_GROUPS
    pages = [next(iter(entry.values())) for group in nav for entry in next(iter(group.values()))]
    assert sorted(pages) == sorted(p.name for p in DOCS) and len(set(pages)) == len(pages)
    project = next(iter(nav[-1].values()))
    assert [next(iter(e.values())) for e in project] == ["contributing.md"]


def test_the_built_site_reads_from_disk(site: Path, tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.browser import OFFLINE, chromium

    # Every page is a file (scenarios.html), so file:// links open pages, not folder listings.
    assert (site / "index.html").exists() and (site / "scenarios.html").exists()
    assert not (site / "scenarios").exists()
    with chromium(tmp_path / "profile", monkeypatch, OFFLINE) as browser:
        browser.get((site / "index.html").as_uri())
        groups = browser.execute_script(
            "return Array.from(document.querySelectorAll("
            "'.md-nav--primary > .md-nav__list > .md-nav__item--section > label, "
            ".md-nav--primary > .md-nav__list > .md-nav__item--nested > label'))"
            ".map(e => e.textContent.trim())")
        assert [g for g in groups if g] == NAV_GROUPS, groups
        # Following a link from the navigation opens the page itself
        link = browser.execute_script(
            "return Array.from(document.querySelectorAll('a.md-nav__link'))"
            ".map(a => a.href).find(h => h.endsWith('/reliability.html'))")
        assert link and link.startswith("file://"), link
        browser.get(link)
        assert browser.execute_script("return document.querySelector('article h1').textContent") \
            .strip().startswith("Reliability")
        assert "Index of" not in browser.title


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
    docs_shop = shop
    # Its own queue and key prefix on the test Redis, so no other worker takes its tasks
    queue = f"quickstart-{uuid.uuid4().hex[:10]}"
    base = REDIS_URL.rstrip("/")
    shop = re.sub(r"redis://127\.0\.0\.1:6379/\d+", f"{base}/0", shop)
    shop += f"\napp.conf.task_default_queue = {queue!r}\napp.conf.idempotency_key_prefix = {prefix!r}\n"
    (tmp_path / "shop.py").write_text(shop)
    env = {"PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}
    # The worker consumes this run's queue where the quickstart's names its own (-Q payments)
    args = [queue if a == _quickstart_queue(docs_shop) else a for a in worker_line.split()]
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
    # The README's expected log lines show the key this worker really used
    key = re.search(r"'idempotency_key': '([^']+)'", result)
    assert key and all(key[1] in line for line in _readme_log_lines() if "key=" in line), result


def test_no_mermaid_diagram_has_a_raw_semicolon() -> None:
    # mermaid ends a statement at ";": "Note over P: a; b" fails to parse and the diagram is
    # left as text. Write it as the entity "#59;".
    bad = [(path.name, line.strip()) for path in DOCS for block in _blocks(path, "mermaid")
           for line in block.splitlines() if ";" in line.replace("#59;", "")]
    assert bad == []


# -- the README for the first hour ----------------------------------------------------------------

README = ROOT / "README.md"


def _sections(path: Path) -> list[tuple[str, str]]:
    """(title, text) of every ``## `` section of ``path``, in order (code blocks included)."""
    parts = re.split(r"^## (.+)\n", path.read_text(), flags=re.M)
    return list(zip(parts[1::2], parts[2::2], strict=True))


def _quickstart_queue(shop: str) -> str:
    found = re.search(r'^app\.conf\.task_default_queue = "([^"]+)"', shop, re.M)
    assert found, "the quickstart's shop.py names no queue of its own (task_default_queue)"
    return found[1]


def _readme_log_lines() -> list[str]:
    """The worker log lines the README shows (its ``text`` blocks)."""
    return [line for block in _blocks(README, "text") for line in block.splitlines()
            if line.startswith("[")]


def test_the_readme_starts_with_the_two_commands_then_the_first_hours_sections() -> None:
    text = README.read_text()
    head = text[:text.index("\n## ")]
    # The project's rule: the README starts with the two commands that do all the set-up
    assert _blocks(README, "sh")[0] == "make demo\nmake test\n"
    assert text.index("```sh\nmake demo\nmake test\n```") < text.index("\n## ")
    titles = [title for title, _ in _sections(README)]
    assert titles[:5] == ["Why", "Install", "Quick start", "Flower", "The demo: `make demo`"], titles
    # Contributor material is in docs/contributing.md, not before Why; make test says what it costs
    for word in ("test-fast", "test-compat", "marker", "warnings"):
        assert word not in head, word
    assert "12-25 minutes" in head and "apt-get" in head and "scripts/browser.sh" in head
    contributing = (ROOT / "docs" / "contributing.md").read_text()
    for needle in ("12-25 min", "apt-get install chromium chromium-driver", "make test-fast",
                   "make test-compat", "make test-pythons", "--strict-markers", "filterwarnings"):
        assert needle in contributing, needle


def test_the_quickstart_has_its_own_queue_and_redis_databases() -> None:
    # A shared Redis's db 0 and Celery's default queue "celery" are often another app's
    for path in (README, ROOT / "docs" / "index.md"):
        shop, worker_line, _ = _quickstart(path)
        dbs = [int(db) for db in re.findall(r"redis://[^\"/]+/(\d+)", shop)]
        assert len(dbs) == 2 and not {0, 1} & set(dbs), (path.name, dbs)
        queue = _quickstart_queue(shop)
        assert queue != "celery"
        args = worker_line.split()
        assert args[args.index("-Q") + 1] == queue, worker_line


def test_the_readmes_log_lines_are_what_the_worker_logs() -> None:
    import logging

    from celery_idem import events

    lines = _readme_log_lines()
    decisions = [line for line in lines if "] celery_idem " in line]
    # The claim and the record (DEBUG) and a duplicate reaching the worker (INFO) are shown
    assert [d.split("] celery_idem ", 1)[1].split()[0] for d in decisions] == [
        "claimed", "recorded", "duplicate"]
    line_format = re.compile(
        r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}: (?P<level>[A-Z]+)/[\w-]+\] "
        r"celery_idem (?P<outcome>\w+) key=\S+ task_id=\S+ token=\d+ original_task_id=\S+"
        r"(?: \w+=\S+)*$")
    for line in decisions:
        m = line_format.match(line)
        assert m, line
        # At the level events.log_outcome logs that outcome at
        level = events._LOUD.get(events.Outcome(m["outcome"]), logging.DEBUG)
        assert m["level"] == logging.getLevelName(level), line
    # The duplicate names the task that ran, as the first line's received task
    ran = re.search(r"Task shop\.charge_card\[([\w-]+)\] received", lines[0])
    assert ran and f"original_task_id={ran[1]}" in decisions[-1]


def test_every_extra_the_docs_install_is_declared_and_flower_is_one() -> None:
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    assert any(req.startswith("flower") for req in extras["flower"])
    for path in (README, ROOT / "docs" / "index.md"):
        named = re.findall(r"(?:'\.|celery-idem)\[([\w,]+)\]", path.read_text())
        assert named, path.name
        unknown = {e for group in named for e in group.split(",")} - set(extras)
        assert not unknown, (path.name, unknown)
    install = dict(_sections(README))["Install"]
    assert "pip install '.[redis,flower]'" in install
    assert "pip install 'celery-idem[redis,flower]'" in install


def test_the_readmes_flower_section_loads_the_extension() -> None:
    flower = dict(_sections(README))["Flower"]
    conf = next(c for c in _blocks(README, "python") if c.startswith("# flowerconfig.py"))
    assert "import celery_idem.contrib.flower\n" in conf and "celery_idem.contrib.flower.install()" in conf
    assert "celery -A shop flower --conf=flowerconfig.py" in flower
    # The [flower] extra makes `celery flower` a command (the dev venv has it through [dev])
    celery = Path(sys.executable).parent / "celery"
    out = subprocess.run([str(celery), "flower", "--help"], capture_output=True, text=True,
                         timeout=60, cwd=ROOT)
    assert out.returncode == 0 and "Usage: celery flower" in out.stdout, out.stderr[-2000:]


def test_the_readme_links_every_docs_page_and_keeps_measured_short() -> None:
    text = README.read_text()
    missing = [p.name for p in DOCS if f"(docs/{p.name}" not in text]
    assert missing == [], missing
    measured = dict(_sections(README))["Measured"]
    assert "docs/benchmarks.md" in measured and "docs/reliability.md" in measured
    assert len(measured.strip().splitlines()) <= 15, "Measured is a summary: details in the docs"


def test_the_python_versions_ci_runs_are_the_ones_declared() -> None:
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {c.rsplit(" :: ", 1)[1] for c in project["classifiers"]
                if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c)}
    pyvers = re.search(r"^PYVERS\s*\?=\s*(.+)$", (ROOT / "Makefile").read_text(), re.M)
    assert pyvers
    # The main venv's version runs the whole suite; make test-pythons the others
    assert declared == {*pyvers[1].split(), "3.11"}, declared
    assert project["requires-python"] == f">={min(declared, key=lambda v: int(v.split('.')[1]))}"
    assert "make test-pythons" in (ROOT / ".ci" / "run").read_text()


# -- operator wording ----------------------------------------------------------------------------

#: A fencing token written as a small number. Tokens are ``max(previous + 1, store clock in µs)``
#: (celery_idem/stores/base.py ``next_token``), e.g. 1796461362362268: a page shows a real one,
#: or ``T1``/``T2`` with a note saying what real ones look like. ``previous token + 1`` (the
#: formula itself) is allowed.
SMALL_TOKEN = re.compile(
    # token 1, token=2, "idempotency_token": 1 (not an LLM's max_tokens=1024)
    r"(?<![a-z])(?<!max_)tokens?[\s=:\"'`*(]{0,4}(?:is now |was |at )?\d{1,6}\b"
    r"|(?<!previous )(?<![a-z])token \+ ?1\b"  # token + 1
    r"|\b(?:record|release|renew|write)\(key, \d{1,6}\b"  # record(key, 2, done, result)
    r"|\bhighest_seen[\s=:\"'`]{0,4}\d{1,6}\b",  # the example provider's answer
    re.I)


def _small_tokens(path: Path) -> list[str]:
    found = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        checked = line
        if path.name == "contract.md" and line.startswith("| "):
            # The history table: "Contract said" and "Why" quote the old design and old behaviour
            # (tokens restarting at 1); "celery_idem does" is today's.
            cells = line.split("|")
            checked = cells[3] if len(cells) == 6 else line
        found += [f"{path.relative_to(ROOT)}:{number}: {m[0]!r}" for m in SMALL_TOKEN.finditer(checked)]
    return found


def test_no_page_shows_a_fencing_token_as_a_small_number() -> None:
    # The pattern finds what it is meant to
    assert [m[0] for m in SMALL_TOKEN.finditer(
        "CLAIMED, token 1; takeover, token + 1; record(key, 2, done); \"idempotency_token\": 1; "
        "the token is now 2; highest_seen: 2; TAKEOVER, token T2; max(previous token + 1, clock); "
        "token 1796461362362268")] == [
        "token 1", "token + 1", "record(key, 2", "token\": 1", "token is now 2", "highest_seen: 2"]
    found = [hit for path in (README, *DOCS) for hit in _small_tokens(path)]
    assert found == [], "\n".join(found)


def _table_after(text: str, marker: str) -> list[list[str]]:
    """The cells of the first markdown table after ``marker`` (header first, no separator)."""
    start = text.index(marker)
    rows = []
    for line in text[start:].splitlines()[1:]:
        stripped = line.strip()
        if not stripped.startswith("|"):
            if rows:
                break
            continue
        cells = [c.strip() for c in stripped.strip("|").split("|")]
        if not all(set(c) <= set("-: ") for c in cells):
            rows.append(cells)
    return rows


def test_operations_explains_waited_and_duplicate_side_by_side() -> None:
    from celery_idem.events import Outcome

    text = (ROOT / "docs" / "operations.md").read_text()
    waited, duplicate = Outcome.WAITED.value, Outcome.DUPLICATE.value
    marker = f"**`{waited}` and `{duplicate}`, side by side.**"
    assert marker in text
    # The outcomes table lists both (as the names the events and log lines carry)
    outcomes = {row[0] for row in _table_after(text, "| outcome | meaning |")}
    assert {f"`{waited}`", f"`{duplicate}`"} <= outcomes
    # One table, one column each, comparing them row by row
    header, *rows = _table_after(text, marker)
    assert header[1:] == [f"`{duplicate}`", f"`{waited}`"], header
    aspects = [row[0] for row in rows]
    assert {"the key when the copy arrived", "what the copy did"} <= set(aspects), aspects
    assert all(len(row) == 3 and row[1] and row[2] and row[1] != row[2] for row in rows), rows
    when = dict((row[0], row[1:]) for row in rows)["the key when the copy arrived"]
    assert "`done`" in when[0] and "`in_progress`" in when[1], when
    # And says what both have in common: neither ran the body
    start = text.index(marker)
    end = text.find("\n\n**", start + 1)  # the next bold-led paragraph
    section = text[start:end if end > start else None]
    assert "did not run the body" in section and "Neither ran the body" in section


def test_configuration_states_the_requeue_bound_of_the_code() -> None:
    from celery_idem.probe import REQUEUE_DELAY_CAP

    cap = f"{REQUEUE_DELAY_CAP:g}"
    text = (ROOT / "docs" / "configuration.md").read_text()
    paragraph = re.search(r"While the worker runs, a message whose store cannot be used is "
                          r"re-queued.*?\n\n", text, re.S)
    assert paragraph, "configuration.md: the paragraph on re-queues for an unavailable store"
    flat = " ".join(paragraph[0].split())
    # The delay doubles from 1 s up to the cap, then stays there, up to the default bound
    doubling = [1]
    while doubling[-1] * 2 < REQUEUE_DELAY_CAP:
        doubling.append(doubling[-1] * 2)
    steps = ", ".join(str(d) for d in doubling[1:])
    assert f"after 1 s, then {steps} and {cap} s, and every {cap} s after that" in flat, flat
    from celery_idem.config import Settings

    assert f"(default {Settings.store_requeues}:" in flat and "`StoreUnavailable`" in flat, flat
    # Every page that gives the countdown as a formula gives the same cap
    for path in DOCS:
        for bound in re.findall(r"min\(2\^n, (\d+(?:\.\d+)?)\)", path.read_text()):
            assert float(bound) == REQUEUE_DELAY_CAP, (path.name, bound)


def test_the_recovery_table_has_the_pool_column() -> None:
    text = (ROOT / "docs" / "configuration.md").read_text()
    header, *rows = _table_after(text, "Measured with `python -m bench.recovery`")
    assert header[0] == "broker" and header[1].startswith("pool"), header
    redis = [(row[1], row[-1]) for row in rows if row[0] == "Redis"]
    # Prefork on the Redis broker brings the message back after the visibility timeout...
    assert any(pool == "prefork" and re.fullmatch(r"[\d.-]+ s after the kill", result)
               for pool, result in redis), redis
    # ...gevent and eventlet never do by themselves: one row for both, saying so
    green = [result for pool, result in redis if "gevent" in pool and "eventlet" in pool]
    assert len(green) == 1 and "never" in green[0], redis


# -- the first production week: checklist, limits, comparison ---------------------------------


def _checklist(text: str) -> list[str]:
    """The checklist's items, each with its continuation lines joined."""
    return [" ".join(item.split()) for item in re.findall(r"^- \[ \] (.*?)(?=^- \[ \]|^#|\Z)",
                                                          text, re.S | re.M)]


def test_the_production_checklist_has_a_line_and_a_link_for_each_subject() -> None:
    items = _checklist((ROOT / "docs" / "production.md").read_text())
    subjects = ["Durability", "wait_replicas", "Sentinel or Cluster", "store outage",
                "Time limits", "Workers and pools", "Beat", "Django", "MCP server",
                "Events and Flower", "OpenTelemetry", "changelog"]
    for subject in subjects:
        found = [i for i in items if i.startswith("**") and subject in i.split("**")[1]]
        assert found, f"production.md: no checklist item for {subject!r}"
        # Each item links the page that says more (a relative docs page, maybe with an anchor)
        assert re.search(r"\]\([\w-]+\.md(#[\w-]+)?\)", found[0]), found[0]
    # The producer's events are the line to add to see duplicates answered at delay()
    flower = next(i for i in items if "Events and Flower" in i)
    assert "idempotency_events = True" in flower and "-E" in flower
    nav = (ROOT / "mkdocs.yml").read_text()
    assert "production.md" in nav and "comparison.md" in nav


def test_limits_answers_the_lost_message_and_the_crash_after_commit() -> None:
    sections = dict(_sections(ROOT / "docs" / "limits.md"))
    lost = " ".join(sections["The broker lost my message"].split())
    commit = " ".join(sections["My process died after COMMIT"].split())
    # Each says what happens, then what to do: the intent and its relay, or a re-send
    assert "reaches no worker" in lost and "idempotency_intent=True" in lost
    assert "reliability.md#lost-messages" in lost
    assert "no message exists" in commit and "idempotency_intent=True" in commit
    assert "reliability.md#the-transactional-enqueue" in commit and "re-send" in commit


def test_the_comparison_sets_the_libraries_side_by_side_with_the_benchmark_figures() -> None:
    text = (ROOT / "docs" / "comparison.md").read_text()
    header = next(line for line in text.splitlines() if line.startswith("| | celery-idem"))
    for library in ("celery_once", "celery-singleton", "Powertools", "outbox"):
        assert library in header, (library, header)
    measured = dict(_sections(ROOT / "docs" / "comparison.md"))["Measured"]
    bench = (ROOT / "docs" / "benchmarks.md").read_text()
    rows = re.findall(r"^\| (plain Celery|celery-idem, \w+ store|celery_once|celery-singleton|"
                      r"Powertools) \| ([\d,]+) \|", measured, re.M)
    assert len(rows) == 12, rows  # six systems in each of the two tables
    for system, rate in rows:
        # Every figure is one benchmarks.md has (its median column)
        assert re.search(rf"\|\s+{re.escape(rate)} \|", bench), (system, rate)


def test_the_readmes_flower_section_shows_how_to_see_the_duplicates() -> None:
    flower = dict(_sections(README))["Flower"]
    # The producer's line, as code to copy: the quick start's second delay() publishes nothing
    assert "```python\napp.conf.idempotency_events = True" in flower
    flat = " ".join(flower.split())
    for promise in ("*Idempotency outcome* `recorded`", "*Idempotency duplicates*",
                    "`<copy's id> (duplicate)`", "*Idempotency outcome* column"):
        assert promise in flat, promise
