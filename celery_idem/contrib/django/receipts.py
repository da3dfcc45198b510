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
from collections.abc import Callable
from types import TracebackType
from typing import Any

from ...codec import Codec
from ...exceptions import LeaseLost
from ...records import Receipt
from .models import RECEIPTS_TABLE
from .sql import Dialect

__all__ = ["DjangoReceiptTransaction", "Receipt", "open_receipt", "purge_receipts"]

logger = logging.getLogger("celery_idem")


class _FoundReceipt(Exception):
    """Rolls the block's atomic back when an earlier attempt's receipt is found."""


class DjangoReceiptTransaction:
    """The context manager behind ``task.idempotent_transaction()`` on Django.

    Args:
        using: The ``DATABASES`` alias of the business writes (and the receipt).
        key: The stored key (prefix + idempotency key).
        token: The attempt's fencing token.
        task_id: The attempt's task id.
        codec: Encodes ``result`` for the receipt and decodes a found one.
        ttl: Seconds the receipt counts (the task's ``idempotency_ttl``).
        table: The receipts table name (the migrated ``celery_idem_receipts``).
        lease_lost: Returns True once another attempt took the claim over.
        on_found: Turns a found receipt into the signal the task layer catches.

    Attributes:
        result: The value to keep in the receipt (set it inside the block).
        held: True once this attempt inserted the receipt.
        rolled_back: True once the block's atomic was rolled back here: it left no receipt.
    """

    def __init__(
        self,
        *,
        using: str = "default",
        key: str,
        token: int,
        task_id: str,
        codec: Codec,
        ttl: float,
        table: str = RECEIPTS_TABLE,
        lease_lost: Callable[[], bool] = lambda: False,
        on_found: Callable[[Any], BaseException] | None = None,
    ) -> None:
        if not key or len(key) > 255:
            raise ValueError(
                f"a receipt key must be 1 to 255 characters (idempotency_key_prefix + key), got "
                f"{len(key)}: {key[:60]!r}...")
        if not table.isidentifier():
            raise ValueError(f"receipts table name must be a plain SQL identifier, got {table!r}")
        from django.db import connections

        if using not in connections.settings:
            raise ValueError(f"idempotent_transaction(using={using!r}): no such alias in DATABASES")
        self.using = using
        self.key = key
        self.token = token
        self.task_id = task_id
        self.codec = codec
        self.ttl = float(ttl)
        self.table = table
        self.lease_lost = lease_lost
        self.on_found = on_found
        self.result: Any = None
        self.held = False
        self.rolled_back = False
        self._entered = False
        self._atomic: Any = None

    def __enter__(self) -> DjangoReceiptTransaction:
        if self._entered:
            raise RuntimeError("an idempotent_transaction can be entered once; make a new one")
        self._entered = True
        from django.db import connections, transaction

        conn = connections[self.using]
        if conn.vendor not in ("postgresql", "mysql", "sqlite"):
            raise TypeError(f"idempotent_transaction supports PostgreSQL, MySQL/MariaDB and SQLite; "
                            f"the database {self.using!r} is {conn.vendor!r}")
        self._atomic = transaction.atomic(using=self.using)
        self._atomic.__enter__()
        try:
            found = self._acquire(conn)
        except BaseException as exc:
            self._leave(type(exc), exc, exc.__traceback__)
            raise
        if found is None:
            self.held = True
            return self
        self._leave(_FoundReceipt, _FoundReceipt(), None)  # nothing of ours to keep
        logger.info(
            "celery_idem receipt key=%s found (task %s, token %s): the transaction committed "
            "earlier; returning its result without running the block",
            self.key, found.task_id, found.token)
        if self.on_found is None:
            raise RuntimeError(f"the receipt of {self.key!r} exists: {found!r}")
        raise self.on_found(found)

    def _leave(self, exc_type: type[BaseException] | None, exc: BaseException | None,
               tb: TracebackType | None) -> None:
        """Exit the block's atomic: commit (or release the savepoint), or roll it back."""
        atomic, self._atomic = self._atomic, None
        if exc_type is not None:
            self.rolled_back = True
        atomic.__exit__(exc_type, exc, tb)

    def _acquire(self, conn: Any) -> Receipt | None:
        """Insert (or take over an expired) receipt; return the live one found instead."""
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
                value = None if content_type is None else \
                    self.codec.decode_result(self.key, content_type, bytes(data or b""))
                return Receipt(self.key, int(token), str(task_id), value)
        raise RuntimeError(f"the receipt of {self.key!r} keeps disappearing (purged in a loop?)")

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is not None:
            self._leave(exc_type, exc, tb)  # the block's error rolls its writes and receipt back
            return
        try:
            self._finish()
        except BaseException as error:
            self._leave(type(error), error, error.__traceback__)
            raise
        self._leave(None, None, None)  # the COMMIT (or the savepoint's release)

    def _finish(self) -> None:
        try:
            ctype, data = self.codec.encode_result(self.result)
        except Exception as exc:
            raise TypeError(
                f"idempotent_transaction: tx.result of {self.key!r} cannot be encoded with the "
                f"app's result serializer: {exc}; the transaction was rolled back") from exc
        if self.lease_lost():
            raise LeaseLost(
                f"the claim of {self.key!r} (token {self.token}) was taken over before the "
                f"commit; the transaction was rolled back", key=self.key, token=self.token)
        from django.db import connections

        conn = connections[self.using]
        q = conn.ops.quote_name
        with conn.cursor() as cursor:
            cursor.execute(
                f"UPDATE {q(self.table)} SET {q('content_type')} = %s, {q('data')} = %s "
                f"WHERE {q('key')} = %s AND {q('token')} = %s",
                [ctype, data, self.key, self.token])


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
