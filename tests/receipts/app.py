"""The Celery app of the receipts kill tests, run in real ``celery worker`` processes.

Configured from the environment (set by :mod:`tests.receipts.kills`):

* ``RCPT_REDIS``: a private ``redis-server`` (broker, result backend, kill flags);
* ``RCPT_STORE``: the idempotency store URL (that Redis, or the business PostgreSQL);
* ``RCPT_STORE_TABLE``: the SQL store's table; ``RCPT_PREFIX``, ``RCPT_QUEUE``;
* ``RCPT_DB``, ``RCPT_ORDERS``, ``RCPT_RECEIPTS``: the business database and its tables;
* ``RCPT_LEASE``: ``idempotency_lease`` seconds; ``RCPT_PLAIN=1``: no receipt (the control).

``place_order`` writes one order row and its receipt in one transaction; then, the first time
each action commits, the pool process SIGKILLs itself: after the commit, before the record
and before the ack. The redelivery must find the receipt and write nothing.
"""

from __future__ import annotations

import os
import signal
from typing import Any

import redis
import sqlalchemy as sa
from celery import Celery
from sqlalchemy.orm import Session

from celery_idem import IdempotentTask

PREFIX = os.environ.get("RCPT_PREFIX", "rcpt:")
REDIS = os.environ.get("RCPT_REDIS", "redis://127.0.0.1:6379/0")
LEASE = float(os.environ.get("RCPT_LEASE", "2"))
#: ``RCPT_PLAIN=1``: write without a receipt, to show what the kill does without one.
PLAIN = os.environ.get("RCPT_PLAIN") == "1"

app = Celery("receipts", broker=REDIS, backend=REDIS)
app.conf.update(
    task_default_queue=os.environ.get("RCPT_QUEUE", "receipts"),
    idempotency_key_prefix=PREFIX,
    idempotency_store=os.environ.get("RCPT_STORE") or REDIS,
    idempotency_receipts_table=os.environ.get("RCPT_RECEIPTS", "celery_idem_receipts"),
    result_expires=3600,
    broker_connection_retry_on_startup=True,
    worker_prefetch_multiplier=1,
    # Fast crash recovery (docs/shared celery-behaviour.md, finding 8).
    broker_transport_options={"visibility_timeout": 3600, "unacked_restore_interval": 1,
                              "unacked_restore_throttle": 1},
)
if os.environ.get("RCPT_STORE_TABLE"):
    app.conf.idempotency_store_options = {"table_name": os.environ["RCPT_STORE_TABLE"]}

_engines: dict[int, sa.Engine] = {}


def orders_table(name: str) -> sa.Table:
    """Orders with no unique constraint on ``action``: a duplicate write shows as a second row."""
    return sa.Table(
        name, sa.MetaData(),
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("action", sa.String(100), nullable=False, index=True),
        sa.Column("amount", sa.Integer, nullable=False),
        sa.Column("task_id", sa.String(100), nullable=False),
        sa.Column("token", sa.BigInteger, nullable=False),
        sa.Column("pid", sa.Integer, nullable=False),
    )


ORDERS = orders_table(os.environ.get("RCPT_ORDERS", "rcpt_orders"))


def engine() -> sa.Engine:
    """One engine per process: a pool inherited through fork would share sockets."""
    pid = os.getpid()
    if pid not in _engines:
        _engines[pid] = sa.create_engine(os.environ["RCPT_DB"], pool_pre_ping=True)
    return _engines[pid]


_flags = redis.Redis.from_url(REDIS)


@app.task(base=IdempotentTask, bind=True, idempotency_fields=("action",), idempotency_lease=LEASE)
def place_order(self: IdempotentTask, action: str, amount: int) -> dict[str, Any]:
    pid = os.getpid()
    row = {"action": action, "amount": amount, "task_id": self.request.id,
           "token": self.idempotency_token, "pid": pid}
    if PLAIN:
        # The control: the same write without a receipt (commit, then the gate's record).
        with Session(engine()) as session:
            session.execute(sa.insert(ORDERS).values(**row))
            session.commit()
        result = row
    else:
        with Session(engine()) as session, self.idempotent_transaction(session) as tx:
            session.execute(sa.insert(ORDERS).values(**row))
            tx.result = row
        result = tx.result
    # Committed. The first attempt of each action dies here: before the gate records the
    # result and before Celery acknowledges the message (acks_late).
    if _flags.set(f"{PREFIX}killed:{action}", pid, nx=True):
        os.kill(pid, signal.SIGKILL)
    return result
