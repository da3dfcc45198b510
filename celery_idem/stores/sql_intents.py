"""The intent verbs in SQL, one implementation for the SQL store and the Django store.

Both stores run these statements as text on their own connection (a SQLAlchemy engine, or
Django's), so this module imports neither: a Django project needs no SQLAlchemy. Tables, beside
the records table ``<table>``: ``<table>_intents`` (the stored key, task id, queue, message and
the three store-clock times; an index on ``deadline``) and ``<table>_watermarks`` (the stored
queue name, its watermark). Keys and queue names carry the store's prefix, as records' keys do,
so apps sharing the tables keep apart. Each verb is one statement; on MySQL/MariaDB, which has
no ``RETURNING``, :meth:`SQLIntents.intend` reads the clock first (two round trips).
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, ClassVar, Final

from ..records import Intent, Record
from .base import Store, record_from_row

__all__ = ["INTENT_COLUMNS", "RECORD_COLUMNS", "IntentSQL", "SQLIntents", "Statements", "keyset"]

#: The columns of an intent row, in the order every statement here returns them.
INTENT_COLUMNS: Final = ("key", "task_id", "queue", "message", "enqueued", "deadline", "expires",
                         "sent")
#: The columns of a record row (both stores' records tables), in the order ``due`` returns them.
RECORD_COLUMNS: Final = ("key", "state", "token", "owner", "task_id", "attempt", "lease_expires",
                         "payload_hash", "content_type", "data", "updated", "expires", "claim_id")


class Statements:
    """What one store's statements are written for: its dialect, tables and prefix.

    Args:
        vendor: ``postgresql``, ``mysql`` (MariaDB too) or ``sqlite``.
        quote: Quotes an identifier for the database.
        now: The database clock in epoch seconds as a SQL expression.
        table: The records table's name (the intents tables are named after it).
        prefix: The store's key prefix (rows of other prefixes are not this store's).
        param: The driver's positional placeholder (``%s``, or ``?`` for a qmark driver).
    """

    def __init__(self, vendor: str, quote: Callable[[str], str], now: str, table: str,
                 prefix: str, param: str = "%s") -> None:
        self.vendor, self.q, self.now, self.table, self.prefix, self.param = (
            vendor, quote, now, table, prefix, param)
        self.own_params: list[Any] = [prefix] if prefix else []

    def own(self, column: str) -> str:
        """This prefix's rows of ``column``: an exact comparison (LIKE is case-insensitive on SQLite)."""
        return f"substr({column}, 1, {len(self.prefix)}) = {self.param}" if self.prefix else "1 = 1"


