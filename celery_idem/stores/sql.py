"""SQL store (``db+postgresql://``, ``db+mysql://``, ``db+sqlite://``): SQLAlchemy Core.

One table (``celery_idem_records`` by default) holds one row per stored key (``prefix + key``).
The verbs are the contract of :mod:`celery_idem.stores.base`, with the semantics of
:class:`~celery_idem.stores.memory.MemoryStore`, translated into conditional SQL:

* every lease and expiry computation uses the *database's* clock inside the statement that
  needs it (:class:`db_now`), so workers with skewed clocks agree on who holds a key;
* a row whose ``expires`` has passed counts as absent everywhere, but it keeps its token until
  :meth:`SQLStore.purge_expired` deletes it, so a claim on it still gets a higher token;
* a taking claim's token is ``max(previous + 1, database clock in µs)`` (:func:`token_for`,
  the scheme of :func:`celery_idem.stores.base.next_token`), so even a claim on a deleted or
  purged row gets a token above the lost one; each taking claim also stores a random
  ``claim_id``, which ``record``, ``release`` and ``renew`` check with the token;
* engines run in autocommit: each verb is one self-contained statement, except where a dialect
  cannot say what it needs in one (see :meth:`SQLStore.claim` and :meth:`SQLStore.renew`).

Statements per verb (each is one round trip; the engine runs without pre-ping)::

    verb      PostgreSQL              SQLite                         MySQL / MariaDB
    claim     1 (CTE upsert)          BEGIN IMMEDIATE + 1..2 + COMMIT 1 (not taken) / 2 (taken)
    record    1                       1                              1
    release   1                       1                              1
    renew     1 (RETURNING)           1 (RETURNING)                  2 (UPDATE, SELECT)
    get       1                       1                              1

A claim that loses a race against a concurrent first claim of the same key runs once more
(nothing was written the first time); a fenced verb that is refused reads the row once more to
say why. Neither is on the hot path.

PostgreSQL through psycopg 3 (the default driver when psycopg2 is not installed) takes a fast
path: each verb's statement is built and compiled once, then run on the pooled psycopg
connection itself as a server-side prepared statement with plain tuples, skipping SQLAlchemy's
per-call compile-cache lookup, parameter processing and result objects (they cost more client
CPU than the round trip). The statement's constants are written into its SQL and its
placeholders numbered (``$1``) once, so each call sends only its own values, as they are
(see :class:`_RawStatement`). Same statements, same single round trip, same exceptions. Every
other driver and dialect runs the same pre-built statements through a SQLAlchemy
``Connection``.

A PostgreSQL claim that finds the key DONE, FAILED or MISMATCH (a duplicate) locks nothing
and writes nothing, so it costs no WAL flush at commit (see :meth:`SQLStore._claim_postgresql`).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import re
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, TypeAlias

import sqlalchemy as sa
from sqlalchemy import exc as sa_exc
from sqlalchemy.dialects import mysql
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.engine import URL, Connection, Engine, make_url
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.elements import ColumnElement
from sqlalchemy.sql.functions import FunctionElement
from sqlalchemy.sql.selectable import FromClause

from ..exceptions import CorruptRecord, ImproperlyConfigured, LeaseLost, StoreUnavailable
from ..records import Claim, ClaimStatus, Record, State
from .base import TOKEN_CLOCK_SCALE, Store, new_claim_id, next_token

__all__ = ["DEFAULT_TABLE_NAME", "SQLStore", "db_now"]

#: The table the store uses unless ``table_name`` says otherwise.
DEFAULT_TABLE_NAME: Final = "celery_idem_records"

# A claim that raced a concurrent first claim of the same key wrote nothing and is run again;
# the second run sees the winner's committed row. More than a few runs means something else
# keeps deleting and re-inserting the row, which we report instead of spinning.
_CLAIM_RUNS: Final = 3

_HOLDS: Final = (ClaimStatus.CLAIMED.value, ClaimStatus.TAKEOVER.value)
# The PostgreSQL claim decides on the row it locked only when an unlocked look at it may lead
# to a write or may be about to change (see SQLStore._claim_postgresql); DONE, FAILED and
# MISMATCH are answered from the unlocked look.
_LOCKED: Final = (*_HOLDS, ClaimStatus.BUSY.value)

# URL backend -> (DBAPI module SQLAlchemy uses when the URL names no driver, fallback driver).
# A project that installed the fallback (psycopg 3, PyMySQL) but not the default driver gets a
# working store from a plain ``db+postgresql://`` or ``db+mysql://`` URL.
_DRIVER_FALLBACKS: Final = {
    "postgresql": ("psycopg2", "psycopg"),
    "mysql": ("MySQLdb", "pymysql"),
    "mariadb": ("mariadb", "pymysql"),
}
_BACKENDS: Final = ("postgresql", "mysql", "mariadb", "sqlite")


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


class _greatest(FunctionElement[int]):
    """The larger of two BIGINTs: ``GREATEST`` (PostgreSQL, MySQL), ``MAX`` (SQLite)."""

    type = sa.BigInteger()
    inherit_cache = True
    name = "greatest"


@compiles(_greatest)
def _greatest_default(element: _greatest, compiler: SQLCompiler, **kw: Any) -> str:
    return f"GREATEST({compiler.process(element.clauses, **kw)})"


@compiles(_greatest, "sqlite")
def _greatest_sqlite(element: _greatest, compiler: SQLCompiler, **kw: Any) -> str:
    return f"max({compiler.process(element.clauses, **kw)})"


def token_for(previous: ColumnElement[Any], now: ColumnElement[float]) -> ColumnElement[int]:
    """A taking claim's token in SQL: ``max(previous + 1, now in µs)``, ``previous`` NULL = 0.

    The SQL twin of :func:`celery_idem.stores.base.next_token`, on the database clock ``now``.
    The cast rounds (PostgreSQL, MySQL) or truncates (SQLite): either is a clock reading.
    """
    micros = sa.cast(now * TOKEN_CLOCK_SCALE, sa.BigInteger)
    return _greatest(sa.func.coalesce(previous, 0) + 1, micros)


def _text(length: int) -> sa.types.TypeEngine[str]:
    # MySQL's default collations are case- and accent-insensitive: "Refund:ab" and "refund:ab"
    # would be one primary key. The binary collation compares like every other store.
    # (It still ignores trailing spaces, MySQL's PAD SPACE rule; celery_idem's keys,
    # ``operation:hash``, never end in one.)
    return sa.String(length).with_variant(
        mysql.VARCHAR(length, charset="utf8mb4", collation="utf8mb4_bin"), "mysql", "mariadb"
    )


def _build_table(name: str) -> sa.Table:
    metadata = sa.MetaData(naming_convention={"ix": "ix_%(table_name)s_%(column_0_name)s"})
    return sa.Table(
        name,
        metadata,
        sa.Column("key", _text(255), primary_key=True),
        sa.Column("state", _text(16), nullable=False, index=True),
        sa.Column("token", sa.BigInteger, nullable=False),
        sa.Column("owner", _text(255), nullable=False),
        sa.Column("task_id", _text(255), nullable=False),
        sa.Column("attempt", sa.Integer, nullable=False),
        sa.Column("lease_expires", sa.Double, nullable=True),
        sa.Column("payload_hash", _text(255), nullable=True),
        sa.Column("content_type", _text(255), nullable=True),
        # BLOB on MySQL stops at 64 KiB; results can be larger.
        sa.Column(
            "data",
            sa.LargeBinary().with_variant(mysql.LONGBLOB(), "mysql", "mariadb"),
            nullable=True,
        ),
        sa.Column("updated", sa.Double, nullable=False),
        # The TTL: after this (database clock) the row counts as absent.
        sa.Column("expires", sa.Double, nullable=False, index=True),
        # The random id of the claim that wrote the row (see Record.claim_id); NULL in a released
        # tombstone and in rows of versions before claim ids (added to such a table on first use).
        sa.Column("claim_id", _text(64), nullable=True),
    )


@dataclass(frozen=True)
class _ClaimPredicates:
    """The named conditions ``claim`` decides on, over one candidate row and one clock value.

    The row may be missing (an outer join gives NULL columns). ``status`` combines them in the
    order of :meth:`Store.claim`; it is the single definition every dialect's claim uses.
    """

    is_absent_or_expired: ColumnElement[bool]
    is_released: ColumnElement[bool]
    is_payload_mismatch: ColumnElement[bool]
    is_done: ColumnElement[bool]
    is_failed: ColumnElement[bool]
    is_in_progress: ColumnElement[bool]
    lease_expired: ColumnElement[bool]
    is_earlier_attempt_of_same_task: ColumnElement[bool]

    @classmethod
    def over(
        cls,
        row: FromClause,
        now: ColumnElement[float],
        *,
        task_id: str,
        attempt: int,
        payload_hash: str | None,
    ) -> _ClaimPredicates:
        c = row.c
        return cls(
            is_absent_or_expired=sa.or_(c.key.is_(None), c.expires <= now),
            is_released=c.state == State.RELEASED.value,
            # Like the memory store: an empty hash on either side means "not validated".
            is_payload_mismatch=(
                sa.and_(
                    c.payload_hash.is_not(None),
                    c.payload_hash != "",
                    c.payload_hash != payload_hash,
                )
                if isinstance(payload_hash, sa.BindParameter) or payload_hash
                else sa.false()
            ),
            is_done=c.state == State.DONE.value,
            is_failed=c.state == State.FAILED.value,
            is_in_progress=c.state == State.IN_PROGRESS.value,
            lease_expired=sa.and_(c.lease_expires.is_not(None), c.lease_expires <= now),
            is_earlier_attempt_of_same_task=sa.and_(c.task_id == task_id, c.attempt < attempt),
        )

    def status(self) -> ColumnElement[str | None]:
        """A CASE giving the :class:`ClaimStatus` value, or NULL for a state we do not know."""
        return sa.case(
            (sa.or_(self.is_absent_or_expired, self.is_released), ClaimStatus.CLAIMED.value),
            (self.is_payload_mismatch, ClaimStatus.MISMATCH.value),
            (self.is_done, ClaimStatus.DONE.value),
            (self.is_failed, ClaimStatus.FAILED.value),
            (
                sa.and_(
                    self.is_in_progress,
                    sa.or_(self.lease_expired, self.is_earlier_attempt_of_same_task),
                ),
                ClaimStatus.TAKEOVER.value,
            ),
            (self.is_in_progress, ClaimStatus.BUSY.value),
            else_=sa.null(),
        )


@dataclass(frozen=True)
class _ClaimArgs:
    """One claim's arguments, and the two SQL fragments every dialect builds from them."""

    stored_key: str
    owner: str
    task_id: str
    attempt: int
    lease: float
    ttl: float
    payload_hash: str | None
    claim_id: str

    def predicates(self, row: FromClause, now: ColumnElement[float]) -> _ClaimPredicates:
        return _ClaimPredicates.over(
            row, now, task_id=self.task_id, attempt=self.attempt, payload_hash=self.payload_hash
        )

    def values(self, *, now: ColumnElement[float], token: Any) -> dict[str, Any]:
        """The IN_PROGRESS row a taking claim writes, in column order."""
        return {
            "key": _lit(self.stored_key, sa.String),
            "state": sa.literal(State.IN_PROGRESS.value, sa.String),
            "token": token,
            "owner": _lit(self.owner, sa.String),
            "task_id": _lit(self.task_id, sa.String),
            "attempt": _lit(self.attempt, sa.Integer),
            "lease_expires": now + self.lease,
            "payload_hash": _lit(self.payload_hash, sa.String),
            "content_type": sa.null(),
            "data": sa.null(),
            "updated": now,
            "expires": now + self.ttl,
            "claim_id": _lit(self.claim_id, sa.String),
        }


