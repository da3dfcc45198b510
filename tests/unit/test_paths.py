"""celery_idem.paths: each task's enqueue check and result writer, chosen once from the switch.

The stores and backends are built but never written to: a Redis store and Celery's Redis
backend only open a connection pool when built.
"""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery

from celery_idem import IdempotentTask
from celery_idem.config import ACCELERATE_ENV
from celery_idem.enqueue import ReadFirst
from celery_idem.paths import enqueue_check, result_writer

REDIS = "redis://127.0.0.1:6379/0"


@pytest.fixture(autouse=True)
def _switch_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ACCELERATE_ENV, raising=False)


def make_task(store: str, backend: str = "cache+memory://", **conf: Any) -> Any:
    app = Celery("test_paths", broker="memory://", backend=backend, set_as_current=False)
    app.conf.idempotency_store = store
    app.conf.idempotency_key_prefix = "test-paths:"
    app.conf.update(conf)

    @app.task(base=IdempotentTask, shared=False)
    def charge(order_id: str) -> str:
        return order_id

    return charge


def test_a_redis_store_checks_within_the_publish() -> None:
    from celery_idem.enqueue_redis import WithinPublish

    task = make_task(REDIS)
    check = enqueue_check(task, task.idempotency_gate.store)
    assert isinstance(check, WithinPublish)


def test_other_stores_read_first() -> None:
    task = make_task("memory://")
    check = enqueue_check(task, task.idempotency_gate.store)
    assert type(check) is ReadFirst


def test_the_setting_turns_the_fast_check_off() -> None:
    task = make_task(REDIS, idempotency_accelerate=False)
    assert type(enqueue_check(task, task.idempotency_gate.store)) is ReadFirst


def test_the_environment_turns_the_fast_check_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ACCELERATE_ENV, "0")
    task = make_task(REDIS)  # the variable wins over the setting's default
    assert type(enqueue_check(task, task.idempotency_gate.store)) is ReadFirst


def test_celerys_redis_backend_gets_a_writer_that_folds_on_the_same_server() -> None:
    from celery_idem.results_redis import RedisResultWriter

    task = make_task(REDIS, backend=REDIS)
    writer = result_writer(task, task.idempotency_gate.store)
    assert isinstance(writer, RedisResultWriter)
    assert writer.folds is True
    apart = make_task("memory://", backend=REDIS)
    other = result_writer(apart, apart.idempotency_gate.store)
    assert isinstance(other, RedisResultWriter) and other.folds is False


@pytest.mark.parametrize("conf", [{"idempotency_accelerate": False},
                                  {"idempotency_fold_results": False}])
def test_no_writer_when_switched_off(conf: dict[str, Any]) -> None:
    task = make_task(REDIS, backend=REDIS, **conf)
    assert result_writer(task, task.idempotency_gate.store) is None


def test_no_writer_for_a_backend_no_writer_knows() -> None:
    task = make_task("memory://")
    assert result_writer(task, task.idempotency_gate.store) is None
