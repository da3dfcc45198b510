"""celery_idem.app: the store an app gets, the owner id, answers reported, and worker-start checks.

In process: apps with ``set_as_current=False``, the in-memory store, and stand-ins for the worker
(``check_worker`` and ``check_pool`` read a few attributes of their sender); no worker starts.
"""

from __future__ import annotations

import logging
import os
import socket
from types import SimpleNamespace
from typing import Any

import pytest
from celery import Celery

from celery_idem import IdempotentTask, events
from celery_idem.app import (
    check_pool,
    check_worker,
    emit_answer,
    events_enabled,
    forget_store,
    get_store,
    owner_id,
)
from celery_idem.events import Outcome
from celery_idem.exceptions import ImproperlyConfigured
from celery_idem.stores.memory import MemoryStore


def make_app(**conf: Any) -> Celery:
    app = Celery("test_app", set_as_current=False)
    app.conf.update(conf)
    return app


def test_an_eager_app_without_a_backend_gets_a_store_in_memory_once() -> None:
    app = make_app(task_always_eager=True)
    store = get_store(app)
    assert isinstance(store, MemoryStore)
    assert get_store(app) is store


def test_a_store_instance_in_the_setting_is_used_as_it_is() -> None:
    mine = MemoryStore()
    app = make_app(idempotency_store=mine, result_backend="cache+memory://")
    assert get_store(app) is mine


def test_forget_store_makes_the_next_get_build_anew() -> None:
    app = make_app(idempotency_store="memory://")
    first = get_store(app)
    assert forget_store(app) is first
    assert forget_store(app) is None
    second = get_store(app)
    assert isinstance(second, MemoryStore) and second is not first


def test_no_store_can_be_derived_from_a_backend_without_one() -> None:
    app = make_app(result_backend="cache+memory://")
    with pytest.raises(ImproperlyConfigured):
        get_store(app)


def test_owner_id_is_this_host_and_process() -> None:
    assert owner_id() == f"{socket.gethostname()}:{os.getpid()}"


def test_an_answer_is_logged_and_observed(caplog: pytest.LogCaptureFixture,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    app = make_app(task_always_eager=True, idempotency_store="memory://")

    @app.task(base=IdempotentTask, shared=False)
    def charge(order_id: str) -> str:
        return order_id

    seen: list[tuple[Any, ...]] = []
    monkeypatch.setattr(events, "OBSERVERS",
                        [lambda *args, **kwargs: seen.append((*args, kwargs["task_span"]))])
    with caplog.at_level(logging.DEBUG, logger="celery_idem"):
        emit_answer(charge, Outcome.ANSWERED, "k-1", 4, "orig-id", "result-id", "done")
    [line] = [r for r in caplog.records if r.name == "celery_idem"]
    assert line.levelno == logging.INFO
    message = line.getMessage()
    for part in ("answered", "key=k-1", "task_id=result-id", "token=4", "original_task_id=orig-id",
                 "record_state=done", "at=enqueue"):
        assert part in message
    assert seen == [(charge.name, "answered", "k-1", 4, "orig-id", False)]


def test_answers_log_at_debug_when_asked(caplog: pytest.LogCaptureFixture) -> None:
    app = make_app(task_always_eager=True, idempotency_store="memory://",
                   idempotency_log_answers=False)

    @app.task(base=IdempotentTask, shared=False)
    def charge(order_id: str) -> str:
        return order_id

    with caplog.at_level(logging.DEBUG, logger="celery_idem"):
        emit_answer(charge, Outcome.ATTACHED, "k-2", 1, "orig-id", "orig-id", "in_progress")
    assert [r.levelno for r in caplog.records if r.name == "celery_idem"] == [logging.DEBUG]


def test_worker_start_switches_events_on_when_the_worker_sends_them() -> None:
    quiet, loud = make_app(idempotency_store="memory://"), make_app(idempotency_store="memory://")
    check_worker(SimpleNamespace(app=quiet, task_events=False))
    check_worker(SimpleNamespace(app=loud, task_events=True))
    assert not events_enabled(quiet)
    assert events_enabled(loud)


def test_worker_start_stops_on_an_unknown_setting() -> None:
    app = make_app(idempotency_stroe="memory://")
    with pytest.raises(SystemExit, match="idempotency_stroe"):
        check_worker(SimpleNamespace(app=app))


def pool_sender(pool: str, driver: str, *, eventloop: bool) -> Any:
    conninfo = SimpleNamespace(transport=SimpleNamespace(driver_type=driver))
    return SimpleNamespace(use_eventloop=eventloop, pool_cls=pool, _conninfo=conninfo)


@pytest.mark.parametrize(("sender", "warned"), [
    (pool_sender("celery.concurrency.threads:TaskPool", "redis", eventloop=False), True),
    (pool_sender("prefork", "redis", eventloop=True), False),
    (pool_sender("threads", "amqp", eventloop=False), False),
])
def test_check_pool_warns_of_a_pool_that_restores_no_unacked_message(
    caplog: pytest.LogCaptureFixture, sender: Any, warned: bool,
) -> None:
    with caplog.at_level(logging.WARNING, logger="celery_idem"):
        check_pool(sender, make_app())
    lines = [r.getMessage() for r in caplog.records if r.name == "celery_idem"]
    if warned:
        assert len(lines) == 1 and "(pool taskpool)" in lines[0]
        assert "does not restore unacked messages" in lines[0]
    else:
        assert lines == []
