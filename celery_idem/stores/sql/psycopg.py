"""The SQL store's statements on psycopg's connection itself (PostgreSQL + psycopg 3).

The fast twin of ``SQLStore._session``, whose plain path runs the statements through a
SQLAlchemy ``Connection`` (``SASession`` in :mod:`.store`), imported only with accelerations on. Here
each statement is compiled once (:class:`RawStatement`) and run on the pooled psycopg
connection as a server-side prepared statement with plain tuples (:class:`RawSession`),
raising what SQLAlchemy would raise, so the store translates errors the same way.
"""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, TypeAlias

import sqlalchemy as sa
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import Engine

__all__ = ["KEPT_CURSOR", "KEPT_RESULT_BYTES", "PsycopgPath", "RawSession", "RawStatement",
           "psycopg_classes"]

# As .store's (not imported: the store imports this module, when it accelerates).
Row: TypeAlias = Mapping[Any, Any]
Outcome: TypeAlias = "tuple[int, Row | None]"
Statement: TypeAlias = "sa.Select[Any] | sa.Update"


class PsycopgPath:
    """Sessions on pooled psycopg 3 connections, and the statements compiled for them."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._statements: dict[Statement, RawStatement] = {}
        self._numbered: dict[str, bytes] = {}

    def statement(self, statement: Statement) -> RawStatement:
        """``statement`` compiled for this path (once; two threads compiling it get equal ones)."""
        raw = self._statements.get(statement)
        if raw is None:
            raw = self._statements[statement] = RawStatement.compile(statement, self.engine.dialect)
        return raw

    def numbered(self, sql: str) -> bytes:
        """``sql``'s ``%s`` placeholders as ``$1 .. $n``, for psycopg's RawCursor (once per text)."""
        raw = self._numbered.get(sql)
        if raw is None:
            count = iter(range(1, sql.count("%s") + 1))
            raw = self._numbered[sql] = re.sub(
                r"%s|%%", lambda m: "%" if m[0] == "%%" else f"${next(count)}", sql).encode()
        return raw

    @contextlib.contextmanager
    def session(self) -> Iterator[RawSession]:
        """A session on a pooled connection, given back (or discarded, if invalidated) after."""
        fairy = self.connection()
        try:
            yield RawSession(self, fairy)
        finally:
            fairy.close()

    def connection(self) -> Any:
        """A pooled DBAPI connection (SQLAlchemy's pool proxy), errors raised as SQLAlchemy's."""
        dialect = self.engine.dialect
        try:
            return self.engine.raw_connection()
        except dialect.loaded_dbapi.Error as exc:
            # engine.connect() wraps a failed checkout the same way.
            raise sa_exc.DBAPIError.instance(
                None, None, exc, dialect.loaded_dbapi.Error,
                connection_invalidated=dialect.is_disconnect(exc, None, None), dialect=dialect) from exc


# The cursor kept in each pooled connection's info dict, and the largest result it may keep.
KEPT_CURSOR: Final = "celery_idem.cursor"
KEPT_RESULT_BYTES: Final = 64 * 1024

_PLACEHOLDER: Final = re.compile(r"%\((?P<name>[^)]+)\)s|%%")


@dataclass(frozen=True)
class RawStatement:
    """One statement compiled once for the psycopg path.

    SQLAlchemy's literal binds (``'done'``, 1, ``NULL``) are written into the SQL text, so
    psycopg does not adapt and send them on every call (the claim has 35); only the ``idem_*``
    values remain parameters.

    Attributes:
        sql: The DBAPI SQL text (``%(name)s`` placeholders, with SQLAlchemy's type casts).
        constants: The literals that could not be written into the SQL (none in the store's).
        columns: The result columns' names, in order; empty when no rows come back.
        processors: SQLAlchemy's bind processors for the ``idem_*`` values, applied per call.
        numbered: The SQL with ``$1 .. $n`` placeholders for psycopg's ``RawCursor`` (its
            ``%(name)s`` parser caches up to 4 KiB and 50 parameters: not the claim).
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
    def compile(cls, statement: Statement, dialect: Any) -> RawStatement:
        compiled = statement.compile(dialect=dialect)
        # An expanding IN renders its values at execution time, which the fast path does not
        # do: a statement needing it is a bug in the store, caught the first time it runs.
        if "POSTCOMPILE" in compiled.string:
            raise RuntimeError(f"celery_idem: statement unfit for the raw path:\n{compiled.string}")
        processors: dict[str, Callable[[Any], Any]] = dict(getattr(compiled, "_bind_processors", {}))
        constants = {k: processors.pop(k)(v) if k in processors else v
                     for k, v in compiled.params.items() if not k.startswith("idem_")}
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
    """``value`` as SQLAlchemy writes it with ``literal_binds``; None: it stays a parameter."""
    if value is None:
        return "NULL"
    if type(value) not in (str, int):
        return None
    try:
        literal = compiled.render_literal_value(value, compiled.binds[name].type)
    except (sa_exc.CompileError, NotImplementedError):
        return None
    return str(literal)


class RawSession:
    """Runs the store's statements on a pooled psycopg 3 connection itself, raising errors as
    SQLAlchemy would (so ``SQLStore._translate_errors`` maps them as on the plain path)."""

    def __init__(self, path: PsycopgPath, fairy: Any) -> None:
        self._path = path
        self._fairy = fairy
        self._driver = driver = fairy.driver_connection
        # prepare_threshold=None is how psycopg is told not to prepare (PgBouncer in
        # transaction mode before 1.21): respect it; otherwise prepare at the first run.
        self._prepare = driver.prepare_threshold is not None
        # psycopg's RawCursor (3.2+) for the numbered SQL, unless the engine's connect_args
        # chose another cursor class, which is then used as before with %(name)s.
        cursor_class, self._raw_cursor, self._tuple_row = psycopg_classes()
        if driver.cursor_factory is not cursor_class:
            self._raw_cursor = None
        self._info: dict[Any, Any] = fairy.info

    def _kept_cursor(self) -> Any:
        """The RawCursor kept with this pooled connection (making one costs about 10 µs per verb).

        One thread at a time has the connection, so its cursor is never shared; the pool clears
        ``info`` when it replaces the connection, and the identity check guards that too.
        """
        assert self._raw_cursor is not None
        cursor = self._info.get(KEPT_CURSOR)
        if cursor is None or cursor.connection is not self._driver or cursor.closed:
            cursor = self._info[KEPT_CURSOR] = self._raw_cursor(self._driver, row_factory=self._tuple_row)
        return cursor

    def execute(self, statement: Statement, params: Mapping[str, Any]) -> Outcome:
        """Run a SQLAlchemy statement, compiled once: its row count and first row by column name."""
        raw = self._path.statement(statement)
        query: bytes | str
        values: Sequence[Any] | Mapping[str, Any]
        if self._raw_cursor is not None:
            query, values = raw.numbered, raw.positional(params)
        else:
            query, values = raw.sql, raw.values(params)
        count, rows = self._run(query, values, lambda: (raw.sql, raw.values(params)))
        if not raw.columns or not rows:
            return count, None
        return count, dict(zip(raw.columns, rows[0], strict=True))

    def run(self, sql: str, params: Sequence[Any]) -> tuple[int, list[Sequence[Any]]]:
        """Run a statement's text with ``%s`` placeholders: its row count and its rows."""
        query = self._path.numbered(sql) if self._raw_cursor is not None else sql
        return self._run(query, list(params), lambda: (sql, params))

    def _run(self, query: bytes | str, values: Sequence[Any] | Mapping[str, Any],
             shown: Callable[[], tuple[str, Any]]) -> tuple[int, list[Sequence[Any]]]:
        """Run ``query`` prepared (on the kept RawCursor, or a cursor of the connection's class);
        ``shown``: the SQL and values an error reports."""
        keep = self._raw_cursor is not None
        cursor = self._kept_cursor() if keep else self._driver.cursor(row_factory=self._tuple_row)
        try:
            cursor.execute(query, values, prepare=self._prepare)
            rows = cursor.fetchall() if cursor.description else []
            # A kept cursor holds its last result until the next verb: not a large one.
            size = sum(len(v) for row in rows for v in row if isinstance(v, bytes | memoryview))
            keep = keep and size <= KEPT_RESULT_BYTES
            return cursor.rowcount, rows
        except self._path.engine.dialect.loaded_dbapi.Error as exc:
            keep = False  # the next verb starts on a fresh cursor (errors are rare)
            engine = self._path.engine
            dialect = engine.dialect
            disconnect = dialect.is_disconnect(exc, self._fairy.dbapi_connection, cursor)
            if disconnect:
                # Like SQLAlchemy: drop this connection, and every pooled connection older
                # than now on its next checkout (a server restart killed them all). Pool's
                # private _invalidate (listed in compat.PRIVATE_NAMES); without it, this one only.
                invalidate = getattr(engine.pool, "_invalidate", None)
                if invalidate is not None:
                    invalidate(self._fairy, exc)
                else:  # pragma: no cover - SQLAlchemy 2.0-2.1 have it
                    self._fairy.invalidate(exc)
            raise sa_exc.DBAPIError.instance(
                *shown(), exc, dialect.loaded_dbapi.Error, hide_parameters=engine.hide_parameters,
                connection_invalidated=disconnect, dialect=dialect) from exc
        except BaseException:
            # Interrupted mid-protocol (a soft time limit, KeyboardInterrupt): the connection's
            # state is unknown, so it must not go back to the pool.
            keep = False
            self._fairy.invalidate()
            raise
        finally:
            if not keep:
                cursor.close()
                if self._info.get(KEPT_CURSOR) is cursor:
                    del self._info[KEPT_CURSOR]


@functools.cache
def psycopg_classes() -> tuple[type[Any], type[Any] | None, Any]:
    """psycopg's default cursor class, its RawCursor (None before psycopg 3.2) and tuple_row
    (explicit: an engine's ``row_factory`` cannot change what the fast path reads)."""
    import psycopg
    from psycopg.rows import tuple_row

    return psycopg.Cursor, getattr(psycopg, "RawCursor", None), tuple_row

