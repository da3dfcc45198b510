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

from collections.abc import Sequence
from typing import Any

from ...records import Receipt
from ..receipt_flow import ReceiptFlow, ReceiptSQL
from .models import RECEIPTS_TABLE
from .sql import Dialect

__all__ = ["DjangoReceiptTransaction", "Receipt", "open_receipt", "purge_receipts"]

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

    def _sql(self) -> ReceiptSQL:
        conn = self._connection()
        d = Dialect(conn.vendor, conn.ops.quote_name)
        return ReceiptSQL(conn.vendor, d.q, d.now, self.table)

    def _run(self, sql: str, params: Sequence[Any]) -> tuple[int, list[Sequence[Any]]]:
        with self._connection().cursor() as cursor:
            cursor.execute(sql, params)
            return cursor.rowcount, cursor.fetchall() if cursor.description else []


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
    sql = ReceiptSQL(conn.vendor, d.q, d.now, table)
    with conn.cursor() as cursor:
        cursor.execute(sql.clock)
        now = float(cursor.fetchone()[0])
        cursor.execute(sql.purge, [now, int(limit), now])
        return int(cursor.rowcount or 0)
