"""The SQL store's statements on psycopg's connection itself (PostgreSQL + psycopg 3).

The fast twin of ``SQLStore._session``, whose plain path runs the statements through a
SQLAlchemy ``Connection`` (``SASession`` in :mod:`.store`), imported only with accelerations on. Here
each statement's text (:mod:`celery_idem.stores.sql_records`) is numbered once (``$1 .. $n``)
and run on the pooled psycopg connection as a server-side prepared statement with plain values
(:class:`RawSession`), raising what SQLAlchemy would raise, so the store translates errors the
same way.
"""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Iterator, Sequence
from typing import Any, Final

from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import Engine

__all__ = ["KEPT_CURSOR", "KEPT_RESULT_BYTES", "PsycopgPath", "RawSession", "psycopg_classes"]

class PsycopgPath:
    """Sessions on pooled psycopg 3 connections, and the statements numbered for them."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._numbered: dict[str, bytes] = {}

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


class RawSession:
    """Runs the store's statements on a pooled psycopg 3 connection, raising as SQLAlchemy would."""

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

    def run(self, sql: str, params: Sequence[Any]) -> tuple[int, list[Sequence[Any]]]:
        """Run a statement's text with ``%s`` placeholders, prepared: its row count and its rows
        (numbered on the kept RawCursor, or as written on a cursor of the connection's class)."""
        keep = self._raw_cursor is not None
        query: bytes | str
        if keep:
            cursor, query = self._kept_cursor(), self._path.numbered(sql)
        else:
            cursor, query = self._driver.cursor(row_factory=self._tuple_row), sql
        try:
            cursor.execute(query, list(params), prepare=self._prepare)
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
                sql, params, exc, dialect.loaded_dbapi.Error, hide_parameters=engine.hide_parameters,
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

