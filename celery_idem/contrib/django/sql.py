"""The SQL the Django store and its receipts share: the vendor's fragments and the claim's decision."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ...stores.base import TOKEN_CLOCK_SCALE

__all__ = ["Dialect", "status_sql"]


class Dialect:
    """The few SQL fragments that differ between PostgreSQL, SQLite and MySQL/MariaDB."""

    def __init__(self, vendor: str, quote: Any) -> None:
        self.vendor = vendor
        self.q = quote
        if vendor == "postgresql":
            # clock_timestamp(), not now(): now() is frozen at the start of the transaction.
            self.now = "CAST(EXTRACT(EPOCH FROM clock_timestamp()) AS DOUBLE PRECISION)"
            self.bigint = "BIGINT"
            self.greatest = "GREATEST"
        elif vendor == "mysql":
            # UTC_TIMESTAMP(6) ignores the session time zone (Django does not pin it), and
            # TIMESTAMPDIFF on DATETIMEs is plain arithmetic: no DST fold can make it jump.
            self.now = "(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) / 1e6)"
            self.bigint = "SIGNED"
            self.greatest = "GREATEST"
        else:
            self.now = "((julianday('now') - 2440587.5) * 86400.0)"
            self.bigint = "INTEGER"
            self.greatest = "max"

    def token_for(self, previous: str, now: str) -> str:
        """``max(previous + 1, now in µs)`` in SQL, ``previous`` NULL = 0 (see next_token)."""
        return (f"{self.greatest}(COALESCE({previous}, 0) + 1, "
                f"CAST({now} * {TOKEN_CLOCK_SCALE} AS {self.bigint}))")


def status_sql(q: Any, row: str, now: str, now_params: Sequence[Any], *, payload_hash: str | None,
                task_id: str, attempt: int) -> tuple[str, list[Any]]:
    """The claim's decision as a CASE over ``row`` (may be an outer-joined NULL row) at ``now``.

    The order and meaning of :meth:`celery_idem.stores.base.Store.claim` (and of the SQL
    store's ``ClaimArgs.status``). ``now`` is SQL (a column, or ``%s`` with its value in
    ``now_params``). Returns the SQL and its parameters in placeholder order.
    """
    def c(name: str) -> str:
        return f"{row}.{q(name)}"

    if payload_hash:
        # Like every store: a validating caller refuses a record with another hash or none.
        mismatch = f"({c('payload_hash')} IS NULL OR {c('payload_hash')} <> %s)"
        hash_params: list[Any] = [payload_hash]
    else:
        mismatch, hash_params = "(1 = 0)", []
    sql = (
        f"CASE WHEN {c('key')} IS NULL OR {c('expires')} <= {now} OR {c('state')} = 'released' "
        f"THEN 'claimed' "
        f"WHEN {mismatch} THEN 'mismatch' "
        f"WHEN {c('state')} = 'done' THEN 'done' "
        f"WHEN {c('state')} = 'failed' THEN 'failed' "
        f"WHEN {c('state')} = 'in_progress' AND (({c('lease_expires')} IS NOT NULL AND "
        f"{c('lease_expires')} <= {now}) OR ({c('task_id')} = %s AND {c('attempt')} < %s)) "
        f"THEN 'takeover' "
        f"WHEN {c('state')} = 'in_progress' THEN 'busy' "
        f"ELSE NULL END"
    )
    return sql, [*now_params, *hash_params, *now_params, task_id, attempt]
