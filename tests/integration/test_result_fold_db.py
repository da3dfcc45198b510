"""Celery's database backend on the store's PostgreSQL: the result row rides on the record.

A real worker with ``result_backend = "db+postgresql://..."`` and the SQL store in the same
database. With the fold, the record's statement writes Celery's ``celery_taskmeta`` row (one
transaction: the two rows share their ``xmin``); with ``idempotency_fold_results = False``
(the control) Celery writes it in a transaction of its own. Either way the row is there once,
with the status and result Celery's own backend reads back.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import sqlalchemy as sa
from celery import Celery

from celery_idem import CachedResult
from celery_idem.config import accelerate_switch
from tests.integration import app as tasks
from tests.integration.conftest import Cluster

pytestmark = pytest.mark.worker


@pytest.fixture(params=["fold", "control"])
def db_cluster(request: pytest.FixtureRequest, make_cluster: Callable[..., Cluster],
               pg_url: str) -> tuple[Cluster, bool]:
    if request.param == "fold" and not accelerate_switch():
        pytest.skip("the result fold is an acceleration (CELERY_IDEM_ACCELERATE off)")
    url = "db+" + pg_url
    env = {"IDEM_BACKEND": url, "IDEM_STORE": url}
    if request.param == "control":
        env["IDEM_FOLD"] = "0"
    return make_cluster(**env), request.param == "fold"


def _result_rows(engine: sa.Engine, task_id: str) -> list[sa.Row[tuple[str, str, str]]]:
    with engine.connect() as conn:
        return list(conn.execute(
            sa.text("SELECT status, xmin::text, result FROM celery_taskmeta WHERE task_id = :id"),
            {"id": task_id}))


def test_a_real_worker_stores_each_result_row_once_and_celery_reads_it(
    db_cluster: tuple[Cluster, bool], pg_url: str
) -> None:
    cluster, folded = db_cluster
    cluster.worker(concurrency=2)
    first = tasks.charge.delay("dbf_1", 7)
    value = first.get(timeout=30)
    # A duplicate that reaches the worker is answered from the record, under its own id.
    dup = tasks.charge.apply_async(("dbf_1", 7), link_error=tasks.plain.si("x"))
    assert dup.get(timeout=30) == value
    # And one the producer answers from the record without publishing.
    assert isinstance(tasks.charge.delay("dbf_1", 7), CachedResult)
    assert len(cluster.effects("charge:dbf_1")) == 1

    store = cluster.store
    engine = store._engine
    key = tasks.charge.idempotency_key_for(("dbf_1", 7))
    rows = _result_rows(engine, first.id)
    assert len(rows) == 1 and rows[0].status == "SUCCESS"
    with engine.connect() as conn:
        record_xmin = conn.execute(
            sa.text(f"SELECT xmin::text FROM {store._table.name} WHERE key = :key"),
            {"key": store.prefix + key}).scalar_one()
    # The fold writes both rows in one transaction; Celery's own write is a later one.
    assert (rows[0].xmin == record_xmin) is folded
    assert len(_result_rows(engine, dup.id)) == 1

    # Plain Celery (no celery_idem) reading the same backend sees SUCCESS and the value.
    plain = Celery("plain-reader", backend="db+" + pg_url, set_as_current=False)
    try:
        for task_id in (first.id, dup.id):
            result = plain.AsyncResult(task_id)
            assert result.state == "SUCCESS"
            assert result.result == value
            assert result.date_done is not None
    finally:
        plain.close()


def test_a_failing_body_leaves_its_failure_to_celery(db_cluster: tuple[Cluster, bool]) -> None:
    cluster, _ = db_cluster
    cluster.worker()
    from celery_idem import TerminalError

    r = tasks.declined.delay("dbf_2")
    with pytest.raises(TerminalError):
        r.get(timeout=30)
    assert r.state == "FAILURE"
    assert len(_result_rows(cluster.store._engine, r.id)) == 1
