"""The one switch for every acceleration (celery_idem.accel.enabled), and what it turns off.

No server: building a store connects to nothing, so which path each store took is visible on
its seam (the Redis store's ``_scripts``, the SQL store's ``_psycopg``).
"""

from __future__ import annotations

import pytest
from celery import Celery

from celery_idem import IdempotentTask, accel
from celery_idem.accel.redis_wire import WireScripts
from celery_idem.results import result_writer
from celery_idem.stores import store_from_url
from celery_idem.stores.redis import RedisStore, Scripts
from celery_idem.stores.sql import SQLStore

REDIS = "redis://127.0.0.1:1/0"  # nothing listens: nothing here connects
PG = "db+postgresql+psycopg://u@127.0.0.1:1/x"


@pytest.fixture(autouse=True)
def _env_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(accel.ENV, raising=False)  # make test-plain sets it for the whole run


@pytest.mark.parametrize("value", ["0", "false", "No", " OFF "])
def test_the_environment_turns_accelerations_off_over_the_setting(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv(accel.ENV, value)
    assert (accel.enabled(), accel.enabled(True), accel.enabled(None)) == (False, False, False)


@pytest.mark.parametrize("value", ["", "1", "true", "yes", "on"])
def test_otherwise_the_setting_decides_and_on_is_the_default(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv(accel.ENV, value)
    assert (accel.enabled(), accel.enabled(True), accel.enabled(False)) == (True, True, False)


def _redis(accelerate: bool | None) -> RedisStore:
    store = store_from_url(REDIS, options={"accelerate": accelerate})
    assert isinstance(store, RedisStore)
    return store


def _sql(accelerate: bool | None) -> SQLStore:
    store = store_from_url(PG, options={"accelerate": accelerate})
    assert isinstance(store, SQLStore)
    return store


def test_on_by_default_the_stores_take_their_accelerations() -> None:
    redis_store, sql_store = _redis(None), _sql(None)
    try:
        assert redis_store.accelerated and isinstance(redis_store._scripts, WireScripts)
        assert sql_store._psycopg is not None
    finally:
        redis_store.close()
        sql_store.close()


@pytest.mark.parametrize("how", ["setting", "environment"])
def test_switched_off_every_store_keeps_to_its_plain_path(
    monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    if how == "environment":
        monkeypatch.setenv(accel.ENV, "0")
    setting = how != "setting"  # the environment wins over a setting that says on
    redis_store, sql_store = _redis(setting), _sql(setting)
    try:
        # Redis: redis-py's registered scripts, no wire (its connections, its GET); the enqueue
        # check within the publish asks the store's `accelerated` (accel.redis_enqueue).
        assert not redis_store.accelerated
        assert type(redis_store._scripts) is Scripts
        assert not hasattr(redis_store._scripts, "wire")
        # SQL: every statement through SQLAlchemy's Connection, never psycopg's directly.
        assert sql_store._psycopg is None
    finally:
        redis_store.close()
        sql_store.close()


def test_a_store_without_accelerations_is_built_as_before_from_the_same_options() -> None:
    store = store_from_url("memory://", options={"accelerate": False})
    store.close()


def _fold_app(**conf: object) -> Celery:
    # The store derived from the Redis result backend: the same server, so the result folds.
    app = Celery("test_accel_fold", broker="memory://", backend=REDIS, set_as_current=False)
    app.conf.update(**conf)

    @app.task(shared=False, name="accel.fold", base=IdempotentTask)
    def fold(order_id: str) -> str:
        return order_id

    return app


@pytest.mark.parametrize("off", ["env", "setting"])
def test_with_accelerations_off_no_result_writer_folds_and_the_check_reads_first(
    monkeypatch: pytest.MonkeyPatch, off: str
) -> None:
    on = _fold_app().tasks["accel.fold"]
    writer = on._result_writer
    assert writer is not None and writer.folds  # the control: on, the result rides on the record
    assert result_writer(on, on._gate.store) is not None and on._enqueue_check is not None
    if off == "env":
        monkeypatch.setenv(accel.ENV, "0")
        task = _fold_app().tasks["accel.fold"]
    else:
        task = _fold_app(idempotency_accelerate=False).tasks["accel.fold"]
    # No writer: the gate gets no fold and Celery's tracer writes the result (the plain path);
    # no EnqueueCheck: the record is read before publishing.
    assert task._result_writer is None and result_writer(task, task._gate.store) is None
    assert task._enqueue_check is None
    # Not switched: the key of an action is the same either way.
    assert task.idempotency_key_for(("o-1",), {}) == on.idempotency_key_for(("o-1",), {})
    for t in (on, task):
        t.backend.client.close()