class IntentSQL(Statements):
    """The intent statements of one store (:class:`Statements`)."""

    def __init__(self, vendor: str, quote: Callable[[str], str], now: str, table: str,
                 prefix: str, param: str = "%s") -> None:
        super().__init__(vendor, quote, now, table, prefix, param)
        q, p, own = quote, param, self.own
        i, r, w = q(f"{table}_intents"), q(table), q(f"{table}_watermarks")
        self.intents_table, self.watermarks_table = f"{table}_intents", f"{table}_watermarks"
        cols = ", ".join(q(c) for c in INTENT_COLUMNS)
        icols = ", ".join(f"i.{q(c)}" for c in INTENT_COLUMNS)
        greatest = "max" if vendor == "sqlite" else "GREATEST"
        replace = ", ".join(f"{q(c)} = {self._new(q, c)}" for c in INTENT_COLUMNS[1:])
        if vendor == "mysql":
            # The times are bound: the clock is read first (no RETURNING to hand them back).
            self.intend = (f"INSERT INTO {i} ({cols}) VALUES ({', '.join([p] * 8)}) "
                           f"ON DUPLICATE KEY UPDATE {replace}")
        else:
            # One clock read for the three times. "WHERE 1 = 1": SQLite's parser needs a WHERE
            # between INSERT ... SELECT and ON CONFLICT.
            self.intend = (
                f"INSERT INTO {i} ({cols}) SELECT {p}, {p}, {p}, {p}, c.now, "
                f"{greatest}(c.now, {p}) + {p}, c.now + {p}, c.now FROM (SELECT {now} AS now) c WHERE 1 = 1 "
                f"ON CONFLICT ({q('key')}) DO UPDATE SET {replace} "
                f"RETURNING {q('enqueued')}, {q('deadline')}, {q('expires')}")
        # The clock is read once, in a one-row subquery the deadline index is probed with.
        self.due = (
            f"SELECT {icols}, " + ", ".join(f"r.{q(c)}" for c in RECORD_COLUMNS)
            + f" FROM (SELECT {now} AS now) c JOIN {i} i ON i.{q('deadline')} <= c.now "
            f"LEFT JOIN {r} r ON r.{q('key')} = i.{q('key')} AND r.{q('expires')} > c.now "
            f"WHERE {own('i.' + q('key'))} ORDER BY i.{q('deadline')} LIMIT {p}")
        cas = f"WHERE {q('key')} = {p} AND {q('task_id')} = {p} AND {q('deadline')} = {p}"
        self.reschedule = f"UPDATE {i} SET {q('deadline')} = {p} {cas}"
        self.resend = f"UPDATE {i} SET {q('deadline')} = {p}, {q('sent')} = {now} {cas}"
        self.close = f"DELETE FROM {i} WHERE {q('key')} = {p} AND {q('task_id')} = {p}"
        self._page = f"SELECT {cols} FROM {i} WHERE {own(q('key'))}"
        self._after, self._order = f" AND {q('key')} > {p}", f" ORDER BY {q('key')} LIMIT {p}"
        self.watermarks = f"SELECT {q('queue')}, {q('enqueued')} FROM {w} WHERE {own(q('queue'))}"
        if vendor == "mysql":
            self._raise = (f"INSERT INTO {w} ({q('queue')}, {q('enqueued')}) VALUES {{rows}} ON DUPLICATE "
                           f"KEY UPDATE {q('enqueued')} = GREATEST({q('enqueued')}, VALUES({q('enqueued')}))")
        else:
            self._raise = (f"INSERT INTO {w} ({q('queue')}, {q('enqueued')}) VALUES {{rows}} "
                           f"ON CONFLICT ({q('queue')}) DO UPDATE SET {q('enqueued')} = "
                           f"{greatest}({w}.{q('enqueued')}, excluded.{q('enqueued')})")
        self._row = f"({p}, {p})"

    def _new(self, q: Callable[[str], str], column: str) -> str:
        """The value an upsert's conflicting row takes for ``column``: the one it tried to insert."""
        return f"VALUES({q(column)})" if self.vendor == "mysql" else f"excluded.{q(column)}"

    def page(self, after: bool) -> str:
        """One page of :meth:`SQLIntents.intents` (parameters: the prefix's, the key, the size)."""
        return self._page + (self._after if after else "") + self._order

    def raise_watermarks(self, count: int) -> str:
        """The upsert of ``count`` watermarks (``queue, enqueued`` parameters, in row order)."""
        return self._raise.replace("{rows}", ", ".join([self._row] * count))


def keyset(run: Callable[[str, Sequence[Any]], tuple[int, list[Sequence[Any]]]],
           page: Callable[[bool], str], params: Sequence[Any], count: int) -> Iterator[Sequence[Any]]:
    """The rows of ``page(after)`` (``params``, the last key when ``after``, the page size), one
    query per ``count`` rows, paged along the primary key (first column): each page is read as it
    is then, not a snapshot."""
    size, after = max(1, int(count)), list[str]()
    while True:
        _, rows = run(page(bool(after)), [*params, *after, size])
        yield from rows
        if len(rows) < size:
            return
        after = [str(rows[-1][0])]


