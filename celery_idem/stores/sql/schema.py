"""The SQL store's schema: the records table, its column types and the database clock (public:
celery_idem's other SQL tables use the same types)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

import sqlalchemy as sa
from sqlalchemy import exc as sa_exc
from sqlalchemy.dialects import mysql
from sqlalchemy.engine import Engine
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.functions import FunctionElement

from ...exceptions import ImproperlyConfigured
from ..base import mysql_byte_collation

__all__ = ["DEFAULT_TABLE_NAME", "add_missing_columns", "data_type", "db_now", "intent_tables",
           "new_metadata", "records_table", "text_type"]

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


class KeyText(sa.String):
    """A ``VARCHAR`` that compares byte for byte on every database (:func:`text_type`)."""

    cache_ok = True


@compiles(KeyText, "mysql")
@compiles(KeyText, "mariadb")
def _key_text_mysql(element: KeyText, compiler: Any, **kw: Any) -> str:
    collation = mysql_byte_collation(compiler.dialect.is_mariadb, compiler.dialect.server_version_info or ())
    return f"VARCHAR({element.length}) CHARACTER SET utf8mb4 COLLATE {collation}"


def text_type(length: int) -> sa.types.TypeEngine[str]:
    """A ``VARCHAR(length)`` (characters) that compares byte for byte on every database.

    MySQL's default collations are case- and accent-insensitive, and its ``_bin`` ones ignore
    trailing spaces: the column takes the NO PAD binary collation (:func:`mysql_byte_collation`).
    """
    return KeyText(length)


def data_type() -> sa.types.TypeEngine[bytes]:
    """The type of an encoded result: a BLOB, ``LONGBLOB`` on MySQL (its BLOB stops at 64 KiB)."""
    return sa.LargeBinary().with_variant(mysql.LONGBLOB(), "mysql", "mariadb")


def new_metadata() -> sa.MetaData:
    """A ``MetaData`` whose indexes are named ``ix_<table>_<column>``, as celery_idem's are."""
    return sa.MetaData(naming_convention={"ix": "ix_%(table_name)s_%(column_0_name)s"})


def records_table(name: str = DEFAULT_TABLE_NAME) -> sa.Table:
    """The records table called ``name``, in a ``MetaData`` of its own (one per store)."""
    return sa.Table(
        name, new_metadata(),
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
        sa.Column("claim_id", text_type(64), nullable=True))


def intent_tables(records: sa.Table) -> tuple[sa.Table, sa.Table]:
    """The intents and watermarks tables of ``records`` (``<name>_intents``, ``<name>_watermarks``;
    :mod:`celery_idem.stores.sql_intents`), in its ``MetaData``: created with it."""
    intents = sa.Table(
        f"{records.name}_intents", records.metadata,
        sa.Column("key", text_type(255), primary_key=True),
        sa.Column("task_id", text_type(255), nullable=False),
        sa.Column("queue", text_type(255), nullable=False),
        sa.Column("message", data_type(), nullable=False),
        # Store clock (epoch seconds), as the records' times.
        sa.Column("enqueued", sa.Double, nullable=False),
        sa.Column("deadline", sa.Double, nullable=False, index=True),
        sa.Column("expires", sa.Double, nullable=False),
        sa.Column("sent", sa.Double, nullable=False))
    watermarks = sa.Table(
        f"{records.name}_watermarks", records.metadata,
        sa.Column("queue", text_type(255), primary_key=True),
        sa.Column("enqueued", sa.Double, nullable=False))
    return intents, watermarks


def add_missing_columns(engine: Engine, table: sa.Table) -> None:
    """Bring ``table`` on ``engine``, as an earlier version made it, to this schema: add the
    (nullable) columns it lacks, and on MySQL/MariaDB the byte-for-byte collation (once).

    Raises:
        ImproperlyConfigured: The change is needed and the store's user may not make it.
    """
    def columns() -> set[str]:
        return {c["name"] for c in sa.inspect(engine).get_columns(table.name)}

    preparer = engine.dialect.identifier_preparer
    existing = columns()
    for column in [c for c in table.c if c.name not in existing]:
        def added(name: str = column.name) -> bool:
            return name in columns()

        _alter(engine, table, f"ADD COLUMN {preparer.format_column(column)} "
                              f"{column.type.compile(dialect=engine.dialect)}", added)
    if engine.dialect.name not in ("mysql", "mariadb"):
        return
    stale = [c for c in table.c if isinstance(c.type, KeyText) and c.name in _stale_collations(engine, table)]
    if stale:
        _alter(engine, table, ", ".join(
            f"MODIFY COLUMN {preparer.format_column(c)} {c.type.compile(dialect=engine.dialect)} "
            f"{'NULL' if c.nullable else 'NOT NULL'}" for c in stale),
            lambda: not set(_stale_collations(engine, table)) & {c.name for c in stale})


def _stale_collations(engine: Engine, table: sa.Table) -> list[str]:
    """The text columns of ``table`` (MySQL/MariaDB) whose collation is not the byte-for-byte one."""
    with engine.connect() as conn:
        dialect: Any = engine.dialect  # MySQLDialect: is_mariadb, known once connected
        wanted = mysql_byte_collation(dialect.is_mariadb, dialect.server_version_info or ())
        rows = conn.execute(sa.text(
            "SELECT COLUMN_NAME, COLLATION_NAME FROM information_schema.COLUMNS "
            "WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = :name AND COLLATION_NAME IS NOT NULL"),
            {"name": table.name}).all()
    return [name for name, collation in rows if collation != wanted]


def _alter(engine: Engine, table: sa.Table, change: str, done: Callable[[], bool]) -> None:
    """``ALTER TABLE table change``; ``done`` says whether another worker made it meanwhile."""
    ddl = f"ALTER TABLE {engine.dialect.identifier_preparer.format_table(table)} {change}"
    try:
        with engine.begin() as conn:
            conn.exec_driver_sql(ddl)
    except sa_exc.DBAPIError as exc:
        # Another worker made the change meanwhile, or this user may not alter the table.
        if done():
            return
        if exc.connection_invalidated:
            raise  # an outage, not a refusal: StoreUnavailable from the caller's seam
        raise ImproperlyConfigured(
            f"the SQL store's table {table.name!r} (made by an earlier celery_idem) needs a "
            f"change it cannot make: {exc.orig}; run: {ddl}") from exc
