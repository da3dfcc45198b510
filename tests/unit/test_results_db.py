"""Celery's database result row built for the record's statement (celery_idem/results_db.py).

Which backend and store get the writer (only Celery's own ``DatabaseBackend`` on the store's
PostgreSQL database and user), and the row it builds: Celery's own columns and values, read off
the backend's model. Nothing is written here: the record's statement that carries the row is
tests/stores/test_sql_taskmeta.py's, a real worker's round trips
tests/integration/test_result_fold_db.py's.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from celery.app.task import Context
from celery.backends.database import DatabaseBackend

from celery_idem import IdempotentTask
from celery_idem.results_db import DatabaseResultWriter, database_result_writer
from celery_idem.stores import store_from_url
from celery_idem.stores.base import Store


def _task(backend: str) -> Any:
    app = Celery("results-db", broker="memory://", backend=backend, set_as_current=False)

    @app.task(shared=False, name="rdb.charge", base=IdempotentTask)
    def charge(order_id: str) -> str:
        return order_id

    return app.tasks["rdb.charge"]


def _request(task_id: str = "t-1", **fields: Any) -> Context:
    return Context(**{"id": task_id, "is_eager": False, "called_directly": False, "callbacks": None,
                      "chain": None, "chord": None, "ignore_result": False, **fields})


@pytest.fixture
def stores() -> Iterator[list[Store]]:
    """Stores the test builds, closed afterwards (building one connects to nothing)."""
    made: list[Store] = []
    yield made
    for store in made:
        store.close()


def _store(made: list[Store], url: str) -> Store:
    store = store_from_url(url, prefix="p:")
    made.append(store)
    return store


def test_celerys_backend_on_the_stores_database_gets_the_writer(pg_url: str,
                                                                stores: list[Store]) -> None:
    task = _task("db+" + pg_url)
    writer = database_result_writer(task, _store(stores, "db+" + pg_url))
    assert isinstance(writer, DatabaseResultWriter) and writer.folds


@pytest.mark.parametrize("store_url", [
    "db+postgresql+psycopg://root@127.0.0.1:5432/other",  # another database
    "db+postgresql+psycopg://someone@127.0.0.1:5432/test",  # another user
    "db+postgresql+psycopg://root@127.0.0.1:5433/test",  # another server
    "db+sqlite:///:memory:",  # another dialect
    "memory://",  # not a SQL store
], ids=["database", "user", "port", "sqlite", "memory"])
def test_a_store_elsewhere_leaves_the_row_to_celery(pg_url: str, stores: list[Store],
                                                    store_url: str) -> None:
    assert pg_url == "postgresql+psycopg://root@127.0.0.1:5432/test" or pytest.skip(
        "the other-place URLs are written for the default CELERY_IDEM_TEST_PG")
    task = _task("db+" + pg_url)
    assert database_result_writer(task, _store(stores, "db+" + pg_url)) is not None  # the control
    assert database_result_writer(task, _store(stores, store_url)) is None


def test_a_backend_that_is_not_celerys_database_backend_gets_no_writer(
        pg_url: str, stores: list[Store]) -> None:
    store = _store(stores, "db+" + pg_url)
    redis_task = _task("redis://127.0.0.1:1/0")
    assert database_result_writer(redis_task, store) is None
    redis_task.backend.client.close()

    class Audited(DatabaseBackend):
        def _update_result(self, *args: Any, **kwargs: Any) -> Any:
            return super()._update_result(*args, **kwargs)

    task = _task("db+" + pg_url)
    task.backend = Audited(app=task.app, url=pg_url)  # stores results its own way
    assert database_result_writer(task, store) is None


def _value(backend: Any, stored: Any) -> Any:
    """The result column's value as Celery reads it: encoded bytes in a ``LargeBinary`` column
    (Celery 5.7), the value itself in the ``PickleType`` column of older Celerys."""
    return backend.decode(stored) if isinstance(stored, (bytes, bytearray, str)) else stored


def test_the_row_is_celerys_own(pg_url: str, stores: list[Store]) -> None:
    from celery_idem.stores.sql.taskmeta import TaskMetaWrite

    task = _task("db+" + pg_url)
    backend = task.backend
    writer = database_result_writer(task, _store(stores, "db+" + pg_url))
    assert writer is not None
    write = writer.build(_request("t-row"), {"cents": 5})
    assert isinstance(write, TaskMetaWrite)
    assert write.key == "t-row" and write.table is backend.task_cls.__table__
    assert "id" not in write.row  # from the table's sequence
    assert write.row["task_id"] == "t-row" and write.row["status"] == "SUCCESS"
    assert _value(backend, write.row["result"]) == {"cents": 5}
    failed = writer.build(_request("t-failed"), KeyError("gone"), state="FAILURE")
    assert failed is not None and failed.row["status"] == "FAILURE"
    error = backend.exception_to_python(_value(backend, failed.row["result"]))
    assert isinstance(error, KeyError)


@pytest.mark.parametrize("request_fields", [
    {"is_eager": True}, {"called_directly": True}, {"callbacks": [{"task": "x"}]},
    {"chain": [{"task": "x"}]}, {"chord": {"task": "x"}}, {"ignore_result": True},
], ids=["eager", "direct", "callbacks", "chain", "chord", "ignored"])
def test_requests_celery_must_handle_build_no_row(pg_url: str, stores: list[Store],
                                                  request_fields: dict[str, Any]) -> None:
    task = _task("db+" + pg_url)
    writer = database_result_writer(task, _store(stores, "db+" + pg_url))
    assert writer is not None
    assert writer.build(_request(), "v") is not None  # the control
    assert writer.build(_request(**request_fields), "v") is None