class SQLIntents(Store):
    """The intent verbs of :class:`~celery_idem.stores.base.Store` on :class:`IntentSQL`'s
    statements; a store gives its statements (``_intent_sql``) and a way to run them
    (:meth:`_run_sql`)."""

    keeps_intents: ClassVar[bool] = True
    _intent_sql: IntentSQL

    @abc.abstractmethod
    def _run_sql(self, sql: str, params: Sequence[Any]) -> tuple[int, list[Sequence[Any]]]:
        """Run one statement: its row count and its rows (none for a statement without)."""

    def _intent(self, row: Sequence[Any]) -> Intent:
        return Intent(key=str(row[0])[len(self.prefix):], task_id=str(row[1]),
                      queue=str(row[2])[len(self.prefix):], message=bytes(row[3]),
                      enqueued=float(row[4]), deadline=float(row[5]), expires=float(row[6]),
                      sent=float(row[7]))

    def intend(self, key: str, task_id: str, queue: str, message: bytes, *, relay_after: float,
               ttl: float, eta: float | None = None) -> Intent:
        """Write (or replace) ``key``'s intent (see :meth:`Store.intend`): one upsert (MySQL/MariaDB:
        a read of the clock, then the upsert)."""
        s = self._intent_sql
        stored, queued, data = self.prefix + key, self.prefix + queue, bytes(message)
        if s.vendor == "mysql":
            now = self.now()
            times = (now, max(now, eta or 0.0) + relay_after, now + ttl)
            self._run_sql(s.intend, [stored, task_id, queued, data, *times, now])
        else:
            _, rows = self._run_sql(
                s.intend, [stored, task_id, queued, data, float(eta or 0.0), float(relay_after), float(ttl)])
            times = (float(rows[0][0]), float(rows[0][1]), float(rows[0][2]))
        return Intent(key, task_id, queue, data, *times, times[0])

    def due_intents(self, limit: int = 500) -> list[tuple[Intent, Record | None]]:
        """Up to ``limit`` due intents, earliest deadline first, each with its key's live record:
        one SELECT joining the records table."""
        s = self._intent_sql
        _, rows = self._run_sql(s.due, [*s.own_params, max(0, int(limit))])
        width = len(INTENT_COLUMNS)
        return [(self._intent(row), None if row[width] is None else record_from_row(
                    dict(zip(RECORD_COLUMNS, row[width:], strict=True)), self.prefix, s.table))
                for row in rows]

    def reschedule_intent(self, intent: Intent, deadline: float, *, resent: bool = False) -> bool:
        """One compare-and-set UPDATE on the key, task id and deadline as read."""
        s = self._intent_sql
        count, _ = self._run_sql(s.resend if resent else s.reschedule, [
            float(deadline), self.prefix + intent.key, intent.task_id, float(intent.deadline)])
        return count == 1

    def close_intent(self, key: str, task_id: str) -> None:
        """One DELETE of ``key``'s intent, if it is still ``task_id``'s."""
        self._run_sql(self._intent_sql.close, [self.prefix + key, task_id])

    def intents(self, count: int = 100) -> Iterator[Intent]:
        """This prefix's intents in key order (:func:`keyset`)."""
        s = self._intent_sql
        return (self._intent(row) for row in keyset(self._run_sql, s.page, s.own_params, count))

    def watermarks(self) -> dict[str, float]:
        """This prefix's watermarks: one SELECT."""
        s = self._intent_sql
        _, rows = self._run_sql(s.watermarks, s.own_params)
        return {str(queue)[len(self.prefix):]: float(enqueued) for queue, enqueued in rows}

    def raise_watermarks(self, marks: Mapping[str, float]) -> None:
        """One upsert keeping the larger watermark per queue (in queue order: two relays lock
        the rows in the same order)."""
        if not marks:
            return
        params = [v for queue in sorted(marks) for v in (self.prefix + queue, float(marks[queue]))]
        self._run_sql(self._intent_sql.raise_watermarks(len(marks)), params)
