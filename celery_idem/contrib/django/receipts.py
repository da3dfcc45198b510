"""Receipts on Django: the write and its receipt in one ``transaction.atomic()``.

The Django twin of :class:`celery_idem.contrib.receipts.ReceiptTransaction` (read its module doc for
why receipts exist). Inside a bound body::

    @app.task(base=IdempotentTask, bind=True)
    def charge(self, order_id):
        with self.idempotent_transaction() as tx:       # or using="payments"
            order = Order.objects.select_for_update().get(pk=order_id)
            order.paid = True
            order.save()
            tx.result = {"order": order_id}
        return tx.result

On enter the block opens ``transaction.atomic(using=alias)`` and inserts the receipt row
(keyed by the prefixed idempotency key) *first*, through the same connection as the ORM writes
that follow, so the two commit or roll back together. A later attempt of the same key (a
redelivery after a SIGKILL between the COMMIT and the record) meets the committed receipt: its
block does not run and the task returns the committed attempt's ``tx.result``. Two holders at
once (a takeover racing a frozen holder) serialise on the receipt's primary key.

Nesting: inside an outer ``atomic()`` the block is a savepoint, and the receipt commits with the
outer transaction, exactly as the ORM writes do. ``transaction.on_commit`` hooks registered in
the block run once the outermost transaction commits; a duplicate never runs the block, so it
registers no hook and a hook never fires twice for one action. (A worker killed after the COMMIT
and before its hooks ran loses them: Django runs them in-process, after the commit. A hook that
must happen belongs in an idempotent task of its own, enqueued from the hook.)
"""

from __future__ import annotations

import logging
from typing import Any

from ...records import Receipt
from ..receipt_flow import ReceiptFlow
from .models import RECEIPTS_TABLE
from .sql import Dialect

__all__ = ["DjangoReceiptTransaction", "Receipt", "open_receipt", "purge_receipts"]

logger = logging.getLogger("celery_idem")


