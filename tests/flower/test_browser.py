"""Flower's pages with the extension, in headless Chromium (Debian's ``chromium``): the task page
of a duplicate, the task page of the run it was answered from, and the task list.

Needs ``chromium`` and ``chromium-driver`` (``bash scripts/browser.sh``) and the ``selenium``
package. Selenium is pointed at /usr/bin/chromedriver and /usr/bin/chromium, so its driver
manager never downloads anything. Set ``CELERY_IDEM_DOCS_SCREENSHOT=1`` to refresh the
screenshot in docs/img/ (the test always writes one under its tmp_path).
"""

from __future__ import annotations

import os
import re
import shutil
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from selenium import webdriver
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from tests.browser import chromium
from tests.flower.conftest import Stack
from tests.integration import app as tasks
from tests.integration.harness import ROOT

pytestmark = pytest.mark.worker

DOCS_SCREENSHOT = ROOT / "docs" / "img" / "flower-duplicate.png"


@pytest.fixture
def browser(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[webdriver.Chrome]:
    with chromium(tmp_path / "chromium-profile", monkeypatch) as driver:
        yield driver


def test_the_task_page_of_a_duplicate_shows_its_key_and_the_original_task_id(
    stack: Stack, browser: webdriver.Chrome, tmp_path: Path
) -> None:
    # Given a charge and a duplicate of it that reached a worker
    first = tasks.charge.delay("ord_8891", 4200)
    first.get(timeout=30)
    dup = tasks.app.send_task("tests.integration.app.charge", ("ord_8891", 4200),
                              {"note": "retry by the agent"})
    dup.get(timeout=30)
    key = tasks.charge.idempotency_key_for(("ord_8891", 4200))
    stack.flower.wait_task(dup.id, lambda t: t.get("idempotency_outcomes") == ["duplicate"]
                           and t.get("state") == "SUCCESS", what="the duplicate in Flower")
    # When an operator opens the duplicate's task page
    browser.get(f"{stack.flower.url}/task/{dup.id}")
    WebDriverWait(browser, 20).until(lambda d: key in d.find_element(By.TAG_NAME, "body").text)
    # Then it says, without a click, that it was a duplicate, of which key and which task
    rows = {
        row.find_element(By.TAG_NAME, "dt").text: row.find_element(By.TAG_NAME, "dd").text
        for row in browser.find_elements(By.CSS_SELECTOR, ".detail-row")
    }
    assert rows["UUID"].splitlines()[0] == dup.id
    assert rows["Idempotency outcome"] == "duplicate"
    assert rows["Idempotency key"] == key
    assert rows["Original task id"] == first.id
    assert rows["Status"] == "SUCCESS"
    # And the screenshot for the docs is taken of exactly this page (its top: the decisions)
    shot = tmp_path / "flower-duplicate.png"
    assert browser.save_screenshot(str(shot))
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000
    if os.environ.get("CELERY_IDEM_DOCS_SCREENSHOT"):
        DOCS_SCREENSHOT.parent.mkdir(exist_ok=True)
        shutil.copyfile(shot, DOCS_SCREENSHOT)


def _rows(browser: webdriver.Chrome) -> dict[str, str]:
    return {row.find_element(By.TAG_NAME, "dt").text: row.find_element(By.TAG_NAME, "dd").text
            for row in browser.find_elements(By.CSS_SELECTOR, ".detail-row")}


def test_the_run_s_page_says_recorded_on_its_worker_and_lists_the_answers_given_from_it(
    stack: Stack, browser: webdriver.Chrome, producer_events: None,
) -> None:
    # Given the README's quick start: a charge, the same charge again (answered at enqueue under
    # the run's id, from a producer that sends events), and a copy that reached the worker
    run = tasks.charge.delay("ord_run_page", 4200)
    run.get(timeout=30)
    again = tasks.charge.delay("ord_run_page", 4200, note="retry by the agent")
    assert again.id == run.id and again.get(timeout=5) == run.get()
    copy = tasks.app.send_task("tests.integration.app.charge", ("ord_run_page", 4200))
    copy.get(timeout=30)
    stack.flower.wait_task(run.id, lambda t: copy.id in (t.get("idempotency_duplicates") or "")
                           and "answered" in (t.get("idempotency_duplicates") or ""),
                           what="both answers on the run")
    # When an operator opens the run's task page
    browser.get(f"{stack.flower.url}/task/{run.id}")
    WebDriverWait(browser, 20).until(lambda d: copy.id in d.find_element(By.TAG_NAME, "body").text)
    rows = _rows(browser)
    # Then it says recorded, names the worker that ran it, and lists the answers from its record
    assert rows["Idempotency outcome"] == "recorded"
    assert rows["Worker"] == f"{stack.worker.name}@{socket.gethostname()}"
    duplicates = rows["Idempotency duplicates"]
    assert f"{copy.id} (duplicate)" in duplicates
    assert re.search(r"answered at enqueue on \S+@", duplicates), duplicates
    # And every label reads as words (no "dETAil")
    assert all((label[:1].isupper() and label[1:] == label[1:].lower()) or label in ("UUID",)
               for label in rows), list(rows)


def test_the_task_list_has_an_outcome_column(stack: Stack, browser: webdriver.Chrome) -> None:
    first = tasks.charge.delay("ord_list_column", 4200)
    first.get(timeout=30)
    copy = tasks.app.send_task("tests.integration.app.charge", ("ord_list_column", 4200))
    copy.get(timeout=30)
    stack.flower.wait_task(copy.id, lambda t: t.get("idempotency_outcome") == "duplicate")
    browser.get(f"{stack.flower.url}/tasks")
    # The header row the reader sees (DataTables draws it above the scrolled body)
    headers = WebDriverWait(browser, 20).until(
        lambda d: [th.text for th in d.find_elements(By.CSS_SELECTOR, ".dataTables_scrollHead th")
                   if th.text] or None)
    assert [h.lower() for h in headers[:4]] == ["name", "uuid", "state", "idempotency outcome"]

    def outcome_of(task_id: str) -> str | None:
        cells = browser.find_elements(By.CSS_SELECTOR, f"tr[id='{task_id}'] td")
        return cells[3].text if len(cells) > 3 else None

    WebDriverWait(browser, 20).until(lambda d: outcome_of(copy.id) == "duplicate")
    assert outcome_of(first.id) == "recorded"
