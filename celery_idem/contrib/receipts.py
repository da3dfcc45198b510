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

import logging
import threading
import weakref
from collections.abc import Callable
from types import TracebackType
from typing import Any, Final

import sqlalchemy as sa
from sqlalchemy import exc as sa_exc
from sqlalchemy.dialects import postgresql as pg
from sqlalchemy.dialects import sqlite
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.orm import Session

from ..codec import Codec
from ..exceptions import LeaseLost
from ..records import Receipt
from ..stores.sql import data_type, db_now, new_metadata, text_type
from ..stores.sql.schema import add_missing_columns

__all__ = ["DEFAULT_RECEIPTS_TABLE", "Receipt", "ReceiptTransaction", "open_receipt", "purge_receipts",
           "receipts_table"]

logger = logging.getLogger("celery_idem")

#: The receipts table unless ``app.conf.idempotency_receipts_table`` or ``table=`` says otherwise.
DEFAULT_RECEIPTS_TABLE: Final = "celery_idem_receipts"

_DIALECTS: Final = ("postgresql", "mysql", "mariadb", "sqlite")

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


def _insert_or_nothing(dialect: str, table: sa.Table) -> Any:
    """An INSERT that does nothing when the key exists, after waiting for a concurrent insert.

    Every dialect waits for an uncommitted insert of the same key (the second holder blocks on
    the first one's row), so a savepoint and its driver-specific traps are never needed.
    """
    if dialect == "postgresql":
        return pg.insert(table).on_conflict_do_nothing(index_elements=["key"])
    if dialect == "sqlite":
        return sqlite.insert(table).on_conflict_do_nothing(index_elements=["key"])
    return sa.insert(table).prefix_with("IGNORE")  # MySQL / MariaDB


