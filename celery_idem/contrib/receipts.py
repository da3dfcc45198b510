"""Receipts: record an action in the same SQL transaction as its business write.

The gate records a body's result *after* the body returns, so a worker that dies between the
body's ``COMMIT`` and that record leaves a committed effect with no record: when the lease runs
out, a redelivery takes over and would write again. A receipt closes that window for bodies
whose effect is a write to a SQL database: a row keyed by the idempotency key, inserted in the
business transaction itself. A crash at any instant leaves both the write and the receipt, or
neither; a takeover that finds the receipt returns its result without writing.

Use it through :meth:`celery_idem.IdempotentTask.idempotent_transaction`::

    @app.task(base=IdempotentTask, bind=True)
    def place_order(self, order_id, amount):
        with Session(engine) as session:
            with self.idempotent_transaction(session) as tx:
                session.add(Order(id=order_id, amount=amount))
                tx.result = {"order_id": order_id}
        return tx.result

The receipt row is inserted *first*, so two holders of one key (a takeover racing a frozen
holder) serialise on its primary key: the second blocks until the first commits (it then finds
the receipt) or rolls back (it then writes). The table lives in the business database (any of
PostgreSQL, MySQL/MariaDB and SQLite) whatever the idempotency store is.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from typing import Any, Final

import sqlalchemy as sa
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.orm import Session

from ..records import Receipt
from ..stores.sql import data_type, db_now, new_metadata, text_type
from ..stores.sql.schema import add_missing_columns
from .receipt_flow import ReceiptFlow, ReceiptSQL

__all__ = ["DEFAULT_RECEIPTS_TABLE", "Receipt", "ReceiptTransaction", "open_receipt", "purge_receipts",
           "receipts_table"]

#: The receipts table unless ``app.conf.idempotency_receipts_table`` or ``table=`` says otherwise.
DEFAULT_RECEIPTS_TABLE: Final = "celery_idem_receipts"


_tables: dict[str, sa.Table] = {}
_tables_lock = threading.Lock()
# Engines (by table name) whose receipts table is known to exist: one CREATE check per process.
_ready: weakref.WeakKeyDictionary[Engine, set[str]] = weakref.WeakKeyDictionary()


def receipts_table(name: str = DEFAULT_RECEIPTS_TABLE) -> sa.Table:
    """The SQLAlchemy table of receipts called ``name`` (one object per name and process).

    Columns: ``key`` (primary key: the prefixed idempotency key), ``token`` and ``task_id`` of
    the attempt that wrote it, ``content_type`` and ``data`` (the result, encoded with the app's
    result serializer), ``created`` and ``expires`` (epoch seconds, database clock).
    """
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"receipts table name must be a plain SQL identifier, got {name!r}")
    with _tables_lock:
        table = _tables.get(name)
        if table is None:
            # The records table's column types (binary collation on MySQL, LONGBLOB results).
            table = sa.Table(
                name,
                new_metadata(),
                sa.Column("key", text_type(255), primary_key=True),
                sa.Column("token", sa.BigInteger, nullable=False),
                sa.Column("task_id", text_type(255), nullable=False),
                sa.Column("content_type", text_type(255), nullable=True),
                sa.Column("data", data_type(), nullable=True),
                sa.Column("created", sa.Double, nullable=False),
                # After this (database clock) the receipt counts as absent, like a record
                # after idempotency_ttl: the action may run again.
                sa.Column("expires", sa.Double, nullable=False, index=True),
            )
            _tables[name] = table
        return table


def _ensure_table(conn: Connection, table: sa.Table) -> None:
    engine = conn.engine
    names = _ready.setdefault(engine, set())
    if table.name in names:
        return
    if conn.dialect.name == "sqlite":
        # SQLite DDL is transactional, and a second connection could not write while this one
        # holds the write lock (or would see another in-memory database): create it in place.
        if not conn.dialect.has_table(conn, table.name):
            # In the caller's transaction, which may still roll back and take the table with
            # it: not remembered as ready; the next use checks again (a local PRAGMA).
            table.create(conn)
            return
    else:
        # MySQL commits the open transaction on any DDL, and a CREATE that races another
        # process's would abort a PostgreSQL transaction: use a connection of its own.
        try:
            table.metadata.create_all(engine, checkfirst=True)
        except sa_exc.DBAPIError:
            if not sa.inspect(engine).has_table(table.name):
                raise  # not the race with another worker's CREATE: a real error
        add_missing_columns(engine, table)  # MySQL/MariaDB: the byte-for-byte collation
    names.add(table.name)


def receipt_sql(conn: Connection, table: str) -> ReceiptSQL:
    """The receipt statements of ``table`` on ``conn``'s database."""
    dialect = conn.dialect
    return ReceiptSQL("mysql" if dialect.name == "mariadb" else dialect.name,
                      dialect.identifier_preparer.quote, str(db_now().compile(dialect=dialect)), table,
                      "?" if dialect.paramstyle == "qmark" else "%s")