class DjangoReceiptTransaction(ReceiptFlow):
    """The receipt of ``task.idempotent_transaction()`` on Django: the block is
    ``transaction.atomic(using=using)`` (the other arguments: :class:`ReceiptFlow`).

    Args:
        using: The ``DATABASES`` alias of the business writes (and the receipt).
        table: The receipts table name (the migrated ``celery_idem_receipts``).
    """

    def __init__(self, *, using: str = "default", table: str = RECEIPTS_TABLE, **attempt: Any) -> None:
        super().__init__(table=table, **attempt)
        if not table.isidentifier():
            raise ValueError(f"receipts table name must be a plain SQL identifier, got {table!r}")
        from django.db import connections

        if using not in connections.settings:
            raise ValueError(f"idempotent_transaction(using={using!r}): no such alias in DATABASES")
        self.using = using
        self._atomic: Any = None

    def _connection(self) -> Any:
        from django.db import connections

        return connections[self.using]

    def _vendor(self) -> str:
        return str(self._connection().vendor)

    def _begin(self) -> None:
        from django.db import transaction

        self._atomic = transaction.atomic(using=self.using)
        self._atomic.__enter__()

    def _end(self, error: BaseException | None) -> None:
        """Exit the block's atomic: commit (or release the savepoint), or roll it back."""
        atomic, self._atomic = self._atomic, None
        if error is not None:
            self.rolled_back = True
            atomic.__exit__(type(error), error, error.__traceback__)
        else:
            atomic.__exit__(None, None, None)

    def _acquire(self) -> Receipt | None:
        conn = self._connection()
        vendor = conn.vendor
        d = Dialect(vendor, conn.ops.quote_name)
        q, t = d.q, d.q(self.table)
        cols = f"{q('key')}, {q('token')}, {q('task_id')}, {q('content_type')}, {q('data')}, " \
               f"{q('created')}, {q('expires')}"
        values = f"%s, %s, %s, NULL, NULL, {d.now}, {d.now} + %s"
        params = [self.key, self.token, self.task_id, self.ttl]
        # Every database waits for a concurrent uncommitted insert of the same key here (the
        # second holder blocks on the first one's row), so no savepoint is needed.
        if vendor == "mysql":
            insert = f"INSERT IGNORE INTO {t} ({cols}) VALUES ({values})"
        else:
            insert = (f"INSERT INTO {t} ({cols}) VALUES ({values}) ON CONFLICT ({q('key')}) "
                      f"DO NOTHING RETURNING {q('key')}")
        # A locking read sees the latest committed row whatever the isolation level; a shared
        # lock (MySQL's INSERT IGNORE took one already; two upgrading to exclusive deadlock).
        lock = {"postgresql": " FOR SHARE", "mysql": " LOCK IN SHARE MODE"}.get(vendor, "")
        read = (f"SELECT {q('token')}, {q('task_id')}, {q('content_type')}, {q('data')}, "
                f"{q('expires')} <= {d.now} FROM {t} WHERE {q('key')} = %s{lock}")
        with conn.cursor() as cursor:
            for _ in range(3):
                cursor.execute(insert, params)
                # RETURNING, not rowcount: psycopg reports -1 for INSERT ... ON CONFLICT.
                inserted = cursor.rowcount == 1 if vendor == "mysql" else cursor.fetchone() is not None
                if inserted:
                    return None
                cursor.execute(read, [self.key])
                row = cursor.fetchone()
                if row is None:
                    continue  # purged between the two statements: insert again
                token, task_id, content_type, data, expired = row
                if expired:
                    # Expired like its record: the action may run again, as on a fresh key.
                    cursor.execute(
                        f"UPDATE {t} SET {q('token')} = %s, {q('task_id')} = %s, "
                        f"{q('content_type')} = NULL, {q('data')} = NULL, {q('created')} = {d.now}, "
                        f"{q('expires')} = {d.now} + %s WHERE {q('key')} = %s",
                        [self.token, self.task_id, self.ttl, self.key])
                    return None
                return Receipt(self.key, int(token), str(task_id), self.decoded(content_type, data))
        raise RuntimeError(f"the receipt of {self.key!r} keeps disappearing (purged in a loop?)")

    def _write_result(self, content_type: str, data: bytes) -> None:
        conn = self._connection()
        q = conn.ops.quote_name
        with conn.cursor() as cursor:
            cursor.execute(
                f"UPDATE {q(self.table)} SET {q('content_type')} = %s, {q('data')} = %s "
                f"WHERE {q('key')} = %s AND {q('token')} = %s",
                [content_type, data, self.key, self.token])


def open_receipt(target: None, *, commit: bool, using: str, **attempt: Any) -> DjangoReceiptTransaction:
    """The ``celery_idem.receipts`` entry ``django``: the receipt of one attempt in
    ``transaction.atomic(using=using)`` (Django commits the outermost atomic: ``commit`` and
    ``target`` do not apply)."""
    return DjangoReceiptTransaction(using=using, **attempt)


def purge_receipts(using: str = "default", *, table: str = RECEIPTS_TABLE, limit: int = 1000) -> int:
    """Delete up to ``limit`` expired receipts (database clock) of ``using``; return how many.

    The Django twin of :func:`celery_idem.contrib.receipts.purge_receipts`: an expired receipt already
    counts as absent, so this only reclaims space. Run it from a periodic task; call again
    while it returns ``limit``.
    """
    if not table.isidentifier():
        raise ValueError(f"receipts table name must be a plain SQL identifier, got {table!r}")
    from django.db import connections

    conn = connections[using]
    d = Dialect(conn.vendor, conn.ops.quote_name)
    q, t = d.q, d.q(table)
    with conn.cursor() as cursor:
        # The clock is read first and bound as a value, so PostgreSQL can use the expires index.
        cursor.execute(f"SELECT {d.now}")
        now = float(cursor.fetchone()[0])
        if conn.vendor == "mysql":
            cursor.execute(f"DELETE FROM {t} WHERE {q('expires')} <= %s LIMIT {int(limit)}", [now])
        else:
            # The outer condition is checked again on the row deleted: a takeover may have
            # renewed the receipt after the subquery read it as expired.
            cursor.execute(
                f"DELETE FROM {t} WHERE {q('key')} IN (SELECT {q('key')} FROM {t} WHERE "
                f"{q('expires')} <= %s LIMIT {int(limit)}) AND {q('expires')} <= %s", [now, now])
        return int(cursor.rowcount or 0)
