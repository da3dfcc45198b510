"""Clean-up of expired SQL records: the beat-schedulable task, and the plan on a big table."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery

from celery_idem import IdempotentTask
from celery_idem.contrib.maintenance import PURGE_TASK_NAME, purge_expired, register_purge_task
from celery_idem.records import State
from celery_idem.stores.memory import MemoryStore
from celery_idem.stores.sql import SQLStore
from celery_idem.task import get_store
from tests.integration.harness import wait_for

# Part of the chaos/scale suites: long-running, deselected with -m "not slow".
pytestmark = pytest.mark.slow

BIG = 200_000


@pytest.fixture
def table(pg_url: str) -> Iterator[str]:
    name = f"scale_{uuid.uuid4().hex[:10]}_records"
    yield name
    engine = sa.create_engine(pg_url)
    with engine.begin() as conn:
        conn.exec_driver_sql(f"DROP TABLE IF EXISTS {name}")
    engine.dispose()


def expired_records(store: Any, names: list[str]) -> None:
    for name in names:
        got = store.claim(name, owner="h:1", task_id=f"t-{name}", attempt=0, lease=0.5, ttl=0.5)
        store.record(name, got.token, state=State.DONE, content_type="application/json",
                     data=b"1", ttl=0.5)
    wait_for(lambda: all(store.get(n) is None for n in names), timeout=30,
             what="the records to expire")


def test_the_purge_task_is_scheduled_with_beat_and_purges_the_apps_own_store(
    pg_url: str, table: str
) -> None:
    # Given an app whose store is a PostgreSQL table with three expired rows and a live one
    app = Celery("purge-test", set_as_current=False)
    app.conf.update(task_always_eager=True, idempotency_store=f"db+{pg_url}",
                    idempotency_store_options={"table_name": table},
                    idempotency_key_prefix=f"purge-{uuid.uuid4().hex[:8]}:")

    @app.task(base=IdempotentTask, bind=True)
    def noop(self: Any, x: int) -> int:
        return x

    store = get_store(app)
    expired_records(store, ["op:a", "op:b", "op:c"])
    assert noop.delay(1).get() == 1  # a live record written by the gate
    # When the task is registered with a schedule, and run (as beat would send it)
    task = register_purge_task(app, every=600, batch=2, queue="maintenance")
    report = task.apply().get()
    # Then beat has an entry, and the run deleted the expired rows in batches
    assert app.conf.beat_schedule[PURGE_TASK_NAME] == {
        "task": PURGE_TASK_NAME, "schedule": 600.0, "options": {"queue": "maintenance"}}
    assert app.tasks[PURGE_TASK_NAME].name == task.name == PURGE_TASK_NAME
    assert report == {"deleted": 3, "batches": 2, "seconds": report["seconds"],
                      "complete": True, "supported": True}
    t = store._table  # type: ignore[attr-defined]
    with store._engine.connect() as conn:  # type: ignore[attr-defined]
        assert conn.execute(sa.select(sa.func.count()).select_from(t)).scalar_one() == 1


def test_bad_purge_settings_are_refused_with_the_reason() -> None:
    app = Celery("purge-bad", set_as_current=False)
    with pytest.raises(ValueError, match="every must be a positive"):
        register_purge_task(app, every=0)
    with pytest.raises(ValueError, match="batch must be a positive integer"):
        register_purge_task(app, batch=0)
    with pytest.raises(ValueError, match="max_seconds"):
        purge_expired(MemoryStore(), max_seconds=-1)
    assert PURGE_TASK_NAME not in app.tasks and not app.conf.beat_schedule
    # A store that expires records itself has nothing to purge
    report = purge_expired(MemoryStore())
    assert (report.deleted, report.supported) == (0, False)


def test_purge_walks_the_expires_index_on_a_big_table(pg_url: str, table: str) -> None:
    # Given 200,000 live rows and 500 expired ones, analyzed
    store = SQLStore(f"db+{pg_url}", prefix="big:", table_name=table)
    try:
        store.get("warm-up")  # creates the table
        with store._engine.connect() as conn:
            conn.exec_driver_sql(
                f"INSERT INTO {table} (key, state, token, owner, task_id, attempt, "
                f"content_type, data, updated, expires) "
                f"SELECT 'big:op:' || md5(i::text), 'done', 1, 'h:1', md5(i::text), 0, "
                f"'application/json', '1'::bytea, extract(epoch from now()), "
                f"extract(epoch from now()) + CASE WHEN i <= 500 THEN -60 ELSE 86400 END "
                f"FROM generate_series(1, {BIG}) AS i")
            conn.exec_driver_sql(f"ANALYZE {table}")
        statements: list[tuple[str, Any]] = []

        run = store._run_sql

        def capture(statement: str, parameters: Any) -> Any:
            if statement.lstrip().upper().startswith("DELETE"):
                statements.append((statement, tuple(parameters)))
            return run(statement, parameters)

        store._run_sql = capture  # type: ignore[method-assign]  # the store's one seam for SQL
        # When purging in batches of 200
        started = time.monotonic()
        report = purge_expired(store, batch=200)
        took = time.monotonic() - started
        # Then exactly the expired rows are gone, in three DELETEs
        assert (report.deleted, report.batches, report.complete) == (500, 3, True)
        with store._engine.connect() as conn:
            left = conn.exec_driver_sql(f"SELECT count(*) FROM {table}").scalar_one()
            assert left == BIG - 500
            # And each DELETE finds its batch through the expires index, never a table scan
            statement, parameters = statements[-1]
            plan = "\n".join(row[0] for row in conn.exec_driver_sql(
                "EXPLAIN (ANALYZE, BUFFERS) " + statement, parameters))
        assert f"ix_{table}_expires" in plan, plan
        assert "Seq Scan" not in plan, plan
        print(f"\n[scale/sql purge] rows={BIG} expired=500 batch=200 seconds={took:.3f}\n{plan}")
    finally:
        store.close()
