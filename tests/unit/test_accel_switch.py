"""The one acceleration switch: read once per app, and with it off no fast module is loaded.

Building a store connects to nothing, so which path each store took is visible on its seam (the
Redis store's ``_scripts``, the SQL store's ``_psycopg``). The round trip at the end runs a real
enqueue and a real worker (Redis broker and backend) in a fresh interpreter, and reads its
``sys.modules``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from celery import Celery

import celery_idem
from celery_idem import IdempotentTask
from celery_idem.config import ACCELERATE_ENV, accelerate_switch, settings
from celery_idem.enqueue import ReadFirst
from celery_idem.stores import store_from_url
from celery_idem.stores.redis import RedisStore, Scripts
from celery_idem.stores.sql import SQLStore

REDIS = "redis://127.0.0.1:1/0"  # nothing listens: nothing here connects
PG = "db+postgresql+psycopg://u@127.0.0.1:1/x"

#: The fast twins: none of them is imported with the switch off.
FAST_MODULES = frozenset({
    "celery_idem.enqueue_redis", "celery_idem.results_redis", "celery_idem.stores.redis_wire",
    "celery_idem.stores.sql.psycopg", "celery_idem.results_db",
    "celery_idem.stores.sql.taskmeta",
})


@pytest.fixture(autouse=True)
def _env_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ACCELERATE_ENV, raising=False)  # make test-plain sets it for the whole run


@pytest.mark.parametrize("value", ["0", "false", "No", " OFF "])
def test_the_environment_turns_accelerations_off_over_the_setting(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv(ACCELERATE_ENV, value)
    assert (accelerate_switch(), accelerate_switch(True), accelerate_switch(False)) == (
        False, False, False)
    app = Celery("test_accel_env", set_as_current=False)
    app.conf.idempotency_accelerate = True
    assert settings(app).accelerate is False


@pytest.mark.parametrize("value", ["", "1", "true", "yes", "on"])
def test_otherwise_the_setting_decides_and_on_is_the_default(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv(ACCELERATE_ENV, value)
    assert (accelerate_switch(), accelerate_switch(True), accelerate_switch(False)) == (
        True, True, False)


def test_only_the_settings_read_the_switch() -> None:
    package = Path(celery_idem.__file__).parent
    readers = sorted(
        path.relative_to(package).as_posix() for path in package.rglob("*.py")
        if "ACCELERATE_ENV" in (text := path.read_text("utf-8")) or "CELERY_IDEM_ACCELERATE\"" in text
        or "accelerate_switch(" in text
    )
    assert readers == ["config.py"]


def _stores(accelerate: bool) -> tuple[RedisStore, SQLStore]:
    redis_store = store_from_url(REDIS, options={"accelerate": accelerate})
    sql_store = store_from_url(PG, options={"accelerate": accelerate})
    assert isinstance(redis_store, RedisStore) and isinstance(sql_store, SQLStore)
    return redis_store, sql_store


def test_a_store_takes_its_fast_paths_when_told() -> None:
    from celery_idem.stores.redis_wire import WireScripts

    redis_store, sql_store = _stores(True)
    try:
        assert redis_store.accelerated and isinstance(redis_store._scripts, WireScripts)
        assert sql_store._psycopg is not None
    finally:
        redis_store.close()
        sql_store.close()


def test_a_store_told_off_keeps_to_its_plain_path() -> None:
    redis_store, sql_store = _stores(False)
    try:
        assert not redis_store.accelerated and type(redis_store._scripts) is Scripts
        assert sql_store._psycopg is None
    finally:
        redis_store.close()
        sql_store.close()


def _fold_app(**conf: object) -> Celery:
    # The store derived from the Redis result backend: the same server, so the result folds.
    app = Celery("test_accel_fold", broker="memory://", backend=REDIS, set_as_current=False)
    app.conf.update(**conf)

    @app.task(shared=False, name="accel.fold", base=IdempotentTask)
    def fold(order_id: str) -> str:
        return order_id

    return app


@pytest.mark.parametrize("off", ["env", "setting"])
def test_the_app_picks_every_plain_path_once_when_off(
    monkeypatch: pytest.MonkeyPatch, off: str
) -> None:
    on = _fold_app().tasks["accel.fold"]
    assert on._result_writer is not None and on._result_writer.folds  # the control
    assert type(on._enqueue_check) is not ReadFirst and on._gate.store.accelerated
    if off == "env":
        monkeypatch.setenv(ACCELERATE_ENV, "0")
        task = _fold_app().tasks["accel.fold"]
    else:
        task = _fold_app(idempotency_accelerate=False).tasks["accel.fold"]
    # No writer: Celery's tracer writes the result; the record is read before publishing; the
    # store keeps to redis-py's own path.
    assert task._result_writer is None
    assert type(task._enqueue_check) is ReadFirst
    assert not task._gate.store.accelerated
    # The key of an action is the same either way.
    assert task.idempotency_key_for(("o-1",), {}) == on.idempotency_key_for(("o-1",), {})
    for t in (on, task):
        t.backend.client.close()
        t._gate.store.close()


_ROUND_TRIP = textwrap.dedent("""
    import json, sys
    from celery import Celery
    from celery.contrib.testing.worker import start_worker
    from celery_idem import IdempotentTask

    url, prefix = sys.argv[1], sys.argv[2]
    app = Celery("accel_round_trip", broker=url, backend=url, set_as_current=False)
    app.conf.update(idempotency_key_prefix=prefix, task_default_queue=prefix + "q",
                    result_expires=60)

    @app.task(base=IdempotentTask, name=prefix + "echo", shared=False)
    def echo(order_id):
        return order_id

    with start_worker(app, pool="solo", perform_ping_check=False, loglevel="WARNING"):
        first = echo.delay("o-1")
        assert first.get(timeout=30) == "o-1"
        again = echo.delay("o-1")
        assert again.get(timeout=30) == "o-1"
    print(json.dumps(sorted(name for name in sys.modules if name.startswith("celery_idem"))))
""")


@pytest.mark.parametrize("switch", ["0", "1"])
def test_a_round_trip_with_the_switch_off_imports_no_fast_module(
    redis_url: str, prefix: str, redis_cleanup: None, switch: str
) -> None:
    env = {**os.environ, ACCELERATE_ENV: switch}
    done = subprocess.run([sys.executable, "-c", _ROUND_TRIP, redis_url, prefix], env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    loaded = set(json.loads(done.stdout.strip().splitlines()[-1]))
    assert "celery_idem.task" in loaded
    if switch == "0":
        assert sorted(loaded & FAST_MODULES) == []
    else:  # the control: the same run with the switch on loads the Redis fast twins
        assert {"celery_idem.enqueue_redis", "celery_idem.results_redis",
                "celery_idem.stores.redis_wire"} <= loaded


def test_a_sql_store_switched_off_imports_no_fast_module() -> None:
    script = ("import json, sys\nfrom celery_idem.stores import store_from_url\n"
              f"store = store_from_url({PG!r}, options={{'accelerate': False}})\n"
              "assert store._psycopg is None\nstore.close()\n"
              "print(json.dumps(sorted(n for n in sys.modules if n.startswith('celery_idem'))))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    loaded = set(json.loads(done.stdout.strip().splitlines()[-1]))
    assert "celery_idem.stores.sql.store" in loaded
    assert sorted(loaded & FAST_MODULES) == []
