"""purge_receipts against a takeover that is renewing an expired receipt in an open transaction.

The purge reads the expired key, then waits for the row lock the takeover holds. Once the
takeover commits, that receipt is live again (new token, new expiry) and must survive: a purge
that deleted it would let a redelivery of the new action write its effect a second time.
"""

from __future__ import annotations

import threading

import sqlalchemy as sa

from celery_idem.codec import KombuCodec
from celery_idem.contrib.receipts import ReceiptTransaction, purge_receipts, receipts_table
from celery_idem.stores.sql import db_now
from tests.integration.harness import wait_for
from tests.receipts.conftest import BusinessDB


def _session_id(conn: sa.Connection, dialect: str) -> int:
    query = "SELECT pg_backend_pid()" if dialect == "postgresql" else "SELECT CONNECTION_ID()"
    return int(conn.execute(sa.text(query)).scalar_one())


def _waits_for_a_lock(db: BusinessDB, session: int) -> bool:
    """Whether the session ``session`` (the purge's) waits for a row lock now."""
    with db.engine.connect() as conn:
        if db.dialect == "postgresql":
            query = "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND pid = :s"
        else:
            query = ("SELECT count(*) FROM information_schema.INNODB_TRX "
                     "WHERE trx_state = 'LOCK WAIT' AND trx_mysql_thread_id = :s")
        return bool(conn.execute(sa.text(query), {"s": session}).scalar())


def _purge(db: BusinessDB, sessions: list[int], purged: list[int]) -> None:
    """Purge on a connection of its own, whose id goes to ``sessions`` first; its lock wait is
    not cut short by the server's default timeout on a loaded machine."""
    with db.engine.connect() as conn:
        if db.dialect != "postgresql":
            conn.execute(sa.text("SET SESSION innodb_lock_wait_timeout = 600"))
        sessions.append(_session_id(conn, db.dialect))
        purged.append(purge_receipts(conn, table=db.receipts))
        conn.commit()


def test_a_receipt_taken_over_while_the_purge_waits_survives(concurrent_db: BusinessDB) -> None:
    db = concurrent_db
    t = receipts_table(db.receipts)
    t.create(db.engine)
    key = "purge-race:k1"
    with db.engine.begin() as conn:  # an old receipt of the key, expired
        conn.execute(sa.insert(t).values(key=key, token=1, task_id="old", content_type=None,
                                         data=None, created=db_now() - 100,
                                         expires=db_now() - 10))

    with db.engine.connect() as conn:
        # The next run of the action takes the expired receipt over (uncommitted, row locked).
        tx = ReceiptTransaction(conn, key=key, token=2, task_id="new", codec=KombuCodec("json"),
                                ttl=600, table=db.receipts)
        tx.__enter__()
        purged: list[int] = []
        sessions: list[int] = []
        purge = threading.Thread(target=_purge, args=(db, sessions, purged))
        purge.start()
        try:
            wait_for(lambda: bool(sessions) and _waits_for_a_lock(db, sessions[0]),
                     timeout=120, what="the purge to wait for the receipt's row lock")
        finally:
            tx.result = {"order": 7}
            tx.__exit__(None, None, None)  # commit: the receipt is live again
            purge.join(timeout=60)
    assert not purge.is_alive()
    with db.engine.connect() as conn:
        rows = conn.execute(sa.select(t.c.token, t.c.task_id)).all()
    assert [tuple(r) for r in rows] == [(2, "new")], f"purge deleted {purged} live receipt(s)"
