"""Flower's task page of a duplicate, in headless Chromium (Debian's ``chromium``).

Needs ``chromium`` and ``chromium-driver`` (``bash scripts/browser.sh``) and the ``selenium``
package. Selenium is pointed at /usr/bin/chromedriver and /usr/bin/chromium, so its driver
manager never downloads anything. Set ``CELERY_IDEM_DOCS_SCREENSHOT=1`` to refresh the
screenshot in docs/img/ (the test always writes one under its tmp_path).
"""

from __future__ import annotations

import os
import shutil
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