class ReceiptTransaction:
    """The context manager behind ``task.idempotent_transaction(...)``: one receipt, one commit.

    Build it through :meth:`celery_idem.IdempotentTask.idempotent_transaction`, which supplies the
    key, token and codec of the running attempt.

    Args:
        target: A SQLAlchemy ``Session`` or ``Connection`` to the business database.
        key: The stored key (prefix + idempotency key).
        token: The attempt's fencing token.
        task_id: The attempt's task id.
        codec: Encodes ``result`` for the receipt and decodes a found one.
        ttl: Seconds the receipt counts (the task's ``idempotency_ttl``).
        table: The receipts table name.
        commit: True: the block ends with a commit (and an error in it rolls back). False: the
            receipt joins a transaction the caller commits (``with session.begin():``).
        lease_lost: Returns True once another attempt took the claim over.
        on_found: Turns a found receipt into the signal the task layer catches.

    Attributes:
        result: The value to keep in the receipt (set it inside the block); a later attempt that
            finds the receipt returns it as the task's result.
        held: True once this attempt inserted the receipt.
        rolled_back: True once the block's transaction was rolled back here (``commit=True``
            only): it left no receipt, so another block of the same run may follow.
    """

    def __init__(
        self,
        target: Session | Connection,
        *,
        key: str,
        token: int,
        task_id: str,
        codec: Codec,
        ttl: float,
        table: str = DEFAULT_RECEIPTS_TABLE,
        commit: bool = True,
        lease_lost: Callable[[], bool] = lambda: False,
        on_found: Callable[[Receipt], BaseException] | None = None,
    ) -> None:
        if not isinstance(target, (Session, Connection)):
            hint = " (open one: `with engine.connect() as conn:`)" if isinstance(target, Engine) else ""
            raise TypeError(
                f"idempotent_transaction needs a SQLAlchemy Session or Connection, got "
                f"{type(target).__module__}.{type(target).__qualname__}{hint}"
            )
        if not key or len(key) > 255:
            # The key column is 255 characters; MySQL's INSERT IGNORE would truncate a longer
            # key silently and make two actions share one receipt.
            raise ValueError(
                f"a receipt key must be 1 to 255 characters (idempotency_key_prefix + key), got "
                f"{len(key)}: {key[:60]!r}..."
            )
        self.target = target
        self.key = key
        self.token = token
        self.task_id = task_id
        self.codec = codec
        self.ttl = float(ttl)
        self.table = receipts_table(table)
        self.commit = commit
        self.lease_lost = lease_lost
        self.on_found = on_found
        self.result: Any = None
        self.held = False
        self.rolled_back = False
        self._entered = False

    # -- the transaction's ends -----------------------------------------------------------------

    def _connection(self) -> Connection:
        # Session.connection() begins (or joins) the session's transaction on its bind.
        return self.target.connection() if isinstance(self.target, Session) else self.target

    def _rollback(self) -> None:
        self.target.rollback()
        self.rolled_back = True

    # -- enter: the receipt first ---------------------------------------------------------------

    def __enter__(self) -> ReceiptTransaction:
        if self._entered:
            raise RuntimeError("an idempotent_transaction can be entered once; make a new one")
        self._entered = True
        conn = self._connection()
        dialect = conn.dialect.name
        if dialect not in _DIALECTS:
            raise TypeError(
                f"idempotent_transaction supports PostgreSQL, MySQL/MariaDB and SQLite; this "
                f"connection is {dialect!r}"
            )
        try:
            found = self._acquire(conn, dialect)
        except BaseException:
            if self.commit:
                self._rollback()
            raise
        if found is None:
            self.held = True
            return self
        if self.commit:
            self._rollback()  # nothing was written; leave the session/connection clean
        logger.info(
            "celery_idem receipt key=%s found (task %s, token %s): the transaction committed "
            "earlier; returning its result without running the block",
            self.key, found.task_id, found.token,
        )
        if self.on_found is None:
            raise RuntimeError(f"the receipt of {self.key!r} exists: {found!r}")
        raise self.on_found(found)

    def _acquire(self, conn: Connection, dialect: str) -> Receipt | None:
        """Insert (or take over an expired) receipt; return the live one found instead."""
        t = self.table
        _ensure_table(conn, t)
        values = {"key": self.key, "token": self.token, "task_id": self.task_id,
                  "content_type": None, "data": None, "created": db_now(),
                  "expires": db_now() + self.ttl}
        for _ in range(3):
            if self._inserted(conn, dialect, values):
                return None
            # A locking read sees the latest committed row whatever the isolation level (a
            # plain SELECT under MySQL's REPEATABLE READ could read an older snapshot). A shared
            # lock, not FOR UPDATE: MySQL's INSERT IGNORE already took one on the duplicate, and
            # two readers upgrading to exclusive would deadlock each other.
            row = conn.execute(
                sa.select(t, db_now().label("now")).where(t.c.key == self.key)
                .with_for_update(read=True)
            ).mappings().first()
            if row is None:
                continue  # purged between the two statements: insert again
            if row["expires"] <= row["now"]:
                # Expired like its record: the action may run again, as on a fresh key.
                conn.execute(sa.update(t).where(t.c.key == self.key).values(**values))
                return None
            if row["content_type"] is None:
                value = None  # committed by a caller who kept a failed block's writes
            else:
                value = self.codec.decode_result(self.key, row["content_type"], row["data"] or b"")
            return Receipt(self.key, int(row["token"]), str(row["task_id"]), value)
        raise RuntimeError(f"the receipt of {self.key!r} keeps disappearing (purged in a loop?)")

    def _inserted(self, conn: Connection, dialect: str, values: dict[str, Any]) -> bool:
        stmt = _insert_or_nothing(dialect, self.table).values(**values)
        if dialect in ("postgresql", "sqlite"):
            # RETURNING, not rowcount: psycopg reports -1 for an INSERT ... ON CONFLICT.
            return conn.execute(stmt.returning(self.table.c.key)).first() is not None
        return conn.execute(stmt).rowcount == 1  # INSERT IGNORE: 0 when the key exists

    # -- exit: the result, then one commit --------------------------------------------------------

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is not None:
            if self.commit:
                self._rollback()
            return  # the block's error propagates; with commit=False the caller rolls back
        try:
            self._finish()
        except BaseException:
            if self.commit:
                self._rollback()
            raise

    def _finish(self) -> None:
        try:
            ctype, data = self.codec.encode_result(self.result)
        except Exception as exc:
            raise TypeError(
                f"idempotent_transaction: tx.result of {self.key!r} cannot be encoded with the "
                f"app's result serializer: {exc}; the transaction was rolled back"
            ) from exc
        if self.lease_lost():
            # A takeover is already waiting on our receipt row: let it do the write, as the
            # fencing token says, instead of committing from a holder the store disowned.
            raise LeaseLost(
                f"the claim of {self.key!r} (token {self.token}) was taken over before the "
                f"commit; the transaction was rolled back",
                key=self.key, token=self.token,
            )
        t = self.table
        conn = self._connection()
        conn.execute(
            sa.update(t)
            .where(t.c.key == self.key, t.c.token == self.token)
            .values(content_type=ctype, data=data)
        )
        if self.commit:
            self.target.commit()


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
    # The clock is read first and bound as a value, so PostgreSQL can use the expires index
    # (as SQLStore.purge_expired does).
    now = float(bind.execute(sa.select(db_now())).scalar_one())
    expired = t.c.expires <= sa.literal(now, sa.Double)
    # A bounded batch; the keys come through a derived table because MySQL refuses a LIMIT
    # directly inside IN (...).
    doomed = sa.select(t.c.key).where(expired).limit(limit).subquery()
    # The outer condition is checked again on the row being deleted: a takeover may have
    # renewed the receipt (committed while this DELETE waited for its row lock) after the
    # subquery read it as expired; deleting it would let the new action run twice.
    delete = sa.delete(t).where(t.c.key.in_(sa.select(doomed.c.key)), expired)
    return int(bind.execute(delete).rowcount or 0)