def _lit(value: Any, type_: Any) -> Any:
    """A SQL literal for a plain value; a bind parameter (a cached statement's slot) as it is."""
    return value if isinstance(value, sa.BindParameter) else sa.literal(value, type_)


def _claim_template(validate: bool) -> _ClaimArgs:
    """Claim arguments as named bind parameters, to build a claim statement once and reuse it.

    Building the PostgreSQL claim (CTEs, predicates, upsert) costs about a millisecond of
    client CPU; reusing the built statement leaves only binding the values to each call.
    """
    return _ClaimArgs(
        stored_key=sa.bindparam("idem_key", type_=sa.String),  # type: ignore[arg-type]
        owner=sa.bindparam("idem_owner", type_=sa.String),  # type: ignore[arg-type]
        task_id=sa.bindparam("idem_task_id", type_=sa.String),  # type: ignore[arg-type]
        attempt=sa.bindparam("idem_attempt", type_=sa.Integer),  # type: ignore[arg-type]
        lease=sa.bindparam("idem_lease", type_=sa.Double),  # type: ignore[arg-type]
        ttl=sa.bindparam("idem_ttl", type_=sa.Double),  # type: ignore[arg-type]
        # Validation changes the predicates' shape (a constant false without a hash).
        payload_hash=sa.bindparam("idem_payload_hash", type_=sa.String) if validate else None,  # type: ignore[arg-type]
        claim_id=sa.bindparam("idem_claim_id", type_=sa.String),  # type: ignore[arg-type]
    )


def _claim_params(args: _ClaimArgs) -> dict[str, Any]:
    return {
        "idem_key": args.stored_key, "idem_owner": args.owner, "idem_task_id": args.task_id,
        "idem_attempt": args.attempt, "idem_lease": args.lease, "idem_ttl": args.ttl,
        "idem_payload_hash": args.payload_hash, "idem_claim_id": args.claim_id,
    }


class _ClaimRaced(Exception):
    """The row a claim decided on changed before the claim's write, which wrote nothing.

    Typically two first claims of an absent key: the loser's INSERT meets the winner's row.
    """


# A row by column name (a SQLAlchemy RowMapping, or a dict on the fast path).
_Row: TypeAlias = Mapping[Any, Any]
# What a statement run through a session gives back: the row count, and the first row when the
# statement returns rows.
_Outcome: TypeAlias = "tuple[int, _Row | None]"
# The verbs' statements.
_Statement: TypeAlias = "sa.Select[Any] | sa.Update"


