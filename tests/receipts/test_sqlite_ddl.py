"""SQLite creates the receipts table inside the caller's transaction: a rollback undoes it.

A block that fails the first time the table is ever used must not leave the process believing
the table exists (every later receipt would then fail with "no such table").
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

from celery_idem.codec import KombuCodec
from celery_idem.contrib.receipts import ReceiptTransaction
from tests.receipts.conftest import orders_table


def _tx(session: Session, table: str, key: str, token: int) -> ReceiptTransaction:
    return ReceiptTransaction(session, key=key, token=token, task_id=f"task-{token}",
                              codec=KombuCodec("json"), ttl=600, table=table, commit=False)


def test_a_rolled_back_first_use_does_not_leave_the_table_marked_ready(tmp_path: Path) -> None:
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'business.db'}")
    orders = orders_table("orders_ddl")
    orders.metadata.create_all(engine)
    table = f"receipts_{uuid.uuid4().hex[:8]}"
    row = {"action": "a1", "amount": 1, "task_id": "t", "token": 1}

    # The caller's transaction writes first (pysqlite opens it at that INSERT), then the
    # receipt's table is created in it, then the block fails: everything is rolled back.
    with pytest.raises(ValueError, match="declined"), Session(engine) as session, \
            session.begin():
        session.execute(sa.insert(orders).values(**row))
        with _tx(session, table, "ddl:a1", 1):
            raise ValueError("declined")
    assert not sa.inspect(engine).has_table(table)

    # The next attempt (same process, same engine) writes its receipt.
    with Session(engine) as session, session.begin():
        session.execute(sa.insert(orders).values(**row))
        with _tx(session, table, "ddl:a1", 2) as tx:
            tx.result = {"ok": True}
    with engine.connect() as conn:
        tokens = conn.execute(sa.text(f"SELECT token FROM {table}")).scalars().all()
    assert tokens == [2]
    engine.dispose()