class ReceiptTransaction(ReceiptFlow):
    """The receipt of ``task.idempotent_transaction(session_or_connection)``: one receipt, one commit.

    Build it through :meth:`celery_idem.IdempotentTask.idempotent_transaction`, which supplies the
    key, token and codec of the running attempt (the other arguments: :class:`ReceiptFlow`).

    Args:
        target: A SQLAlchemy ``Session`` or ``Connection`` to the business database.
        commit: True: the block ends with a commit (and an error in it rolls back). False: the
            receipt joins a transaction the caller commits (``with session.begin():``), and
            ``rolled_back`` stays False.
    """

    def __init__(self, target: Session | Connection, *, table: str = DEFAULT_RECEIPTS_TABLE,
                 commit: bool = True, **attempt: Any) -> None:
        if not isinstance(target, (Session, Connection)):
            hint = " (open one: `with engine.connect() as conn:`)" if isinstance(target, Engine) else ""
            raise TypeError(
                f"idempotent_transaction needs a SQLAlchemy Session or Connection, got "
                f"{type(target).__module__}.{type(target).__qualname__}{hint}"
            )
        super().__init__(table=receipts_table(table), **attempt)
        self.target = target
        self.commit = commit

    def _connection(self) -> Connection:
        # Session.connection() begins (or joins) the session's transaction on its bind.
        return self.target.connection() if isinstance(self.target, Session) else self.target

    def _vendor(self) -> str:
        return self._connection().dialect.name

    def _end(self, error: BaseException | None) -> None:
        if not self.commit:
            return  # the caller's transaction: the caller commits or rolls back
        if error is None:
            self.target.commit()
        else:
            self.target.rollback()
            self.rolled_back = True

    def _acquire(self) -> Receipt | None:
        _ensure_table(self._connection(), self.table)
        return super()._acquire()

    def _sql(self) -> ReceiptSQL:
        return receipt_sql(self._connection(), self.table.name)

    def _run(self, sql: str, params: Sequence[Any]) -> tuple[int, list[Sequence[Any]]]:
        result = self._connection().exec_driver_sql(sql, tuple(params))
        return result.rowcount, list(result.all()) if result.returns_rows else []


def open_receipt(target: Session | Connection, *, commit: bool, using: str,
                 **attempt: Any) -> ReceiptTransaction:
    """The ``celery_idem.receipts`` entry ``sqlalchemy``: the receipt of one attempt on
    ``target`` (``using`` is Django's and does not apply)."""
    return ReceiptTransaction(target, commit=commit, **attempt)


def purge_receipts(bind: Engine | Connection, *, table: str = DEFAULT_RECEIPTS_TABLE,
                   limit: int = 1000) -> int:
    """Delete up to ``limit`` expired receipts (database clock); return how many went.

    Receipts live ``idempotency_ttl`` seconds, like records; an expired one already counts as
    absent, so this only reclaims space. Run it from a periodic task or cron. Given a
    ``Connection``, the caller commits.
    """
    if isinstance(bind, Engine):
        with bind.begin() as conn:
            return purge_receipts(conn, table=table, limit=limit)
    t = receipts_table(table)
    if not sa.inspect(bind).has_table(t.name):
        return 0
    sql = receipt_sql(bind, t.name)
    now = float(bind.exec_driver_sql(sql.clock).scalar_one())
    return int(bind.exec_driver_sql(sql.purge, (now, int(limit), now)).rowcount or 0)
