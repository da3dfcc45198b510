"""The records' admin and the verbs it shares with the CLI (celery_idem/contrib/ops.py).

The browser test drives the real admin (``manage.py runserver`` on the SQLite test database) in
headless Chromium, as tests/flower/test_browser.py drives Flower: the list shows a record, and
the release action refuses a claim whose token changed after the page was loaded.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from celery_idem.contrib import ops
from celery_idem.records import State
from tests.django.support import django_databases, worker_env  # noqa: F401
from tests.integration.harness import ROOT, free_port, wait_for

DOCS_SCREENSHOT = ROOT / "docs" / "img" / "django-admin.png"


@pytest.fixture
def store(django_databases: Any) -> Any:  # noqa: F811
    from celery_idem.contrib.django.store import DjangoStore

    s = DjangoStore("default", prefix=f"adm{uuid.uuid4().hex[:8]}:")
    yield s
    with s.connection.cursor() as cursor:
        cursor.execute('DELETE FROM celery_idem_records WHERE "key" LIKE %s', [s.prefix + "%"])


def test_release_is_fenced_on_the_token_seen(store: Any) -> None:
    first = store.claim("k", owner="h:1", task_id="t1", attempt=0, lease=60, ttl=60)
    # A retry of the same task takes over: the token the operator saw is stale
    second = store.claim("k", owner="h:2", task_id="t1", attempt=1, lease=60, ttl=60)
    with pytest.raises(ops.Refused) as refused:
        ops.release_claim(store, "k", first.token, by="test")
    assert refused.value.reason == "token_mismatch"
    assert store.get("k").token == second.token
    released = ops.release_claim(store, "k", second.token, by="test")
    assert released.token == second.token and store.get("k").state is State.RELEASED


def test_forget_takes_only_an_outcome(store: Any) -> None:
    c = store.claim("k", owner="h:1", task_id="t1", attempt=0, lease=60, ttl=60)
    with pytest.raises(ops.Refused) as refused:
        ops.forget_outcome(store, "k", c.token, by="test")
    assert refused.value.reason == "wrong_state"
    store.record("k", c.token, state=State.DONE, content_type="application/json", data=b'{"a": 1}',
                 ttl=60, claim_id=c.claim_id)
    # Not decoded unless asked: the size and content type only
    assert ops.outcome(store.get("k"))[0] == {"content_type": "application/json", "result_bytes": 8,
                                              "decoded": False}
    assert ops.outcome(store.get("k"), decode=True)[0]["result"] == {"a": 1}
    ops.forget_outcome(store, "k", c.token, by="test")
    assert store.get("k").state is State.RELEASED


# -- in process: the admin's pages through Django's test client, on the SQLite test database ----


class _Touch:
    """Unpickling it creates ``path``: what a planted pickle could do instead."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> Any:
        return (Path.touch, (self.path,))


