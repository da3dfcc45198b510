"""One receipt's life, whatever the connection: the part both receipts share.

:class:`ReceiptFlow` is the context manager of ``task.idempotent_transaction()``: on enter it opens
the transaction and inserts the receipt first (or finds an earlier attempt's), on exit it writes
the result into the receipt and ends the transaction. A connection kind supplies the SQL and the
transaction's ends: SQLAlchemy's (:mod:`celery_idem.contrib.receipts`) or Django's
(:mod:`celery_idem.contrib.django.receipts`). The statements are one set, plain SQL text
(:class:`ReceiptSQL`), run through a connection kind's ``_run``: neither library is imported here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any

from ..codec import Codec
from ..exceptions import LeaseLost
from ..records import Receipt

__all__ = ["EarlierReceipt", "ReceiptFlow", "ReceiptSQL"]

logger = logging.getLogger("celery_idem")

#: The databases a receipt supports (SQLAlchemy dialect or Django vendor names).
VENDORS = ("postgresql", "mysql", "mariadb", "sqlite")


class ReceiptSQL:
    """The receipt statements of the receipts table ``table`` on one database (``vendor``,
    ``quote``, ``now`` and ``param`` as :class:`celery_idem.stores.sql_records.RecordSQL`'s)."""

    def __init__(self, vendor: str, quote: Callable[[str], str], now: str, table: str,
                 param: str = "%s") -> None:
        q, p, t = quote, param, quote(table)
        self.returning = vendor != "mysql"
        cols = ", ".join(q(c) for c in ("key", "token", "task_id", "content_type", "data", "created",
                                        "expires"))
        values = f"{p}, {p}, {p}, NULL, NULL, {now}, {now} + {p}"
        # Every database waits for a concurrent uncommitted insert of the same key here (the
        # second holder blocks on the first one's row), so no savepoint is needed.
        self.insert = (f"INSERT IGNORE INTO {t} ({cols}) VALUES ({values})" if vendor == "mysql" else
                       f"INSERT INTO {t} ({cols}) VALUES ({values}) ON CONFLICT ({q('key')}) "
                       f"DO NOTHING RETURNING {q('key')}")
        # A locking read sees the latest committed row whatever the isolation level (a plain
        # SELECT under MySQL's REPEATABLE READ could read an older snapshot). A shared lock:
        # MySQL's INSERT IGNORE took one already, and two upgrading to exclusive deadlock.
        lock = {"postgresql": " FOR SHARE", "mysql": " LOCK IN SHARE MODE"}.get(vendor, "")
        self.read = (f"SELECT {q('token')}, {q('task_id')}, {q('content_type')}, {q('data')}, "
                     f"{q('expires')} <= {now} FROM {t} WHERE {q('key')} = {p}{lock}")
        self.revive = (f"UPDATE {t} SET {q('token')} = {p}, {q('task_id')} = {p}, "
                       f"{q('content_type')} = NULL, {q('data')} = NULL, {q('created')} = {now}, "
                       f"{q('expires')} = {now} + {p} WHERE {q('key')} = {p}")
        self.write = (f"UPDATE {t} SET {q('content_type')} = {p}, {q('data')} = {p} "
                      f"WHERE {q('key')} = {p} AND {q('token')} = {p}")
        self.clock = f"SELECT {now}"
        # A bounded batch of expired receipts (the clock bound as a value, so PostgreSQL can use
        # the expires index); the keys come through a derived table because MySQL refuses a
        # LIMIT directly inside IN (...). The outer condition is checked again on the row being
        # deleted: a takeover may have renewed the receipt (committed while this DELETE waited
        # for its row lock) after the subquery read it as expired.
        self.purge = (f"DELETE FROM {t} WHERE {q('key')} IN (SELECT d.{q('key')} FROM (SELECT "
                      f"{q('key')} FROM {t} WHERE {q('expires')} <= {p} LIMIT {p}) d) "
                      f"AND {q('expires')} <= {p}")


class EarlierReceipt(Exception):
    """Raised into a connection kind's ``_end`` when an earlier attempt's receipt was found: the
    transaction ends as on an error, with nothing of this attempt's to keep."""


class ReceiptFlow:
    """The context manager behind ``task.idempotent_transaction(...)``: one receipt, one commit.

    Args:
        key: The stored key (prefix + idempotency key).
        token: The attempt's fencing token.
        task_id: The attempt's task id.
        codec: Encodes ``result`` for the receipt and decodes a found one.
        ttl: Seconds the receipt counts (the task's ``idempotency_ttl``).
        table: The receipts table name.
        lease_lost: Returns True once another attempt took the claim over.
        on_found: Turns a found receipt into the signal the task layer catches.

    Attributes:
        result: The value to keep in the receipt (set it inside the block); a later attempt that
            finds the receipt returns it as the task's result.
        held: True once this attempt inserted the receipt.
        rolled_back: True once the block's transaction was rolled back here: it left no
            receipt, so another block of the same run may follow.
    """

    def __init__(self, *, key: str, token: int, task_id: str, codec: Codec, ttl: float, table: Any,
                 lease_lost: Callable[[], bool] = lambda: False,
                 on_found: Callable[[Receipt], BaseException] | None = None) -> None:
        if not key or len(key) > 255:
            # The key column is 255 characters; MySQL's INSERT IGNORE would truncate a longer
            # key silently and make two actions share one receipt.
            raise ValueError(
                f"a receipt key must be 1 to 255 characters (idempotency_key_prefix + key), got "
                f"{len(key)}: {key[:60]!r}...")
        self.key, self.token, self.task_id, self.codec = key, token, task_id, codec
        self.ttl, self.table = float(ttl), table
        self.lease_lost, self.on_found = lease_lost, on_found
        self.result: Any = None
        self.held = self.rolled_back = self._entered = False

    # -- what a connection kind supplies ---------------------------------------------------------

    def _vendor(self) -> str:
        """The database's name (one of :data:`VENDORS` is supported)."""
        raise NotImplementedError

    def _begin(self) -> None:
        """Open the block's transaction (or join the caller's)."""

    def _sql(self) -> ReceiptSQL:
        """The receipt statements for this connection's database."""
        raise NotImplementedError

    def _run(self, sql: str, params: Sequence[Any]) -> tuple[int, list[Sequence[Any]]]:
        """Run one statement in the block's transaction: its row count and its rows."""
        raise NotImplementedError

    def _end(self, error: BaseException | None) -> None:
        """End the block's transaction: commit when ``error`` is None, else roll back."""
        raise NotImplementedError

    def _acquire(self) -> Receipt | None:
        """Insert (or take over an expired) receipt; return the live one found instead."""
        s = self._sql()
        for _ in range(3):
            count, rows = self._run(s.insert, [self.key, self.token, self.task_id, self.ttl])
            # RETURNING, not rowcount: psycopg reports -1 for INSERT ... ON CONFLICT.
            if (rows if s.returning else count == 1):
                return None
            _, rows = self._run(s.read, [self.key])
            if not rows:
                continue  # purged between the two statements: insert again
            token, task_id, content_type, data, expired = rows[0]
            if expired:
                # Expired like its record: the action may run again, as on a fresh key.
                self._run(s.revive, [self.token, self.task_id, self.ttl, self.key])
                return None
            return Receipt(self.key, int(token), str(task_id), self.decoded(content_type, data))
        raise RuntimeError(f"the receipt of {self.key!r} keeps disappearing (purged in a loop?)")

    def _write_result(self, content_type: str, data: bytes) -> None:
        """Write the encoded result into this attempt's receipt."""
        self._run(self._sql().write, [content_type, data, self.key, self.token])

    # -- the flow ---------------------------------------------------------------------------------

    def __enter__(self) -> Any:
        if self._entered:
            raise RuntimeError("an idempotent_transaction can be entered once; make a new one")
        self._entered = True
        vendor = self._vendor()
        if vendor not in VENDORS:
            raise TypeError(f"idempotent_transaction supports PostgreSQL, MySQL/MariaDB and SQLite; "
                            f"this database is {vendor!r}")
        self._begin()
        try:
            found = self._acquire()
        except BaseException as exc:
            self._end(exc)
            raise
        if found is None:
            self.held = True
            return self
        self._end(EarlierReceipt())  # nothing was written; leave the connection clean
        logger.info(
            "celery_idem receipt key=%s found (task %s, token %s): the transaction committed "
            "earlier; returning its result without running the block",
            self.key, found.task_id, found.token)
        if self.on_found is None:
            raise RuntimeError(f"the receipt of {self.key!r} exists: {found!r}")
        raise self.on_found(found)

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc is not None:
            self._end(exc)  # the block's error rolls its writes and the receipt back
            return
        try:
            try:
                ctype, data = self.codec.encode_result(self.result)
            except Exception as error:
                raise TypeError(
                    f"idempotent_transaction: tx.result of {self.key!r} cannot be encoded with the "
                    f"app's result serializer: {error}; the transaction was rolled back") from error
            if self.lease_lost():
                # A takeover is already waiting on our receipt row: let it do the write, as the
                # fencing token says, instead of committing from a holder the store disowned.
                raise LeaseLost(
                    f"the claim of {self.key!r} (token {self.token}) was taken over before the "
                    f"commit; the transaction was rolled back", key=self.key, token=self.token)
            self._write_result(ctype, data)
        except BaseException as error:
            self._end(error)
            raise
        self._end(None)

    def decoded(self, content_type: str | None, data: bytes | None) -> Any:
        """A found receipt's result (None when committed without one: a caller that kept a
        failed block's writes)."""
        if content_type is None:
            return None
        return self.codec.decode_result(self.key, content_type, bytes(data or b""))
