"""The SQL store's schema: the records table, its column types and the database clock.

Public so other tables celery_idem keeps in SQL (:mod:`celery_idem.contrib.receipts`) use the
same types, not copies.
"""

from __future__ import annotations

from typing import Any, Final

import sqlalchemy as sa
from sqlalchemy import exc as sa_exc
from sqlalchemy.dialects import mysql
from sqlalchemy.engine import Engine
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.elements import ColumnElement
from sqlalchemy.sql.functions import FunctionElement

from ...exceptions import ImproperlyConfigured
from ..base import TOKEN_CLOCK_SCALE

__all__ = ["DEFAULT_TABLE_NAME", "add_missing_columns", "data_type", "db_now", "new_metadata",
           "records_table", "text_type", "token_for"]

#: The table the store uses unless ``table_name`` says otherwise.
DEFAULT_TABLE_NAME: Final = "celery_idem_records"


class db_now(FunctionElement[float]):
    """The database server's clock in epoch seconds, as a DOUBLE, inside the statement."""

    type = sa.Double()
    inherit_cache = True
    name = "db_now"


@compiles(db_now, "postgresql")
def _db_now_postgresql(element: db_now, compiler: SQLCompiler, **kw: Any) -> str:
    # clock_timestamp(), not now(): now() is frozen at the start of the transaction.
    return "CAST(EXTRACT(EPOCH FROM clock_timestamp()) AS DOUBLE PRECISION)"


@compiles(db_now, "mysql")
@compiles(db_now, "mariadb")
def _db_now_mysql(element: db_now, compiler: SQLCompiler, **kw: Any) -> str:
    # UNIX_TIMESTAMP(NOW(6)) is a DECIMAL; "+ 0e0" makes it a DOUBLE like the columns. The
    # session time zone is pinned to UTC on connect, so the DST fold cannot make it jump.
    return "(UNIX_TIMESTAMP(NOW(6)) + 0e0)"


@compiles(db_now, "sqlite")
def _db_now_sqlite(element: db_now, compiler: SQLCompiler, **kw: Any) -> str:
    return "((julianday('now') - 2440587.5) * 86400.0)"


def token_for(previous: ColumnElement[Any], now: ColumnElement[float]) -> ColumnElement[int]:
    """A taking claim's token in SQL: ``max(previous + 1, now in µs)``, ``previous`` NULL = 0.

    The SQL twin of :func:`celery_idem.stores.base.next_token`, on the database clock ``now``.
    The cast rounds (PostgreSQL, MySQL) or truncates (SQLite): either is a clock reading.
    """
    after = sa.func.coalesce(previous, 0) + 1
    micros = sa.cast(now * TOKEN_CLOCK_SCALE, sa.BigInteger)
    return sa.case((after > micros, after), else_=micros)


def text_type(length: int) -> sa.types.TypeEngine[str]:
    """A ``VARCHAR(length)`` that compares byte for byte on every database.

    MySQL's default collations are case- and accent-insensitive (``Refund:ab`` and ``refund:ab``
    would be one key); the binary one compares like every other store (but for trailing spaces,
    which celery_idem's keys never end in).

    Args:
        length: The column's length in characters.
    """
    return sa.String(length).with_variant(
        mysql.VARCHAR(length, charset="utf8mb4", collation="utf8mb4_bin"), "mysql", "mariadb"
    )


def data_type() -> sa.types.TypeEngine[bytes]:
    """The type of an encoded result: a BLOB, ``LONGBLOB`` on MySQL (its BLOB stops at 64 KiB)."""
    return sa.LargeBinary().with_variant(mysql.LONGBLOB(), "mysql", "mariadb")


def new_metadata() -> sa.MetaData:
    """A ``MetaData`` whose indexes are named ``ix_<table>_<column>``, as celery_idem's are."""
    return sa.MetaData(naming_convention={"ix": "ix_%(table_name)s_%(column_0_name)s"})


def records_table(name: str = DEFAULT_TABLE_NAME) -> sa.Table:
    """The records table called ``name``, in a ``MetaData`` of its own (one per store).

    Args:
        name: The table's name.
    """
    return sa.Table(
        name,
        new_metadata(),
        sa.Column("key", text_type(255), primary_key=True),
        sa.Column("state", text_type(16), nullable=False, index=True),
        sa.Column("token", sa.BigInteger, nullable=False),
        sa.Column("owner", text_type(255), nullable=False),
        sa.Column("task_id", text_type(255), nullable=False),
        sa.Column("attempt", sa.Integer, nullable=False),
        sa.Column("lease_expires", sa.Double, nullable=True),
        sa.Column("payload_hash", text_type(255), nullable=True),
        sa.Column("content_type", text_type(255), nullable=True),
        sa.Column("data", data_type(), nullable=True),
        sa.Column("updated", sa.Double, nullable=False),
        # The TTL: after this (database clock) the row counts as absent.
        sa.Column("expires", sa.Double, nullable=False, index=True),
        # See Record.claim_id; NULL in a released tombstone and in rows older than claim ids.
        sa.Column("claim_id", text_type(64), nullable=True),
    )


def add_missing_columns(engine: Engine, table: sa.Table) -> None:
    """Add to ``table`` on ``engine`` the columns a table made by an earlier version lacks.

    Each is nullable without a default: an instant change on PostgreSQL, MySQL 8 and SQLite.

    Raises:
        ImproperlyConfigured: The column is missing and the store's user may not add it.
    """
    existing = {c["name"] for c in sa.inspect(engine).get_columns(table.name)}
    preparer = engine.dialect.identifier_preparer
    for column in [c for c in table.c if c.name not in existing]:
        ddl = (f"ALTER TABLE {preparer.format_table(table)} ADD COLUMN "
               f"{preparer.format_column(column)} "
               f"{column.type.compile(dialect=engine.dialect)}")
        try:
            with engine.begin() as conn:
                conn.exec_driver_sql(ddl)
        except sa_exc.DBAPIError as exc:
            # Another worker added it meanwhile, or this user may not alter the table.
            now = {c["name"] for c in sa.inspect(engine).get_columns(table.name)}
            if column.name in now:
                continue
            if exc.connection_invalidated:
                raise  # an outage, not a refusal: StoreUnavailable from the caller's seam
            raise ImproperlyConfigured(
                f"the SQL store's table {table.name!r} lacks the column "
                f"{column.name!r} (made by an earlier celery_idem) and it cannot be added: "
                f"{exc.orig}; run: {ddl}"
            ) from exc