@pytest.fixture
def admin_client(django_databases: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:  # noqa: F811
    """A logged-in superuser's test client, and an app that accepts pickle (the risky setting)."""
    from celery import Celery
    from django.contrib.auth import get_user_model
    from django.test import Client, override_settings

    from celery_idem.contrib.django import admin as idem_admin

    app = Celery("admin-pickle", set_as_current=False)
    app.conf.accept_content = ["json", "pickle"]
    app.conf.result_accept_content = ["json", "pickle"]
    monkeypatch.setattr(idem_admin, "_celery_app", lambda: app)
    user_model = get_user_model()
    user = user_model.objects.filter(username="ops-inproc").first() or \
        user_model.objects.create_superuser("ops-inproc", "ops@example.com", "ops-password")
    with override_settings(ROOT_URLCONF="tests.django.urls", STATIC_URL="/static/",
                           ALLOWED_HOSTS=["testserver"]):
        client = Client()
        client.force_login(user)
        yield client


def _planted(store: Any, name: str, *, ctype: str, data: bytes) -> str:
    """A done record written through the store only (as an intruder with table access would)."""
    got = store.claim(name, owner="h:1", task_id="t-1", attempt=0, lease=600, ttl=600)
    store.record(name, got.token, state=State.DONE, content_type=ctype, data=data, ttl=600,
                 claim_id=got.claim_id)
    return str(store.prefix + name)


def test_the_admin_decodes_a_pickled_result_only_through_the_confirmed_action(
    admin_client: Any, store: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import pickle

    from django.contrib.admin.utils import quote
    from django.urls import reverse

    marker = tmp_path / "unpickled"
    payload = pickle.dumps(_Touch(marker))
    key = _planted(store, "planted", ctype="application/x-python-serialize", data=payload)
    # Looking at the list and at the record's page never unpickles
    listing = admin_client.get(reverse("admin:celery_idem_idempotencyrecord_changelist"),
                               {"q": key})
    assert listing.status_code == 200 and key in listing.content.decode()
    page = admin_client.get(reverse("admin:celery_idem_idempotencyrecord_change", args=[quote(key)]))
    assert page.status_code == 200
    body = page.content.decode()
    assert f"not decoded: {len(payload)} bytes of application/x-python-serialize" in body
    assert not marker.exists()
    # The decode action asks first, with the warning, and decodes nothing yet
    changelist = reverse("admin:celery_idem_idempotencyrecord_changelist")
    asked = admin_client.post(changelist, {"action": "decode_results", "_selected_action": [key]})
    assert asked.status_code == 200
    assert "runs its code here" in asked.content.decode() and not marker.exists()
    # Confirmed: it decodes (the payload runs, which is what the confirmation is for), logged
    with caplog.at_level("WARNING", logger="celery_idem"):
        done = admin_client.post(changelist, {"action": "decode_results", "_selected_action": [key],
                                              "confirmed": "yes"})
    assert done.status_code == 200 and "idem-decoded" in done.content.decode()
    assert marker.exists()
    [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("celery_idem decoded")]
    assert f"key={key}" in line and "by=admin:ops-inproc user=ops-inproc" in line


def _shown_text(html: str) -> str:
    """The page without its form values: the raw key is only where the form posts it back."""
    import re

    return re.sub(r'(name|value)="[^"]*"', "", html)


def test_the_admin_shows_stored_strings_escaped_and_logs_the_reason(
    admin_client: Any, store: Any, caplog: pytest.LogCaptureFixture
) -> None:
    from django.urls import reverse

    name = "op:key=\x1b[31mred\u202eevil"
    got = store.claim(name, owner="h\x1b[2J:1", task_id="t\n1", attempt=0, lease=600, ttl=600)
    key = store.prefix + name
    changelist = reverse("admin:celery_idem_idempotencyrecord_changelist")
    listing = admin_client.get(changelist, {"q": store.prefix})
    body = listing.content.decode()
    assert listing.status_code == 200
    assert "\x1b" not in _shown_text(body) and "\u202e" not in _shown_text(body)
    assert "op:key=\\x1b[31mred\\u202eevil" in body and "h\\x1b[2J:1" in body
    asked = admin_client.post(changelist, {"action": "release_claims", "_selected_action": [key],
                                           f"seen_token:{key}": str(got.token)})
    assert "\x1b" not in _shown_text(asked.content.decode())
    assert 'name="idem_reason"' in asked.content.decode()
    with caplog.at_level("WARNING", logger="celery_idem"):
        admin_client.post(changelist, {"action": "release_claims", "_selected_action": [key],
                                       f"seen_token:{key}": str(got.token), "confirmed": "yes",
                                       "idem_reason": "INC-5 stuck\nforged"})
    assert store.get(name).state is State.RELEASED
    [record] = [r for r in caplog.records if r.getMessage().startswith("celery_idem released")]
    assert record.idem_operator["reason"] == "INC-5 stuck\nforged"  # type: ignore[attr-defined]
    assert record.idem_operator["user"] == "ops-inproc"  # type: ignore[attr-defined]
    assert "reason=INC-5 stuck\\nforged" in record.getMessage() and "\n" not in record.getMessage()


@pytest.fixture
def admin_server(django_databases: Any) -> Iterator[str]:  # noqa: F811
    from django.contrib.auth import get_user_model

    user_model = get_user_model()
    if not user_model.objects.filter(username="ops").exists():
        user_model.objects.create_superuser("ops", "ops@example.com", "ops-password")
    port = free_port()
    env = {**os.environ, **worker_env("sqlite"), "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "django", "runserver", f"127.0.0.1:{port}", "--noreload", "--nothreading"],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True)
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        if proc.poll() is not None:
            raise AssertionError("runserver exited")
        try:
            with urllib.request.urlopen(f"{url}/admin/login/", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    try:
        wait_for(up, timeout=60, what="the admin to answer")
        yield url
    finally:
        proc.terminate()
        proc.wait(20)


@pytest.mark.worker
def test_the_admin_lists_a_record_and_release_refuses_a_stale_token(
    admin_server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.select import Select
    from selenium.webdriver.support.ui import WebDriverWait

    from celery_idem.contrib.django.store import DjangoStore
    from tests.browser import chromium

    # Given a claim in progress (the app's default prefix, as the admin's task column expects)
    store = DjangoStore("default")
    name = f"shop.charge:ord_{uuid.uuid4().hex[:6]}"
    task_id = str(uuid.uuid4())
    first = store.claim(name, owner="worker-1:4242", task_id=task_id, attempt=0,
                        lease=600, ttl=3600)
    key = store.prefix + name
    with chromium(tmp_path / "profile", monkeypatch) as browser:
        browser.set_window_size(1600, 520)  # the list's columns side by side, for the docs' shot
        browser.get(f"{admin_server}/admin/login/?next=/admin/celery_idem/idempotencyrecord/")
        browser.find_element(By.NAME, "username").send_keys("ops")
        browser.find_element(By.NAME, "password").send_keys("ops-password")
        browser.find_element(By.CSS_SELECTOR, "input[type=submit]").click()
        browser.execute_script("localStorage.setItem('django.admin.navSidebarIsOpen', 'false')")
        browser.get(f"{admin_server}/admin/celery_idem/idempotencyrecord/?q={name}")
        # When the operator opens the list: it shows the record, with its token
        WebDriverWait(browser, 20).until(lambda d: key in d.find_element(By.TAG_NAME, "body").text)
        row = browser.find_element(By.XPATH, f"//tr[.//*[text()='{key}']]")
        assert str(first.token) in row.text and "in_progress" in row.text
        shot = tmp_path / "django-admin.png"
        assert browser.save_screenshot(str(shot))
        # And the claim is taken over (a retry) after the page was loaded
        second = store.claim(name, owner="worker-2:99", task_id=task_id, attempt=1,
                             lease=600, ttl=3600)
        # When they release the claim they saw, and confirm
        row.find_element(By.CSS_SELECTOR, "input.action-select").click()
        Select(browser.find_element(By.NAME, "action")).select_by_value("release_claims")
        browser.find_element(By.NAME, "index").click()
        WebDriverWait(browser, 20).until(lambda d: d.find_elements(By.ID, "idem-confirm-yes"))
        browser.find_element(By.ID, "idem-confirm-yes").click()
        # Then the admin refuses: the token changed, and the new holder's claim is untouched
        WebDriverWait(browser, 20).until(lambda d: d.find_elements(By.CSS_SELECTOR, "ul.messagelist"))
        text = browser.find_element(By.CSS_SELECTOR, "ul.messagelist").text
        assert "token mismatch" in text and str(first.token) in text
        current = store.get(name)
        assert current.state is State.IN_PROGRESS and current.token == second.token
        # And with the page reloaded (the new token seen), the release goes through
        row = browser.find_element(By.XPATH, f"//tr[.//*[text()='{key}']]")
        row.find_element(By.CSS_SELECTOR, "input.action-select").click()
        Select(browser.find_element(By.NAME, "action")).select_by_value("release_claims")
        browser.find_element(By.NAME, "index").click()
        WebDriverWait(browser, 20).until(lambda d: d.find_elements(By.ID, "idem-confirm-yes"))
        browser.find_element(By.ID, "idem-confirm-yes").click()
        WebDriverWait(browser, 20).until(
            lambda d: "released" in d.find_element(By.CSS_SELECTOR, "ul.messagelist").text)
        assert store.get(name).state is State.RELEASED
    with store.connection.cursor() as cursor:
        cursor.execute('DELETE FROM celery_idem_records WHERE "key" = %s', [key])
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if os.environ.get("CELERY_IDEM_DOCS_SCREENSHOT"):
        DOCS_SCREENSHOT.parent.mkdir(exist_ok=True)
        shutil.copyfile(shot, DOCS_SCREENSHOT)
