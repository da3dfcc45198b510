"""``SQLStore.record_with``: Celery's database result row in the record's own statement.

Each test has its own records table and its own copy of Celery's result table (the model's
columns, sequence and unique ``task_id``), so nothing is shared with other tests. The worker
end to end (Celery's tracer, AsyncResult) is in tests/integration/test_result_fold_db.py.
"""

from __future__ import annotations

import datetime
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from celery.backends.database.models import TaskExtended

from celery_idem.exceptions import LeaseLost
from celery_idem.records import State
from celery_idem.stores.base import BackendWrite
from celery_idem.stores.sql import SQLStore
from celery_idem.stores.sql.taskmeta import TaskMetaWrite

from .support import LONG, claim, drop_table, poll


@pytest.fixture
def store(pg_url: str) -> Iterator[SQLStore]:
    store = SQLStore.from_url("db+" + pg_url, prefix="fold:", table_name=f"t_{uuid.uuid4().hex[:12]}")
    yield store
    drop_table(store)
    store.close()


@pytest.fixture
def meta(store: SQLStore) -> Iterator[sa.Table]:
    """A private table shaped like Celery's result table (extended columns included).

    Its own sequence: never Celery's shared ``task_id_sequence``, which dropping this table's
    metadata would drop from under every other user of the database.
    """
    name = f"m_{uuid.uuid4().hex[:12]}"
    table = sa.Table(
        name, sa.MetaData(),
        sa.Column("id", sa.Integer, sa.Sequence(f"{name}_seq"), primary_key=True),
        *(sa.Column(c.name, c.type, unique=c.unique, nullable=c.nullable)
          for c in TaskExtended.__table__.columns if c.name != "id"),
    )
    assert table.c.task_id.unique
    table.metadata.create_all(store._engine)
    yield table
    table.metadata.drop_all(store._engine)


def _write(meta: sa.Table, task_id: str, result: bytes = b'"ok"', status: str = "SUCCESS") -> TaskMetaWrite:
    row: dict[str, Any] = {c.name: None for c in meta.columns if c.name != "id"}
    row.update(task_id=task_id, status=status, result=result,
               date_done=datetime.datetime.now(datetime.timezone.utc))
    return TaskMetaWrite(key=task_id, value=b"", table=meta, row=row)


def _rows(store: SQLStore, meta: sa.Table) -> list[dict[str, Any]]:
    with store._engine.connect() as conn:
        return [dict(r) for r in conn.execute(sa.select(meta)).mappings()]


def _record_with(store: SQLStore, key: str, c: Any, write: BackendWrite) -> bool:
    return store.record_with(key, c.token, state=State.DONE, content_type="application/json", data=b'"ok"',
                      ttl=LONG, also=write, claim_id=c.claim_id)


def test_the_row_is_written_with_the_record_in_one_statement(store: SQLStore, meta: sa.Table) -> None:
    c = claim(store, "k")
    statements: list[str] = []
    sa.event.listen(store._engine, "before_cursor_execute", lambda *a: statements.append(a[2]))
    write = _write(meta, "task-1")
    folded = _record_with(store, "k", c, write)
    through_sqlalchemy = len(statements)
    assert folded
    rows = _rows(store, meta)
    assert [(r["task_id"], r["status"], bytes(r["result"])) for r in rows] == [("task-1", "SUCCESS", b'"ok"')]
    assert rows[0]["id"] is not None  # from Celery's sequence
    rec = store.get("k")
    assert rec is not None and rec.state is State.DONE and rec.data == b'"ok"'
    # One transaction: the record's row version and Celery's row have the same xmin.
    with store._engine.connect() as conn:
        xmins = conn.execute(sa.text(
            f"SELECT (SELECT xmin::text FROM {store._table.name} WHERE key = 'fold:k'), "
            f"(SELECT xmin::text FROM {meta.name} WHERE task_id = 'task-1')")).one()
    assert xmins[0] == xmins[1]
    # One statement: on the connection itself (the psycopg acceleration), else through SQLAlchemy.
    assert through_sqlalchemy == (0 if store._psycopg is not None else 1)


