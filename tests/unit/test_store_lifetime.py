"""A store that get_store builds for an app is closed when the app is collected; others are not."""

from __future__ import annotations

import gc
from pathlib import Path

from celery import Celery

from celery_idem.app import get_store
from celery_idem.stores.memory import MemoryStore


def _closes(store: object) -> list[str]:
    calls: list[str] = []
    original = store.close  # type: ignore[attr-defined]

    def close() -> None:
        calls.append("closed")
        original()

    store.close = close  # type: ignore[attr-defined]
    return calls


def test_a_store_built_from_the_apps_settings_is_closed_with_the_app(tmp_path: Path) -> None:
    # Given an app whose store get_store builds from a URL (SQLite: a pool of its own)
    app = Celery("lifetime", set_as_current=False)
    app.conf.idempotency_store = f"db+sqlite:///{tmp_path / 'records.db'}"
    calls = _closes(get_store(app))
    assert get_store(app) is get_store(app)  # cached per app
    assert calls == []

    # When the app is dropped and collected
    del app
    gc.collect()

    # Then its store was closed, once
    assert calls == ["closed"]


def test_a_store_the_user_passed_is_left_open() -> None:
    store = MemoryStore()
    calls = _closes(store)
    app = Celery("lifetime", set_as_current=False)
    app.conf.idempotency_store = store
    assert get_store(app) is store
    del app
    gc.collect()
    assert calls == []
