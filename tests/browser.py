"""Headless Chromium for the browser tests (Debian's ``chromium`` and ``chromedriver``).

Installed by ``bash scripts/browser.sh``. Selenium is pointed at /usr/bin/chromedriver and
/usr/bin/chromium, so its driver manager never downloads anything.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--disable-dev-shm-usage", "--window-size=1280,1000",
)
#: No network but this host: every other name fails to resolve (an air-gapped reader).
OFFLINE = ("--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE 127.0.0.1",)


@contextmanager
def chromium(profile: Path, monkeypatch: pytest.MonkeyPatch,
             extra: tuple[str, ...] = ()) -> Iterator[webdriver.Chrome]:
    """A headless Chromium with its own profile directory, quit afterwards."""
    for path in (CHROMIUM, CHROMEDRIVER):
        assert os.access(path, os.X_OK), f"{path} is missing: run `bash scripts/browser.sh`"
    monkeypatch.setenv("SE_OFFLINE", "true")  # Selenium Manager: never go online
    monkeypatch.setenv("SE_AVOID_STATS", "true")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (*FLAGS, *extra):
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={profile}")
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()