class _SASession:
    """Runs the store's statements through a SQLAlchemy ``Connection`` (every dialect)."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def execute(self, statement: _Statement, params: Mapping[str, Any]) -> _Outcome:
        result = self.conn.execute(statement, params)
        if not result.returns_rows:
            return result.rowcount, None
        return result.rowcount, result.mappings().first()


# The fast path's cursor, kept in each pooled connection's SQLAlchemy info dict, and the largest
# result it may hold on to between verbs (see _RawSession._kept_cursor).
_KEPT_CURSOR: Final = "celery_idem.cursor"
_KEPT_RESULT_BYTES: Final = 64 * 1024

_PLACEHOLDER: Final = re.compile(r"%\((?P<name>[^)]+)\)s|%%")


@dataclass(frozen=True)
class _RawStatement:
    """One statement compiled once for the psycopg fast path.

    The values SQLAlchemy bound for literals (``'done'``, 1, ``NULL``) are written into the SQL
    text: they never change, and psycopg would otherwise adapt and send each of them on every
    call (the claim has 35). Only the ``idem_*`` values remain parameters.

    Attributes:
        sql: The DBAPI SQL text (``%(name)s`` placeholders, with SQLAlchemy's type casts).
        constants: The values of the literals that could not be written into the SQL (none in
            the store's statements); each call adds its own ``idem_*`` values.
        columns: The result columns' names, in order; empty when no rows come back.
        processors: SQLAlchemy's bind processors for the ``idem_*`` values (the dialect's
            ``bytes`` -> ``psycopg.Binary``), applied per call as SQLAlchemy would.
        numbered: The same SQL with PostgreSQL's own ``$1 .. $n`` placeholders, for psycopg's
            ``RawCursor``: psycopg then sends it as it is. Its ``%(name)s`` parser only
            caches statements up to 4 KiB and 50 parameters, and the claim is longer, so with
            ``%(name)s`` it would parse the claim's SQL again on every call.
        order: The parameter names of ``$1 .. $n``.
    """

    sql: str
    constants: Mapping[str, Any]
    columns: tuple[str, ...]
    processors: Mapping[str, Callable[[Any], Any]]
    numbered: bytes
    order: tuple[str, ...]

    def values(self, params: Mapping[str, Any]) -> dict[str, Any]:
        values = {**self.constants, **params}
        for name, process in self.processors.items():
            values[name] = process(values[name])
        return values

    def positional(self, params: Mapping[str, Any]) -> list[Any]:
        """The values of ``$1 .. $n``, from a call's ``idem_*`` values."""
        if self.constants or self.processors:
            params = self.values(params)
        return [params[name] for name in self.order]

    @classmethod
    def compile(cls, statement: _Statement, dialect: Any) -> _RawStatement:
        compiled = statement.compile(dialect=dialect)
        # An expanding IN renders its values at execution time, which the fast path does not
        # do: a statement needing it is a bug in the store, caught the first time it runs.
        if "POSTCOMPILE" in compiled.string:
            raise RuntimeError(f"celery_idem: statement unfit for the raw path:\n{compiled.string}")
        processors: dict[str, Callable[[Any], Any]] = dict(getattr(compiled, "_bind_processors", {}))
        constants = {
            k: processors.pop(k)(v) if k in processors else v
            for k, v in compiled.params.items()
            if not k.startswith("idem_")
        }
        literals: dict[str, str] = {}
        for k, v in constants.items():
            literal = _sql_literal(compiled, k, v)
            if literal is not None:
                literals[k] = literal
        sql = _PLACEHOLDER.sub(lambda m: literals.get(m["name"] or "", m[0]), compiled.string)
        constants = {k: v for k, v in constants.items() if k not in literals}
        order: dict[str, str] = {}

        def number(m: re.Match[str]) -> str:
            if not m["name"]:
                return "%"  # SQLAlchemy's escape of a literal %
            return order.setdefault(m["name"], f"${len(order) + 1}")

        numbered = _PLACEHOLDER.sub(number, sql)
        returns_rows = isinstance(statement, sa.Select) or bool(compiled.returning)
        # keys(), not iteration: a ColumnCollection iterates over its columns, not their names.
        names = statement.exported_columns.keys()
        columns = tuple(str(name) for name in names) if returns_rows else ()
        return cls(sql, constants, columns, processors, numbered.encode(), tuple(order))


def _sql_literal(compiled: Any, name: str, value: Any) -> str | None:
    """``value`` as SQLAlchemy writes it with ``literal_binds``, or None where it cannot.

    Only plain values: anything else stays a parameter, adapted by psycopg as before.
    """
    if value is None:
        return "NULL"
    if type(value) not in (str, int):
        return None
    try:
        literal = compiled.render_literal_value(value, compiled.binds[name].type)
    except (sa_exc.CompileError, NotImplementedError):
        return None
    return str(literal)


class _RawSession:
    """Runs the store's statements on a pooled psycopg 3 connection itself (PostgreSQL).

    Errors come out as SQLAlchemy would raise them (a driver error wrapped in its
    :class:`sqlalchemy.exc.DBAPIError` subclass, the connection invalidated on a disconnect), so
    :meth:`SQLStore._translate_errors` maps them exactly as on the SQLAlchemy path.
    """

    def __init__(self, store: SQLStore, fairy: Any) -> None:
        self._store = store
        self._fairy = fairy
        driver = fairy.driver_connection
        self._driver = driver
        # prepare_threshold=None is how psycopg is told not to prepare (PgBouncer in
        # transaction mode before 1.21): respect it; otherwise prepare at the first run.
        self._prepare = driver.prepare_threshold is not None
        # psycopg's RawCursor (3.2+) for the numbered SQL, unless the engine's connect_args
        # chose another cursor class, which is then used as before with %(name)s.
        cursor_class, self._raw_cursor, self._tuple_row = _psycopg()
        if driver.cursor_factory is not cursor_class:
            self._raw_cursor = None
        self._info: dict[Any, Any] = fairy.info

    def _kept_cursor(self) -> Any:
        """The RawCursor kept with this pooled connection, made on first use.

        Reused by every verb: making a cursor sets up psycopg's adapters for it, about 10 µs
        of client CPU per verb. The pool lends a connection to one thread at a time, so its
        cursor is never shared. It lives in the connection's SQLAlchemy ``info``, which the
        pool clears when it closes or replaces the connection; the identity check is a second
        guard against a cursor of a previous connection.
        """
        assert self._raw_cursor is not None
        cursor = self._info.get(_KEPT_CURSOR)
        if cursor is None or cursor.connection is not self._driver or cursor.closed:
            cursor = self._info[_KEPT_CURSOR] = self._raw_cursor(self._driver, row_factory=self._tuple_row)
        return cursor

    def execute(self, statement: _Statement, params: Mapping[str, Any]) -> _Outcome:
        raw = self._store._raw_statement(statement)
        query: bytes | str
        values: Sequence[Any] | Mapping[str, Any]
        keep = self._raw_cursor is not None
        if keep:
            cursor = self._kept_cursor()
            query, values = raw.numbered, raw.positional(params)
        else:
            cursor = self._driver.cursor(row_factory=self._tuple_row)
            query, values = raw.sql, raw.values(params)
        try:
            cursor.execute(query, values, prepare=self._prepare)
            if not raw.columns:
                return cursor.rowcount, None
            row = cursor.fetchone()
            if row is None:
                return cursor.rowcount, None
            out = dict(zip(raw.columns, row, strict=True))
            data = out.get("data")
            # A kept cursor holds its last result until the next verb: not a large one.
            keep = keep and (data is None or len(data) <= _KEPT_RESULT_BYTES)
            return cursor.rowcount, out
        except self._store._engine.dialect.loaded_dbapi.Error as exc:
            keep = False  # the next verb starts on a fresh cursor (errors are rare)
            dialect = self._store._engine.dialect
            disconnect = dialect.is_disconnect(exc, self._fairy.dbapi_connection, cursor)
            if disconnect:
                # Like SQLAlchemy: drop this connection, and every pooled connection older
                # than now on its next checkout (a server restart killed them all).
                self._store._engine.pool._invalidate(self._fairy, exc)
            raise sa_exc.DBAPIError.instance(
                raw.sql, raw.values(params), exc, dialect.loaded_dbapi.Error,
                hide_parameters=self._store._engine.hide_parameters,
                connection_invalidated=disconnect, dialect=dialect,
            ) from exc
        except BaseException:
            # Interrupted mid-protocol (a soft time limit, KeyboardInterrupt): the connection's
            # state is unknown, so it must not go back to the pool.
            keep = False
            self._fairy.invalidate()
            raise
        finally:
            if not keep:
                cursor.close()
                if self._info.get(_KEPT_CURSOR) is cursor:
                    del self._info[_KEPT_CURSOR]


@functools.cache
def _psycopg() -> tuple[type[Any], type[Any] | None, Any]:
    """psycopg's default cursor class, its RawCursor (None before psycopg 3.2) and tuple_row.

    Imported on first use: psycopg is only needed when it is the driver. The row factory is
    explicit, so an engine built with connect_args={"row_factory": dict_row} cannot change
    what the fast path reads.
    """
    import psycopg
    from psycopg.rows import tuple_row

    return psycopg.Cursor, getattr(psycopg, "RawCursor", None), tuple_row


@dataclass(frozen=True)
class _VerbStatements:
    """The fenced writes' and the read's statements, built once per table.

    Each call's values are ``idem_*`` bind parameters; the key and token ones take the type of
    the column they are compared with, as the literal values they replace did.
    """

    record: sa.Update
    release: sa.Update
    renew: sa.Update
    renew_returning: sa.Update  # renew handing back the new lease, where UPDATE can RETURNING
    renew_read: sa.Select[Any]  # where it cannot: the new lease read back, still fenced
    get: sa.Select[Any]

    @classmethod
    def build(cls, t: sa.Table) -> _VerbStatements:
        key: sa.BindParameter[str] = sa.bindparam("idem_key")
        claim_id: sa.BindParameter[str] = sa.bindparam("idem_claim_id", type_=t.c.claim_id.type)
        # Only the holder's live IN_PROGRESS row: the fence of record, release and renew. The
        # claim id names the claim beside the token ('' = a caller that checks the token alone).
        fenced = sa.and_(
            t.c.key == key,
            t.c.token == sa.bindparam("idem_token"),
            sa.or_(claim_id == "", t.c.claim_id == claim_id),
            t.c.state == State.IN_PROGRESS.value,
            t.c.expires > db_now(),
        )
        lease = sa.bindparam("idem_lease", type_=sa.Double)
        # The record must outlive the lease too: a body running past the TTL keeps its record
        # (and with it the token that fences every earlier holder).
        renew = sa.update(t).where(fenced).values(
            lease_expires=db_now() + lease,
            expires=sa.case((t.c.expires < db_now() + lease, db_now() + lease), else_=t.c.expires),
        )
        return cls(
            record=sa.update(t).where(fenced).values(
                state=sa.bindparam("idem_state"),
                content_type=sa.bindparam("idem_content_type"),
                data=sa.bindparam("idem_data", type_=t.c.data.type),
                lease_expires=None,
                updated=db_now(),
                expires=db_now() + sa.bindparam("idem_ttl", type_=sa.Double),
            ),
            # The RELEASED tombstone keeps the token and the TTL, and nothing of the holder.
            release=sa.update(t).where(fenced).values(
                state=State.RELEASED.value,
                owner="",
                task_id="",
                attempt=0,
                lease_expires=None,
                payload_hash=None,
                content_type=None,
                data=None,
                updated=db_now(),
                claim_id=None,
            ),
            renew=renew,
            renew_returning=renew.returning(t.c.lease_expires),
            renew_read=sa.select(t.c.lease_expires).where(fenced),
            get=sa.select(t).where(t.c.key == key, t.c.expires > db_now()),
        )


# Workers fork after the store is built: a child must never reuse the parent's sockets (two
# processes talking over one connection corrupt both). Engines are held weakly so a closed
# store can be collected; os.register_at_fork hooks cannot be unregistered.
_ENGINES: weakref.WeakSet[Engine] = weakref.WeakSet()


def _forget_inherited_connections() -> None:
    for engine in list(_ENGINES):
        engine.dispose(close=False)  # drop the parent's connections without closing them


os.register_at_fork(after_in_child=_forget_inherited_connections)


def _sqlalchemy_url(url: str) -> URL:
    """``db+<dialect>[+driver]://...`` (or a plain SQLAlchemy URL) -> the URL to connect to."""
    if url[:3].lower() == "db+":
        url = url[3:]  # like Celery's database result backend
    try:
        sa_url = make_url(url)
    except sa_exc.ArgumentError as exc:
        raise ImproperlyConfigured(f"celery_idem cannot parse the SQL store URL: {exc}") from exc
    backend = sa_url.get_backend_name()
    if backend not in _BACKENDS:
        raise ImproperlyConfigured(f"the SQL store supports {', '.join(_BACKENDS)}, not {backend!r}")
    if "+" not in sa_url.drivername and backend in _DRIVER_FALLBACKS:
        default_module, fallback = _DRIVER_FALLBACKS[backend]
        if not _importable(default_module) and _importable(fallback):
            sa_url = sa_url.set(drivername=f"{backend}+{fallback}")
    return sa_url


def _importable(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _build_engine(sa_url: URL, engine_options: Mapping[str, Any]) -> Engine:
    backend = sa_url.get_backend_name()
    options: dict[str, Any] = {
        # No pre-ping: it would double the round trips of every verb. A connection the server
        # closed while the worker idled fails its statement as a disconnect, SQLAlchemy drops
        # it from the pool, and the gate already handles that failure (a claim re-queues the
        # message, a record is retried), so the next attempt gets a fresh connection.
        "pool_pre_ping": False,
        # Recycle before the usual server/proxy idle limits (MySQL wait_timeout, PgBouncer).
        "pool_recycle": 1800,
        # Each verb is one statement (or opens its own transaction explicitly): autocommit
        # spares the BEGIN/COMMIT round trips.
        "isolation_level": "AUTOCOMMIT",
    }
    if backend != "sqlite":
        # In autocommit the ROLLBACK on check-in is pointless and costs PyMySQL a round trip.
        # (Not for SQLite: there the claim's BEGIN IMMEDIATE must be rolled back if it fails.)
        options["skip_autocommit_rollback"] = True
    options.update(engine_options)
    if backend == "sqlite":
        # Several worker processes share the file: wait for the write lock instead of failing
        # with "database is locked" at once.
        options["connect_args"] = {"timeout": 30.0, **engine_options.get("connect_args", {})}
    engine = sa.create_engine(sa_url, **options)
    if backend == "sqlite":
        sa.event.listen(engine, "connect", _sqlite_on_connect)
    elif backend in ("mysql", "mariadb"):
        sa.event.listen(engine, "connect", _mysql_on_connect)
    _ENGINES.add(engine)
    return engine


def _sqlite_on_connect(dbapi_connection: Any, connection_record: Any) -> None:
    # WAL lets readers run while one process writes; it is a property of the file, so setting
    # it on every new connection is cheap once it is on.
    cursor = dbapi_connection.cursor()
    try:
        # Switching the mode needs the file to itself: connections opening a new file at the same
        # moment get "database is locked" at once (the busy timeout does not cover it). Retry
        # for up to 5 s; after that the error is real and surfaces.
        deadline = time.monotonic() + 5.0
        delay = 0.005
        while True:
            try:
                cursor.execute("PRAGMA journal_mode=WAL")
                break
            except Exception as exc:
                if "locked" not in str(exc) or time.monotonic() + delay > deadline:
                    raise
                time.sleep(delay)
                delay = min(delay * 2, 0.1)
    finally:
        cursor.close()


def _mysql_on_connect(dbapi_connection: Any, connection_record: Any) -> None:
    # UNIX_TIMESTAMP(NOW(6)) goes through the session time zone; in a zone with daylight saving
    # time the repeated autumn hour would make the clock jump back an hour. UTC has no fold.
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute("SET time_zone = '+00:00'")
    finally:
        cursor.close()


class SQLStore(Store):
    """The idempotency store in a SQL database, through SQLAlchemy Core.

    Args:
        url: ``db+postgresql[+driver]://...``, ``db+mysql[+driver]://...``,
            ``db+sqlite:///path.db`` (the ``db+`` is optional).
        prefix: Prepended to every key, so several apps can share one table.
        table_name: The table to use; created on first use.
        engine_options: Extra keyword arguments for :func:`sqlalchemy.create_engine`
            (``pool_size``, ``connect_args``, ...); they win over the store's defaults.

    Raises:
        ImproperlyConfigured: The URL names no supported database.
    """

    schemes = ("db+postgresql", "db+sqlite", "db+mysql", "db+mariadb")

    def __init__(
        self,
        url: str,
        *,
        prefix: str = "celery-idem:",
        table_name: str = DEFAULT_TABLE_NAME,
        engine_options: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(prefix)
        self._engine = _build_engine(_sqlalchemy_url(url), engine_options or {})
        self._dialect = self._engine.dialect.name
        self._shown_url = self._engine.url.render_as_string(hide_password=True)
        self._table = _build_table(table_name)
        self._table_ready = False
        self._table_lock = threading.Lock()
        # Every hot-path statement is built once with ``idem_*`` bind parameters: building one
        # costs more client CPU than its round trip (see docs/benchmarks.md). The claim is
        # built once per shape (with/without payload validation), see _claim_template.
        self._pg_claims: dict[bool, sa.Select[Any]] = {}
        self._verbs = _VerbStatements.build(self._table)
        # PostgreSQL through psycopg 3 runs them on the DBAPI connection (see the module doc).
        # psycopg2, pg8000, ... keep SQLAlchemy's path: their parameter handling differs.
        self._fast = self._dialect == "postgresql" and self._engine.dialect.driver == "psycopg"
        self._raw_statements: dict[_Statement, _RawStatement] = {}

    @classmethod
    def from_url(cls, url: str, *, prefix: str = "celery-idem:", **options: Any) -> SQLStore:
        """Build the store from a ``db+...`` URL.

        Args:
            url: The store URL (see the class).
            prefix: Key prefix.
            **options: ``table_name`` and ``engine_options``.

        Raises:
            TypeError: An option the store does not know.
        """
        table_name = options.pop("table_name", DEFAULT_TABLE_NAME)
        engine_options = options.pop("engine_options", None)
        if options:
            raise TypeError(
                f"SQLStore got unknown option(s) {', '.join(sorted(options))}; it takes "
                f"table_name and engine_options (keyword arguments for create_engine)"
            )
        return cls(url, prefix=prefix, table_name=table_name, engine_options=engine_options)

    # -- the seam between SQLAlchemy and the contract's exceptions ----------------------------

    @contextlib.contextmanager
    def _translate_errors(self) -> Iterator[None]:
        """Turn "the database cannot be reached" into :class:`StoreUnavailable`.

        Other database errors (a constraint, a syntax error) are bugs and propagate unchanged;
        :class:`CorruptRecord` is raised where rows are mapped.
        """
        try:
            yield
        except sa_exc.SQLAlchemyError as exc:
            unavailable = self._translated(exc)
            if unavailable is None:
                raise
            raise unavailable from exc

    def _translated(self, exc: sa_exc.SQLAlchemyError) -> StoreUnavailable | None:
        """The :class:`StoreUnavailable` an error means, or None when it is not an outage."""
        if isinstance(exc, (
            sa_exc.TimeoutError,  # the pool had no free connection in time
            sa_exc.DisconnectionError,
            sa_exc.OperationalError,
            sa_exc.InterfaceError,
        )):
            return self._unavailable(exc)
        if isinstance(exc, sa_exc.DBAPIError) and exc.connection_invalidated:
            return self._unavailable(exc)  # any other error SQLAlchemy saw as a disconnect
        return None

    def _unavailable(self, exc: Exception) -> StoreUnavailable:
        reason = getattr(exc, "orig", None) or exc
        first_line = (str(reason).strip().splitlines() or [type(reason).__name__])[0]
        return StoreUnavailable(
            f"celery_idem could not reach the SQL store at {self._shown_url}: {first_line}"
        )

    @contextlib.contextmanager
    def _connect(self) -> Iterator[Connection]:
        """A pooled connection to the store's database, with errors translated."""
        with self._translate_errors():
            self._ensure_table()
            with self._engine.connect() as conn:
                yield conn

    @contextlib.contextmanager
    def _session(self) -> Iterator[_SASession | _RawSession]:
        """A pooled connection to run the verbs' statements on, with errors translated.

        The psycopg fast path when it applies (see the module doc), else SQLAlchemy's.
        """
        if not self._fast:
            with self._connect() as conn:
                yield _SASession(conn)
            return
        with self._translate_errors():
            self._ensure_table()
            fairy = self._raw_connection()
            try:
                yield _RawSession(self, fairy)
            finally:
                fairy.close()  # back to the pool (or discarded, if invalidated)

    def _raw_connection(self) -> Any:
        """A pooled DBAPI connection (SQLAlchemy's pool proxy) for the fast path."""
        dialect = self._engine.dialect
        try:
            return self._engine.raw_connection()
        except dialect.loaded_dbapi.Error as exc:
            # engine.connect() wraps a failed checkout the same way.
            raise sa_exc.DBAPIError.instance(
                None, None, exc, dialect.loaded_dbapi.Error,
                connection_invalidated=dialect.is_disconnect(exc, None, None), dialect=dialect,
            ) from exc

    def _execute(self, statement: _Statement, params: Mapping[str, Any]) -> _Outcome:
        """Run one statement on a pooled connection, with errors translated: a verb's hot path.

        The same as running it in :meth:`_session`; on the fast path without its two
        generator context managers (about 2 µs of client CPU per verb).
        """
        if not self._fast:
            with self._session() as session:
                return session.execute(statement, params)
        try:
            if not self._table_ready:
                self._ensure_table()
            fairy = self._raw_connection()
            try:
                return _RawSession(self, fairy).execute(statement, params)
            finally:
                fairy.close()  # back to the pool (or discarded, if invalidated)
        except sa_exc.SQLAlchemyError as exc:
            unavailable = self._translated(exc)
            if unavailable is None:
                raise
            raise unavailable from exc

    def _raw_statement(self, statement: _Statement) -> _RawStatement:
        raw = self._raw_statements.get(statement)
        if raw is None:
            # Two threads may both compile it: the results are equal, either one is kept.
            raw = self._raw_statements[statement] = _RawStatement.compile(statement, self._engine.dialect)
        return raw

    def _ensure_table(self) -> None:
        if self._table_ready:
            return
        with self._table_lock:
            if self._table_ready:
                return
            try:
                self._table.metadata.create_all(self._engine, checkfirst=True)
            except sa_exc.DBAPIError:
                # Several workers start at once: another one created the table between our
                # check and our CREATE. Its table is as good as ours.
                if not sa.inspect(self._engine).has_table(self._table.name):
                    raise
            self._add_missing_columns()
            self._table_ready = True

    def _add_missing_columns(self) -> None:
        """Add the columns a table made by an earlier version lacks (``claim_id``), once.

        Each is nullable without a default: an instant change on PostgreSQL, MySQL 8 and SQLite.
        Rows written before it have no claim id and are fenced by the token alone.

        Raises:
            ImproperlyConfigured: The column is missing and the store's user may not add it.
        """
        existing = {c["name"] for c in sa.inspect(self._engine).get_columns(self._table.name)}
        missing = [c for c in self._table.c if c.name not in existing]
        if not missing:
            return
        preparer = self._engine.dialect.identifier_preparer
        for column in missing:
            ddl = (f"ALTER TABLE {preparer.format_table(self._table)} ADD COLUMN "
                   f"{preparer.format_column(column)} "
                   f"{column.type.compile(dialect=self._engine.dialect)}")
            try:
                with self._engine.begin() as conn:
                    conn.exec_driver_sql(ddl)
            except sa_exc.DBAPIError as exc:
                # Another worker added it meanwhile, or this user may not alter the table.
                now = {c["name"] for c in sa.inspect(self._engine).get_columns(self._table.name)}
                if column.name in now:
                    continue
                if exc.connection_invalidated:
                    raise  # an outage, not a refusal: StoreUnavailable from the caller's seam
                raise ImproperlyConfigured(
                    f"the SQL store's table {self._table.name!r} lacks the column "
                    f"{column.name!r} (made by an earlier celery_idem) and it cannot be added: "
                    f"{exc.orig}; run: {ddl}"
                ) from exc

    # -- rows <-> records ---------------------------------------------------------------------

    def _stored(self, key: str) -> str:
        return self.prefix + key

    def _record(self, row: _Row) -> Record:
        key = str(row["key"])[len(self.prefix) :]
        try:
            data = row["data"]
            lease_expires = row["lease_expires"]
            return Record(
                key=key,
                state=State(row["state"]),
                token=int(row["token"]),
                owner=str(row["owner"]),
                task_id=str(row["task_id"]),
                attempt=int(row["attempt"]),
                lease_expires=None if lease_expires is None else float(lease_expires),
                payload_hash=row["payload_hash"],
                content_type=row["content_type"],
                data=None if data is None else bytes(data),
                updated=float(row["updated"]),
                claim_id=row["claim_id"] or "",
            )
        except (ValueError, TypeError) as exc:
            raise CorruptRecord(
                f"the record of {key!r} in SQL table {self._table.name!r} cannot be read: {exc}",
                key=key,
            ) from exc

    # -- claim --------------------------------------------------------------------------------

    def claim(
        self,
        key: str,
        *,
        owner: str,
        task_id: str,
        attempt: int,
        lease: float,
        ttl: float,
        payload_hash: str | None = None,
    ) -> Claim:
        """Atomically claim ``key`` for one attempt, or say why not (see :meth:`Store.claim`).

        One key's life, and what a claim decides at each point (``now`` = database clock)::

                   claim                       record(t)
          absent -------> IN_PROGRESS(t=1) -------------> DONE / FAILED   claims: DONE / FAILED
            ^               |  |  |
            |               |  |  +- lease live, not a retry of the holder: claims: BUSY
            |               |  +- lease_expired, or same task_id with a higher attempt:
            |               |     claim -> TAKEOVER, IN_PROGRESS(t+1)
            |               +- release(t) -> RELEASED(t) -- claim -> CLAIMED, IN_PROGRESS(t+1)
            +- expires <= now (TTL): counts as absent -- claim -> CLAIMED, IN_PROGRESS(t+1)

          A live row that is not RELEASED and stores another payload_hash -> MISMATCH (checked
          right after absent/RELEASED, before DONE, FAILED, TAKEOVER and BUSY).

        PostgreSQL: one statement. A CTE reads the current row without a lock and decides;
        DONE, FAILED and MISMATCH are answered from that read, writing nothing (not even a row
        lock). Otherwise a CTE locks the row (``FOR UPDATE``), decides again on it with the
        same named predicates and feeds an ``INSERT ... ON CONFLICT DO UPDATE`` that only runs
        when the decision holds. SQLite: the same decision as a SELECT and then
        an INSERT or UPDATE, serialized by ``BEGIN IMMEDIATE``. MySQL/MariaDB have no
        ``RETURNING`` for upserts and cannot hand back the replaced row: the decision is a
        SELECT (the whole claim when the key is not taken) and a taking claim adds one
        conditional INSERT or UPDATE, so it costs 2 statements.

        Returns:
            The decision, the token and the live record found before the claim.

        Raises:
            StoreUnavailable: The database could not be reached; nothing was written.
            CorruptRecord: The stored row cannot be read; nothing was written.
        """
        args = _ClaimArgs(self._stored(key), owner, task_id, attempt, lease, ttl, payload_hash,
                          new_claim_id())
        for _ in range(_CLAIM_RUNS):
            try:
                if self._dialect == "postgresql":
                    return self._claim_postgresql(args, self._execute)
                with self._connect() as conn:
                    return self._claim_select_then_write(conn, args)
            except _ClaimRaced:
                continue  # the winner's row is committed now; the next run sees it
        raise StoreUnavailable(
            f"the claim of {key!r} lost {_CLAIM_RUNS} races in a row in the SQL store at "
            f"{self._shown_url}: the row kept changing between the decision and the write"
        )

    def _claim_postgresql(
        self, args: _ClaimArgs, execute: Callable[[_Statement, Mapping[str, Any]], _Outcome]
    ) -> Claim:
        # WITH peek   AS MATERIALIZED (SELECT now, t.*, CASE <predicates> END AS status
        #                              FROM (SELECT <db clock> AS now) clock
        #                              LEFT JOIN t ON t.key = :k),
        #      old    AS MATERIALIZED (SELECT * FROM t WHERE key = :k AND <must lock> FOR UPDATE),
        #      locked AS MATERIALIZED (SELECT <db clock> AS now, old.*
        #                              FROM (SELECT 1) one LEFT JOIN old ON true
        #                              WHERE <must lock>),
        #      decide AS MATERIALIZED (SELECT locked.*, CASE <predicates> END FROM locked
        #                              UNION ALL
        #                              SELECT * FROM peek WHERE NOT <must lock>),
        #      up     AS (INSERT INTO t SELECT ... FROM decide
        #                 WHERE status IN ('claimed', 'takeover')
        #                 ON CONFLICT (key) DO UPDATE SET ... WHERE t.token = excluded.token - 1
        #                 RETURNING token)
        # SELECT decide.*, up.token FROM decide LEFT JOIN up ON true
        #   where <must lock> = EXISTS (SELECT FROM peek WHERE status IN ('claimed', 'takeover', 'busy'))
        #
        # "peek" reads the row without a lock. When it decides DONE, FAILED or MISMATCH (the
        # duplicate of a finished task, the hot path of a redelivery), that is the answer: the
        # locking branch is skipped by a one-time filter, nothing is locked or written, and the
        # transaction gets no xid, so its commit does not wait for a WAL flush (a row lock is
        # a logged write). The answer is about the row as of the statement's snapshot, and it
        # was true then (a row still live at the clock read after the snapshot was live at
        # it): a claim that writes nothing takes effect at its snapshot, like any read. A
        # write committed after the snapshot (a release of a MISMATCH row, a claim of a row
        # that expired meanwhile) comes after it, as if the claim had arrived a little earlier.
        #
        # Otherwise (the key may be taken, or is held: BUSY may turn into a takeover) the claim
        # decides on the locked row, as it always did. FOR UPDATE makes the row we decide on
        # the row the upsert meets: a concurrent claim waits for us and then decides on our
        # row (in READ COMMITTED the lock returns the row's latest version, not the snapshot's).
        # It cannot lock a row that is not there yet: when two claims of an absent key run at
        # once, the loser's snapshot shows no row, its INSERT meets the winner's row, and the
        # token guard (expected old token 0, found >= 1) turns the update into a no-op. The
        # statement then returns a holding decision without an "up" row: nothing was written,
        # and the claim runs again to decide on the winner's row. The upsert reads "decide",
        # so "old" is always evaluated (and locked) first.
        validate = bool(args.payload_hash)
        query = self._pg_claims.get(validate)
        if query is None:
            query = self._pg_claims[validate] = self._build_pg_claim(_claim_template(validate))
        _, row = execute(query, _claim_params(args))
        assert row is not None  # the statement always returns its one "decide" row
        if row["status"] in _HOLDS and row["taken_token"] is None:
            raise _ClaimRaced
        return self._claim_result(row, taken_token=row["taken_token"], claim_id=args.claim_id)

    def _build_pg_claim(self, args: _ClaimArgs) -> sa.Select[Any]:
        t = self._table
        # The unlocked look at the row, and the decision on it.
        clock = sa.select(db_now().label("now")).subquery("clock")
        peek = (
            sa.select(clock.c.now, *t.c, args.predicates(t, clock.c.now).status().label("status"))
            .select_from(clock.outerjoin(t, t.c.key == args.stored_key))
            .cte("peek")
            .prefix_with("MATERIALIZED")
        )
        # Uncorrelated, so PostgreSQL evaluates it once (an InitPlan) and skips the locking
        # scans entirely (a one-time filter) when it is false.
        must_lock = sa.exists().where(sa.or_(*(peek.c.status == s for s in _LOCKED)))
        old = (
            sa.select(t)
            .where(t.c.key == args.stored_key, must_lock)
            .with_for_update()
            .cte("old")
            .prefix_with("MATERIALIZED")
        )
        # The clock is read in the same row as the lock is taken (a target list is computed
        # after the join below it), so a claim that waited for the lock decides on the time it
        # got it; its own CTE because the decision reads it several times.
        one = sa.select(sa.literal(1).label("one")).subquery("one")
        locked = (
            sa.select(db_now().label("now"), *old.c)
            .select_from(one.outerjoin(old, sa.true()))
            .where(must_lock)
            .cte("locked")
            .prefix_with("MATERIALIZED")
        )
        decide = (
            sa.union_all(
                sa.select(
                    locked.c.now,
                    *(locked.c[c.name] for c in t.c),
                    args.predicates(locked, locked.c.now).status().label("status"),
                ),
                # NULL (a state we do not know) is answered unlocked too: CorruptRecord.
                sa.select(*peek.c).where(
                    sa.or_(peek.c.status.is_(None), sa.and_(*(peek.c.status != s for s in _LOCKED)))
                ),
            )
            .cte("decide")
            .prefix_with("MATERIALIZED")
        )
        values = args.values(now=decide.c.now, token=token_for(decide.c.token, decide.c.now))
        insert = pg_insert(t).from_select(
            # Not IN (...): SQLAlchemy expands an IN list at execution time, which the
            # compile-once fast path does not do.
            list(values),
            sa.select(*values.values()).where(sa.or_(*(decide.c.status == s for s in _HOLDS))),
        )
        up = (
            insert.on_conflict_do_update(
                index_elements=[t.c.key],
                set_={name: insert.excluded[name] for name in values if name != "key"},
                # The row met must be the row decided on: its token (0: none, the key was
                # absent and a concurrent first claim inserted it; nothing is written).
                where=t.c.token == sa.select(sa.func.coalesce(decide.c.token, 0)).scalar_subquery(),
            )
            .returning(t.c.token)
            .cte("up")
        )
        return sa.select(decide, up.c.token.label("taken_token")).select_from(
            decide.outerjoin(up, sa.true())
        )

    def _claim_select_then_write(self, conn: Connection, args: _ClaimArgs) -> Claim:
        # SQLite and MySQL cannot return the row an upsert replaced, so the decision is read
        # first and the write is conditional on it. SQLite has no row locks: BEGIN IMMEDIATE
        # takes the database's write lock up front and serializes the read-decide-write.
        # MySQL runs in autocommit without locks (SELECT ... FOR UPDATE would need a
        # transaction: two more round trips, with the row locked across them); instead the
        # write re-checks in SQL that the row still yields the same decision, and a claim that
        # finds it changed (or finds the absent key inserted) writes nothing and runs again.
        t = self._table
        clock = sa.select(db_now().label("now")).subquery("clock")
        status = args.predicates(t, clock.c.now).status()
        decide = sa.select(clock.c.now, *t.c, status.label("status")).select_from(
            clock.outerjoin(t, t.c.key == args.stored_key)
        )
        with self._sqlite_write_transaction(conn):
            row = conn.execute(decide).mappings().one()
            if row["status"] not in _HOLDS:
                return self._claim_result(row, taken_token=None)
            now = float(row["now"])
            # next_token on the database's clock, read in the decision's statement.
            token = next_token(None if row["key"] is None else int(row["token"]), now)
            values = args.values(now=sa.literal(now, sa.Double), token=token)
            if row["key"] is None:
                try:
                    conn.execute(sa.insert(t).values(values))
                except sa_exc.IntegrityError:
                    raise _ClaimRaced from None  # a concurrent first claim inserted the key
            else:
                still_same = sa.and_(
                    t.c.key == args.stored_key,
                    t.c.token == row["token"],
                    t.c.state == row["state"],
                    args.predicates(t, sa.literal(now, sa.Double)).status() == row["status"],
                )
                update = (
                    sa.update(t)
                    .where(still_same)
                    .values({name: value for name, value in values.items() if name != "key"})
                )
                if conn.execute(update).rowcount != 1:
                    raise _ClaimRaced
        return self._claim_result(row, taken_token=token, claim_id=args.claim_id)

    @contextlib.contextmanager
    def _sqlite_write_transaction(self, conn: Connection) -> Iterator[None]:
        """On SQLite, run the block in ``BEGIN IMMEDIATE ... COMMIT``; elsewhere just run it.

        The engine is in autocommit (pysqlite's own implicit BEGIN is off), so the transaction
        is ours to open and close, as SQLAlchemy's pysqlite documentation recommends.
        """
        if self._dialect != "sqlite":
            yield
            return
        conn.exec_driver_sql("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            conn.exec_driver_sql("ROLLBACK")
            raise
        conn.exec_driver_sql("COMMIT")

    def _claim_result(self, row: _Row, *, taken_token: int | None, claim_id: str = "") -> Claim:
        now = float(row["now"])
        live = row["key"] is not None and float(row["expires"]) > now
        # A live row in a state we do not know raises CorruptRecord here, before its NULL
        # status is looked at (the claim wrote nothing: NULL is not a holding status).
        before = self._record(row) if live else None
        status = ClaimStatus(row["status"])
        if taken_token is not None:
            return Claim(status, int(taken_token), before, now, claim_id)
        assert before is not None  # only a live row can refuse a claim
        return Claim(status, before.token, before, now)

    # -- fenced writes ------------------------------------------------------------------------

    def _lease_lost(self, verb: str, key: str, token: int, current: Record | None,
                    claim_id: str | None = None) -> LeaseLost:
        """Why a fenced write matched no row, worded like the memory store."""
        if current is not None and current.token == token and claim_id \
                and current.claim_id != claim_id and current.state is State.IN_PROGRESS:
            return LeaseLost(
                f"{verb} of {key!r} with token {token} refused: the record belongs to another "
                f"claim with the same token (issued again after the store lost the row)",
                key=key, token=token,
            )
        if current is None or current.token != token:
            return LeaseLost(
                f"{verb} of {key!r} with token {token} refused: the record "
                + ("is gone" if current is None else f"now has token {current.token}"),
                key=key,
                token=token,
            )
        return LeaseLost(f"{verb} of {key!r} refused: it is {current.state.value}", key=key, token=token)

    def record(
        self,
        key: str,
        token: int,
        *,
        state: State,
        content_type: str,
        data: bytes,
        ttl: float,
        claim_id: str | None = None,
    ) -> None:
        """Turn the caller's IN_PROGRESS row into DONE or FAILED: one fenced UPDATE.

        Recording again with the same token and state (a retry after a lost reply) succeeds
        and changes nothing.

        Raises:
            LeaseLost: The row has another token, is not in progress, or is gone.
            StoreUnavailable: The database could not be reached (the write may or may not
                have happened; retrying is safe).
            ValueError: ``state`` is not DONE or FAILED.
        """
        if state not in (State.DONE, State.FAILED):
            raise ValueError(f"record() takes DONE or FAILED, not {state}")
        params = {
            "idem_key": self._stored(key), "idem_token": token, "idem_state": state.value,
            "idem_content_type": content_type, "idem_data": data, "idem_ttl": ttl,
            "idem_claim_id": claim_id or "",
        }
        if self._execute(self._verbs.record, params)[0] == 1:
            return
        # Not the hot path: read the row once more to tell a retry from a lost lease.
        current = self.get(key)
        if (current is not None and current.token == token and current.state is state
                and (not claim_id or current.claim_id == claim_id)):
            return  # the holder retrying a record whose reply it lost
        raise self._lease_lost("record", key, token, current, claim_id)

    def release(self, key: str, token: int, *, claim_id: str | None = None) -> None:
        """Give the claim back: one fenced UPDATE to a RELEASED tombstone that keeps the token.

        The tombstone keeps the row's TTL and clears everything that described the holder.

        Raises:
            LeaseLost: The row has another token, is not in progress, or is gone.
            StoreUnavailable: The database could not be reached.
        """
        params = {"idem_key": self._stored(key), "idem_token": token,
                  "idem_claim_id": claim_id or ""}
        if self._execute(self._verbs.release, params)[0] != 1:
            raise self._lease_lost("release", key, token, self.get(key), claim_id)

    def renew(self, key: str, token: int, lease: float, *, claim_id: str | None = None) -> float:
        """Extend the caller's lease to database-now + ``lease``: one fenced UPDATE.

        MySQL/MariaDB have no ``UPDATE ... RETURNING``: the new expiry is read back by a second
        statement, which raises :class:`LeaseLost` if the key was taken over in between.

        Returns:
            The new lease expiry (database clock, epoch seconds).

        Raises:
            LeaseLost: The row has another token, is not in progress, or is gone.
            StoreUnavailable: The database could not be reached.
        """
        params = {"idem_key": self._stored(key), "idem_token": token, "idem_lease": lease,
                  "idem_claim_id": claim_id or ""}
        row: _Row | None = None
        if self._engine.dialect.update_returning:
            _, row = self._execute(self._verbs.renew_returning, params)
        else:
            with self._session() as session:
                if session.execute(self._verbs.renew, params)[0] == 1:
                    _, row = session.execute(self._verbs.renew_read, params)
        if row is None:
            raise self._lease_lost("renew", key, token, self.get(key), claim_id)
        return float(row["lease_expires"])

    # -- reads --------------------------------------------------------------------------------

    def forget(self, key: str, token: int) -> None:
        """Forget a done or failed outcome: one fenced UPDATE to a RELEASED tombstone.

        Built here rather than with the verbs: an operator's command, never a task's path.

        Raises:
            LeaseLost: The row has another token, is not done or failed, or is gone.
            StoreUnavailable: The database could not be reached.
        """
        t = self._table
        # Built once per store: compiled statements are cached by identity.
        stmt = self.__dict__.get("_forget_statement")
        if stmt is None:
            stmt = self.__dict__["_forget_statement"] = sa.update(t).where(
                t.c.key == sa.bindparam("idem_key"),
                t.c.token == sa.bindparam("idem_token"),
                sa.or_(t.c.state == State.DONE.value, t.c.state == State.FAILED.value),
                t.c.expires > db_now(),
            ).values(state=State.RELEASED.value, owner="", task_id="", attempt=0,
                     lease_expires=None, payload_hash=None, content_type=None, data=None,
                     updated=db_now())
        with self._session() as session:
            forgotten = session.execute(stmt, {"idem_key": self._stored(key), "idem_token": token})[0]
        if forgotten != 1:
            raise self._lease_lost("forget", key, token, self.get(key))

    def expires_at(self, key: str) -> float | None:
        """When the row of ``key`` expires (database clock), or None when it is absent."""
        t = self._table
        stmt = sa.select(t.c.expires).where(t.c.key == sa.bindparam("idem_key"), t.c.expires > db_now())
        with self._session() as session:
            _, row = session.execute(stmt, {"idem_key": self._stored(key)})
        return None if row is None else float(row["expires"])

    def get(self, key: str) -> Record | None:
        """Read one record, or None when the key is absent or its TTL has passed.

        Raises:
            StoreUnavailable: The database could not be reached.
            CorruptRecord: The stored row cannot be read.
        """
        _, row = self._execute(self._verbs.get, {"idem_key": self._stored(key)})
        return None if row is None else self._record(row)

    def _own_rows(self) -> ColumnElement[bool]:
        t = self._table
        if not self.prefix:
            return sa.true()
        # An exact comparison: LIKE is case-insensitive on SQLite and needs escaping.
        return sa.func.substr(t.c.key, 1, len(self.prefix)) == self.prefix

    def scan(self, state: State | None = None, count: int = 100) -> Iterator[Record]:
        """Iterate over this prefix's live records in key order, ``count`` rows per query.

        Keyset pagination (``key > last ORDER BY key LIMIT count``): every page is one query
        along the primary key, however deep the scan, and rows written meanwhile never shift a
        page. Not a snapshot: each page sees the rows as they are when it is read.

        Raises:
            StoreUnavailable: The database could not be reached.
            CorruptRecord: A stored row cannot be read.
        """
        t = self._table
        page_size = max(1, count)
        query = (
            sa.select(t).where(self._own_rows(), t.c.expires > db_now()).order_by(t.c.key).limit(page_size)
        )
        if state is not None:
            query = query.where(t.c.state == state.value)
        last: str | None = None
        while True:
            page = query if last is None else query.where(t.c.key > last)
            with self._connect() as conn:
                rows = conn.execute(page).mappings().all()
            for row in rows:
                yield self._record(row)
            if len(rows) < page_size:
                return
            last = rows[-1]["key"]

    def now(self) -> float:
        """The database server's clock (epoch seconds).

        Raises:
            StoreUnavailable: The database could not be reached.
        """
        with self._connect() as conn:
            return float(conn.execute(sa.select(db_now())).scalar_one())

    # -- maintenance --------------------------------------------------------------------------

    def purge_expired(self, limit: int = 1000) -> int:
        """Delete up to ``limit`` of this prefix's rows whose TTL has passed.

        They already count as absent; deleting them only reclaims space. The next claim of a
        purged key still gets a token above the purged one (the database clock term). Run it
        from a periodic task or by hand; call again while it returns ``limit``.

        Returns:
            How many rows were deleted.

        Raises:
            StoreUnavailable: The database could not be reached.
        """
        t = self._table
        with self._connect() as conn:
            now = float(conn.execute(sa.select(db_now())).scalar_one())
        # The clock is read first and bound as a value: PostgreSQL cannot use an index for a
        # comparison with clock_timestamp() (a volatile function), so `expires <= db_now()`
        # scans the whole table; `expires <= :now` is a range scan of the expires index
        # (EXPLAIN in docs/scaling.md). A row a claim brings back to life meanwhile gets
        # expires = a later clock + ttl, so it never matches.
        expired = sa.and_(self._own_rows(), t.c.expires <= sa.literal(now, sa.Double))
        if self._dialect in ("mysql", "mariadb"):
            # MySQL has DELETE ... LIMIT, but no LIMIT in an IN (subquery).
            delete = sa.delete(t).where(expired).with_dialect_options(mysql_limit=limit)
        else:
            batch = sa.select(t.c.key).where(expired).limit(limit).scalar_subquery()
            # The outer condition is checked again on the row being deleted: a claim may have
            # brought it back to life since the subquery read it.
            delete = sa.delete(t).where(t.c.key.in_(batch), expired)
        with self._connect() as conn:
            return int(conn.execute(delete).rowcount)

    def close(self) -> None:
        """Close the pooled connections. The store must not be used afterwards."""
        self._engine.dispose()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self._shown_url} table={self._table.name!r} prefix={self.prefix!r}>"
