"""One receipt's life, whatever the connection: the part both receipts share.

:class:`ReceiptFlow` is the context manager of ``task.idempotent_transaction()``: on enter it opens
the transaction and inserts the receipt first (or finds an earlier attempt's), on exit it writes
the result into the receipt and ends the transaction. A connection kind supplies the SQL and the
transaction's ends: SQLAlchemy's (:mod:`celery_idem.contrib.receipts`) or Django's
(:mod:`celery_idem.contrib.django.receipts`). Neither library is imported here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from types import TracebackType
from typing import Any

from ..codec import Codec
from ..exceptions import LeaseLost
from ..records import Receipt

__all__ = ["EarlierReceipt", "ReceiptFlow"]

logger = logging.getLogger("celery_idem")

#: The databases a receipt supports (SQLAlchemy dialect or Django vendor names).
VENDORS = ("postgresql", "mysql", "mariadb", "sqlite")


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

    def _acquire(self) -> Receipt | None:
        """Insert (or take over an expired) receipt; return the live one found instead."""
        raise NotImplementedError

    def _write_result(self, content_type: str, data: bytes) -> None:
        """Write the encoded result into this attempt's receipt."""
        raise NotImplementedError

    def _end(self, error: BaseException | None) -> None:
        """End the block's transaction: commit when ``error`` is None, else roll back."""
        raise NotImplementedError

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
