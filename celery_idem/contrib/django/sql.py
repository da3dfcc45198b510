"""The SQL fragments the Django store and its receipts share: the database clock per vendor."""

from __future__ import annotations

from typing import Any

__all__ = ["Dialect"]


class Dialect:
    """The database clock (``now``, epoch seconds) of PostgreSQL, SQLite or MySQL/MariaDB, and its quoting."""

    def __init__(self, vendor: str, quote: Any) -> None:
        self.vendor = vendor
        self.q = quote
        if vendor == "postgresql":
            # clock_timestamp(), not now(): now() is frozen at the start of the transaction.
            self.now = "CAST(EXTRACT(EPOCH FROM clock_timestamp()) AS DOUBLE PRECISION)"
        elif vendor == "mysql":
            # UTC_TIMESTAMP(6) ignores the session time zone (Django does not pin it), and
            # TIMESTAMPDIFF on DATETIMEs is plain arithmetic: no DST fold can make it jump.
            self.now = "(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) / 1e6)"
        else:
            self.now = "((julianday('now') - 2440587.5) * 86400.0)"