def test_a_lost_claim_writes_neither_the_record_nor_the_row(store: SQLStore, meta: sa.Table) -> None:
    stale = claim(store, "k", who="a", lease=0.001)
    # Another task's claim takes over once the 1 ms lease has run out on the store's clock
    # (polled: on a fast machine the second claim can land inside the same millisecond).
    fresh = poll(store, lambda: (c := claim(store, "k", who="b", attempt=1)).status.holds and c,
                 "the expired claim to be taken over")
    assert fresh.token > stale.token
    write = _write(meta, "task-a")
    with pytest.raises(LeaseLost):
        _record_with(store, "k", stale, write)
    assert _rows(store, meta) == []
    assert _record_with(store, "k", fresh, _write(meta, "task-b"))
    assert [r["task_id"] for r in _rows(store, meta)] == ["task-b"]


def test_a_retry_after_a_lost_reply_succeeds_and_writes_one_row(store: SQLStore, meta: sa.Table) -> None:
    c = claim(store, "k")
    _record_with(store, "k", c, _write(meta, "task-1"))
    again = _write(meta, "task-1")
    assert _record_with(store, "k", c, again)  # the first statement committed both
    assert len(_rows(store, meta)) == 1


def test_a_success_row_already_there_stays(store: SQLStore, meta: sa.Table) -> None:
    with store._engine.begin() as conn:
        conn.execute(sa.insert(meta).values(id=1, task_id="task-1", status="SUCCESS", result=b'"first"'))
    c = claim(store, "k")
    write = _write(meta, "task-1", result=b'"second"')
    assert _record_with(store, "k", c, write)  # the result is stored (Celery would not replace it either)
    assert [bytes(r["result"]) for r in _rows(store, meta)] == [b'"first"']
    assert store.get("k").state is State.DONE  # type: ignore[union-attr]


def test_a_started_row_is_replaced_by_the_result(store: SQLStore, meta: sa.Table) -> None:
    with store._engine.begin() as conn:
        conn.execute(sa.insert(meta).values(id=1, task_id="task-1", status="STARTED"))
    c = claim(store, "k")
    _record_with(store, "k", c, _write(meta, "task-1"))
    assert [(r["status"], bytes(r["result"])) for r in _rows(store, meta)] == [("SUCCESS", b'"ok"')]


def test_a_table_the_fold_cannot_write_records_alone_and_leaves_the_row_to_celery(
    store: SQLStore, caplog: pytest.LogCaptureFixture
) -> None:
    # No unique task_id: ON CONFLICT (task_id) has nothing to infer, the statement fails whole.
    odd = sa.Table(f"m_{uuid.uuid4().hex[:12]}", sa.MetaData(), sa.Column("id", sa.Integer, primary_key=True),
                   sa.Column("task_id", sa.String(155)), sa.Column("status", sa.String(50)))
    odd.metadata.create_all(store._engine)
    try:
        c = claim(store, "k")
        row = {"task_id": "task-1", "status": "SUCCESS"}
        write = TaskMetaWrite(key="task-1", value=b"", table=odd, row=row)
        with caplog.at_level("WARNING", logger="celery_idem"):
            folded = _record_with(store, "k", c, write)
        assert not folded
        assert store.get("k").state is State.DONE  # type: ignore[union-attr]
        assert "leaving it to Celery" in caplog.text
        assert _rows(store, odd) == []
    finally:
        odd.metadata.drop_all(store._engine)


def test_a_plain_backend_write_is_recorded_without_folding(store: SQLStore) -> None:
    c = claim(store, "k")
    write = BackendWrite(key="celery-task-meta-x", value=b"{}")
    assert not _record_with(store, "k", c, write)
    assert store.get("k").state is State.DONE  # type: ignore[union-attr]
