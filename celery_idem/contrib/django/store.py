"""The idempotency store on Django's own database connection (``django://<alias>``).

The same table, verbs and contract as :class:`celery_idem.stores.sql.SQLStore` (see
:mod:`celery_idem.stores.base`), through ``django.db.connections[alias]`` instead of a
SQLAlchemy engine: a Django project keeps one connection per thread and alias, managed by
Django (``CONN_MAX_AGE``, ``CONN_HEALTH_CHECKS``), and no second pool. Each verb is raw SQL on a
Django cursor, one conditional statement, and every lease and expiry computation uses the
database clock inside that statement:

* PostgreSQL: the claim is one statement (lock the row ``FOR UPDATE``, decide on it, and an
  ``INSERT ... ON CONFLICT DO UPDATE`` guarded by the token it decided on); fenced writes are
  one ``UPDATE`` each (``RETURNING`` for renew);
* SQLite: the claim's decision and its write run in ``BEGIN IMMEDIATE ... COMMIT`` (SQLite's
  write lock serialises them); the rest one statement each;
* MySQL/MariaDB: the claim reads its decision and writes conditionally on the row still giving
  the same decision (a claim that finds it changed wrote nothing and runs again); renew is an
  ``UPDATE`` and a fenced ``SELECT``.

A taking claim's token is ``max(previous + 1, database clock in µs)``
(:func:`celery_idem.stores.base.next_token`) and comes with a new random claim id, which the
fenced writes check with the token.

Transactions: outside ``transaction.atomic()`` (a worker between tasks, the gate around a body)
Django connections autocommit, so each verb commits on its own. A verb called inside an atomic
block (an eager call in a view under ``ATOMIC_REQUESTS``, a test case) joins it: its effect is
committed or rolled back with the caller's transaction, as any ORM write would be.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Final
from urllib.parse import urlsplit

from ...config import DEFAULT_PREFIX
from ...exceptions import ImproperlyConfigured, StoreUnavailable
from ...records import Claim, ClaimStatus, Record, State
from ...stores.base import ClaimRaced, lease_lost, new_claim_id, next_token, record_from_row
from ...stores.sql_intents import RECORD_COLUMNS, IntentSQL, SQLIntents
from .lifecycle import close_at_thread_exit, in_task, is_psycopg3, refresh_connection
from .sql import Dialect, status_sql

__all__ = ["DjangoStore"]

DEFAULT_TABLE: Final = "celery_idem_records"

#: The columns of a record row, in the order every SELECT of this module returns them.
COLUMNS: Final = RECORD_COLUMNS

_HOLDS: Final = (ClaimStatus.CLAIMED.value, ClaimStatus.TAKEOVER.value)
# A claim that raced a concurrent first claim of the same key wrote nothing and runs again.
_CLAIM_RUNS: Final = 3
_VENDORS: Final = ("postgresql", "sqlite", "mysql")


class DjangoStore(SQLIntents):
    """The idempotency store in a Django database, on ``django.db.connections[using]``.

    Intents are the SQL store's (:mod:`celery_idem.stores.sql_intents`), on Django's connection,
    in ``<table_name>_intents`` and ``<table_name>_watermarks`` (migrated for the default table).

    Args:
        using: The ``DATABASES`` alias (``"default"`` unless the URL names one).
        prefix: Prepended to every key, so several apps can share one table.
        table_name: The records table; ``manage.py migrate`` creates the default one.

    Raises:
        ImproperlyConfigured: Django is not installed or set up, the alias is not in
            ``DATABASES``, or its database is not PostgreSQL, MySQL/MariaDB or SQLite.
    """

    def __init__(self, using: str = "default", *, prefix: str = DEFAULT_PREFIX,
                 table_name: str = DEFAULT_TABLE) -> None:
        super().__init__(prefix)
        try:
            from django.conf import settings
            from django.db import connections
        except ImportError as exc:
            raise ImproperlyConfigured(
                "the django:// store needs Django: pip install 'celery-idem[django]'") from exc
        if not settings.configured:
            raise ImproperlyConfigured(
                "the django:// store needs Django set up: set DJANGO_SETTINGS_MODULE (Celery's "
                "Django fixup then calls django.setup()) or call django.setup() in the app module")
        if using not in connections.settings:
            raise ImproperlyConfigured(
                f"the django:// store names the database alias {using!r}, which is not in "
                f"DATABASES ({', '.join(sorted(connections.settings)) or 'none'})")
        if not table_name.isidentifier():
            raise ImproperlyConfigured(f"table_name must be a plain SQL identifier, got {table_name!r}")
        self.using = using
        self.table_name = table_name
        self._connections = connections
        vendor = connections[using].vendor
        if vendor not in _VENDORS:
            raise ImproperlyConfigured(
                f"the django:// store supports PostgreSQL, MySQL/MariaDB and SQLite; the database "
                f"{using!r} is {vendor!r}")
        self._d = Dialect(vendor, connections[using].ops.quote_name)
        # PostgreSQL through psycopg 3: the verbs run as prepared statements (_one_prepared).
        self._prepared = vendor == "postgresql" and is_psycopg3(connections[using])
        self._sql: dict[str, str] = {}
        self._intent_sql = IntentSQL(vendor, self._d.q, self._d.now, table_name, prefix)
        self._build_statements()
        from .lifecycle import install_worker_signals

        install_worker_signals()

    @classmethod
    def from_url(cls, url: str, *, prefix: str = DEFAULT_PREFIX, **options: Any) -> DjangoStore:
        """Build the store from ``django://``, ``django://<alias>`` or ``django-db``.

        ``django-db`` is django-celery-results' result backend: the store then lives in the
        ``default`` database, beside the results. ``options`` may give ``using`` (wins over
        the URL) and ``table_name``.

        Raises:
            TypeError: An option the store does not know.
        """
        using = options.pop("using", None) or (urlsplit(url).netloc if "://" in url else "") or "default"
        table_name = options.pop("table_name", DEFAULT_TABLE)
        if options:
            raise TypeError(f"DjangoStore got unknown option(s) {', '.join(sorted(options))}; it "
                            f"takes using and table_name")
        return cls(using, prefix=prefix, table_name=table_name)

    # -- statements ---------------------------------------------------------------------------

    def _build_statements(self) -> None:
        d, q = self._d, self._d.q
        t = q(self.table_name)
        n = d.now
        cols = ", ".join(q(c) for c in COLUMNS)
        fenced = (f"{q('key')} = %s AND {q('token')} = %s AND (%s = '' OR {q('claim_id')} = %s) "
                  f"AND {q('state')} = 'in_progress' AND {q('expires')} > {n}")
        self._sql["record"] = (
            f"UPDATE {t} SET {q('state')} = %s, {q('content_type')} = %s, {q('data')} = %s, "
            f"{q('lease_expires')} = NULL, {q('updated')} = {n}, {q('expires')} = {n} + %s "
            f"WHERE {fenced}")
        self._sql["release"] = (
            f"UPDATE {t} SET {q('state')} = 'released', {q('owner')} = '', {q('task_id')} = '', "
            f"{q('attempt')} = 0, {q('lease_expires')} = NULL, {q('payload_hash')} = NULL, "
            f"{q('content_type')} = NULL, {q('data')} = NULL, {q('updated')} = {n}, "
            f"{q('claim_id')} = NULL WHERE {fenced}")
        # The record must outlive the lease too (a body running past the TTL keeps its token).
        self._sql["renew"] = (
            f"UPDATE {t} SET {q('lease_expires')} = {n} + %s, {q('expires')} = CASE WHEN "
            f"{q('expires')} < {n} + %s THEN {n} + %s ELSE {q('expires')} END WHERE {fenced}")
        self._sql["renew_read"] = f"SELECT {q('lease_expires')} FROM {t} WHERE {fenced}"
        self._sql["get"] = f"SELECT {cols} FROM {t} WHERE {q('key')} = %s AND {q('expires')} > {n}"
        self._sql["forget"] = (
            f"UPDATE {t} SET {q('state')} = 'released', {q('owner')} = '', {q('task_id')} = '', "
            f"{q('attempt')} = 0, {q('lease_expires')} = NULL, {q('payload_hash')} = NULL, "
            f"{q('content_type')} = NULL, {q('data')} = NULL, {q('updated')} = {n} "
            f"WHERE {q('key')} = %s AND {q('token')} = %s AND {q('state')} IN ('done', 'failed') "
            f"AND {q('expires')} > {n}")

    # -- connection and errors ----------------------------------------------------------------

    @property
    def connection(self) -> Any:
        """This thread's Django connection for the store's alias."""
        return self._connections[self.using]

    @contextlib.contextmanager
    def _cursor(self) -> Iterator[Any]:
        """A cursor on this thread's connection, with outages turned into StoreUnavailable.

        In a thread that runs no task (the lease renewal thread) and outside a transaction,
        Django's connection is first checked (``lifecycle.refresh_connection``): no task signal
        does it there; and it is closed when that thread ends (``lifecycle.close_at_thread_exit``).
        """
        from django.db import utils

        conn = self.connection
        try:
            if not conn.in_atomic_block and not in_task():
                refresh_connection(conn)
                close_at_thread_exit(conn)
            with conn.cursor() as cursor:
                yield cursor
        except (utils.OperationalError, utils.InterfaceError) as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise StoreUnavailable(
                f"celery_idem could not reach the Django database {self.using!r}: {first}") from exc

    def _one(self, sql: str, params: Sequence[Any]) -> tuple[int, tuple[Any, ...] | None]:
        with self._cursor() as cursor:
            if self._prepared and self.connection.connection is not None:
                return self._one_prepared(sql, params)
            cursor.execute(sql, params)
            row = cursor.fetchone() if cursor.description else None
            return cursor.rowcount, row

    def _one_prepared(self, sql: str, params: Sequence[Any]) -> tuple[int, tuple[Any, ...] | None]:
        """Run ``sql`` as a server-side prepared statement on Django's psycopg 3 connection.

        Django binds parameters client-side by default (``server_side_binding`` off), so the
        server parses and plans every statement again: for the claim's CTE that costs more
        than its round trip. The verbs run on the same connection (same transaction and
        autocommit state as Django's), through a plain psycopg cursor with ``prepare=True``;
        errors go through Django's wrapper, so they surface (and mark the connection) as an
        ORM query's would.
        """
        import psycopg

        conn = self.connection
        # psycopg.Cursor, not the connection's factory: Django makes that a ClientCursor
        # (client-side binding), which cannot prepare.
        with conn.wrap_database_errors, psycopg.Cursor(conn.connection) as cursor:
            cursor.execute(sql, params, prepare=conn.connection.prepare_threshold is not None)
            row = cursor.fetchone() if cursor.description else None
            return cursor.rowcount, row

    def _stored(self, key: str) -> str:
        return self.prefix + key

    def _run_intent_sql(self, sql: str, params: Sequence[Any]) -> tuple[int, list[Sequence[Any]]]:
        with self._cursor() as cursor:
            cursor.execute(sql, params)
            return cursor.rowcount, cursor.fetchall() if cursor.description else []

    def deferring(self) -> Callable[[Callable[[], None]], None] | None:
        """Inside ``transaction.atomic()`` on the store's alias (the verbs join it): Django's
        ``on_commit`` for it; None in autocommit."""
        if not self.connection.in_atomic_block:
            return None
        from django.db import transaction

        return functools.partial(transaction.on_commit, using=self.using)

    def _record(self, row: Sequence[Any]) -> Record:
        return record_from_row(dict(zip(COLUMNS, row, strict=False)), self.prefix, self.table_name)

    # -- claim --------------------------------------------------------------------------------

    def claim(
        self, key: str, *, owner: str, task_id: str, attempt: int, lease: float, ttl: float,
        payload_hash: str | None = None
    ) -> Claim:
        """Atomically claim ``key`` for one attempt, or say why not (see :meth:`Store.claim`).

        Raises:
            StoreUnavailable: The database could not be reached; nothing was written.
            CorruptRecord: The stored row cannot be read; nothing was written.
        """
        values = (self._stored(key), owner, task_id, attempt, lease, ttl, payload_hash, new_claim_id())
        for _ in range(_CLAIM_RUNS):
            try:
                if self._d.vendor == "postgresql":
                    return self._claim_postgresql(*values)
                return self._claim_select_then_write(*values)
            except ClaimRaced:
                continue
        raise StoreUnavailable(
            f"the claim of {key!r} lost {_CLAIM_RUNS} races in a row in the Django database "
            f"{self.using!r}: the row kept changing between the decision and the write")

    def _claim_postgresql(self, stored: str, owner: str, task_id: str, attempt: int, lease: float,
                          ttl: float, payload_hash: str | None, claim_id: str) -> Claim:
        # One statement, as the SQL store's PostgreSQL claim:
        #   peek:   the row without a lock and the decision on it. DONE, FAILED and MISMATCH (a
        #           duplicate of a finished action, the hot path of a redelivery) are answered
        #           from it: nothing is locked or written, so the commit waits for no WAL flush.
        #   old:    otherwise (the key may be taken, or is held: BUSY may turn into a takeover)
        #           the row locked FOR UPDATE, so the row decided on is the row the upsert meets
        #           (in READ COMMITTED a waiter re-reads the latest version);
        #   locked: the clock read after the lock, and the locked row;
        #   decide: the decision on the locked row, or peek's answer;
        #   up:     the upsert, only on a holding decision and only over the row decided on (its
        #           token; 0 when the key was absent and a concurrent first claim inserted it:
        #           then nothing is written and the claim runs again).
        q, d = self._d.q, self._d
        t = q(self.table_name)
        cols = ", ".join(q(c) for c in COLUMNS)
        peek_status, peek_params = status_sql(q, "r", "clock.now", [], payload_hash=payload_hash,
                                               task_id=task_id, attempt=attempt)
        status, status_params = status_sql(q, "locked", "locked.now", [], payload_hash=payload_hash,
                                            task_id=task_id, attempt=attempt)
        must_lock = "EXISTS (SELECT 1 FROM peek WHERE peek.status IN ('claimed', 'takeover', 'busy'))"
        sets = ", ".join(f"{q(c)} = EXCLUDED.{q(c)}" for c in COLUMNS if c != "key")
        sql = (
            "WITH peek AS MATERIALIZED (SELECT clock.now, "
            + ", ".join(f"r.{q(c)}" for c in COLUMNS)
            + f", {peek_status} AS status FROM (SELECT {d.now} AS now) clock "
            f"LEFT JOIN {t} r ON r.{q('key')} = %s), "
            f"old AS MATERIALIZED (SELECT * FROM {t} WHERE {q('key')} = %s AND {must_lock} FOR UPDATE), "
            f"locked AS MATERIALIZED (SELECT {d.now} AS now, "
            + ", ".join(f"old.{q(c)}" for c in COLUMNS)
            + f" FROM (SELECT 1 AS one) one LEFT JOIN old ON true WHERE {must_lock}), "
            f"decide AS MATERIALIZED (SELECT locked.*, {status} AS status FROM locked "
            f"UNION ALL SELECT * FROM peek WHERE peek.status IS NULL OR "
            f"peek.status NOT IN ('claimed', 'takeover', 'busy')), "
            f"up AS (INSERT INTO {t} ({cols}) "
            f"SELECT %s, 'in_progress', {d.token_for('decide.token', 'decide.now')}, %s, %s, %s, "
            f"decide.now + %s, %s, NULL, NULL, decide.now, decide.now + %s, %s FROM decide "
            f"WHERE decide.status IN ('claimed', 'takeover') "
            f"ON CONFLICT ({q('key')}) DO UPDATE SET {sets} "
            f"WHERE {t}.{q('token')} = (SELECT COALESCE(decide.token, 0) FROM decide) "
            f"RETURNING {t}.{q('token')}) "
            "SELECT decide.now, " + ", ".join(f"decide.{q(c)}" for c in COLUMNS)
            + ", decide.status, up.token FROM decide LEFT JOIN up ON true"
        )
        params = [*peek_params, stored, stored, *status_params,
                  stored, owner, task_id, attempt, float(lease), payload_hash, float(ttl), claim_id]
        _, row = self._one(sql, params)
        assert row is not None  # the statement always returns its one "decide" row
        now, record_row, status, taken = float(row[0]), row[1:14], row[14], row[15]
        if status in _HOLDS and taken is None:
            raise ClaimRaced
        return self._claim_result(now, record_row, status, taken, claim_id)

    def _claim_select_then_write(self, stored: str, owner: str, task_id: str, attempt: int,
                                 lease: float, ttl: float, payload_hash: str | None,
                                 claim_id: str) -> Claim:
        # SQLite and MySQL cannot hand back the row an upsert replaced: read the decision, then
        # write conditionally. SQLite: inside BEGIN IMMEDIATE (its write lock serialises the
        # two). MySQL: autocommit, and the write re-checks in SQL that the row still yields the
        # same decision (else it writes nothing and the claim runs again), like the SQL store.
        q, d = self._d.q, self._d
        t = q(self.table_name)
        status, status_params = status_sql(q, "r", "clock.now", [], payload_hash=payload_hash,
                                            task_id=task_id, attempt=attempt)
        decide = (
            "SELECT clock.now, " + ", ".join(f"r.{q(c)}" for c in COLUMNS) + f", {status} "
            f"FROM (SELECT {d.now} AS now) clock LEFT JOIN {t} r ON r.{q('key')} = %s"
        )
        with self._write_transaction() as cursor:
            cursor.execute(decide, [*status_params, stored])
            row = cursor.fetchone()
            now, record_row, status_value = float(row[0]), row[1:14], row[14]
            if status_value not in _HOLDS:
                return self._claim_result(now, record_row, status_value, None, claim_id)
            previous = record_row[2]
            token = next_token(None if record_row[0] is None else int(previous), now)
            new = [stored, State.IN_PROGRESS.value, token, owner, task_id, attempt, now + lease,
                   payload_hash, None, None, now, now + ttl, claim_id]
            if record_row[0] is None:
                from django.db import IntegrityError

                placeholders = ", ".join(["%s"] * len(COLUMNS))
                try:
                    with self._savepoint():
                        cursor.execute(
                            f"INSERT INTO {t} ({', '.join(q(c) for c in COLUMNS)}) "
                            f"VALUES ({placeholders})", new)
                except IntegrityError:
                    raise ClaimRaced from None  # a concurrent first claim inserted the key
            else:
                # The row must still give the decision made above, at the clock read above.
                same, same_params = status_sql(q, t, "%s", [now], payload_hash=payload_hash,
                                                task_id=task_id, attempt=attempt)
                sets = ", ".join(f"{q(c)} = %s" for c in COLUMNS if c != "key")
                cursor.execute(
                    f"UPDATE {t} SET {sets} WHERE {q('key')} = %s AND {q('token')} = %s AND "
                    f"{q('state')} = %s AND ({same}) = %s",
                    [*new[1:], stored, previous, record_row[1], *same_params, status_value])
                if cursor.rowcount != 1:
                    raise ClaimRaced
        return self._claim_result(now, record_row, status_value, token, claim_id)

    @contextlib.contextmanager
    def _savepoint(self) -> Iterator[None]:
        """A savepoint when inside a transaction (a failed INSERT must not poison it)."""
        from django.db import transaction

        if self.connection.in_atomic_block:
            with transaction.atomic(using=self.using):
                yield
        else:
            yield

    @contextlib.contextmanager
    def _write_transaction(self) -> Iterator[Any]:
        """A cursor whose statements run as one serialised unit on SQLite; just a cursor elsewhere.

        Outside a transaction, SQLite gets ``BEGIN IMMEDIATE`` (Django's connection is in
        autocommit, so the transaction is ours to open and close). Inside the caller's atomic
        block the statements join its transaction, which already holds or will take the lock.
        """
        with self._cursor() as cursor:
            if self._d.vendor != "sqlite" or self.connection.in_atomic_block:
                yield cursor
                return
            cursor.execute("BEGIN IMMEDIATE")
            try:
                yield cursor
            except BaseException:
                cursor.execute("ROLLBACK")
                raise
            cursor.execute("COMMIT")

    def _claim_result(self, now: float, row: Sequence[Any], status: str | None, taken: Any,
                      claim_id: str) -> Claim:
        live = row[0] is not None and float(row[11]) > now
        # A live row in a state we do not know raises CorruptRecord here, before its NULL
        # status is looked at (the claim wrote nothing).
        before = self._record(row) if live else None
        decided = ClaimStatus(status)
        if taken is not None:
            return Claim(decided, int(taken), before, now, claim_id)
        assert before is not None  # only a live row can refuse a claim
        return Claim(decided, before.token, before, now)

    # -- fenced writes ------------------------------------------------------------------------

    def _fence(self, key: str, token: int, claim_id: str | None) -> list[Any]:
        return [self._stored(key), token, claim_id or "", claim_id or ""]

    def record(self, key: str, token: int, *, state: State, content_type: str, data: bytes,
               ttl: float, claim_id: str | None = None) -> None:
        """Turn the caller's IN_PROGRESS row into DONE or FAILED: one fenced UPDATE.

        Raises:
            LeaseLost: The row has another token or claim id, is not in progress, or is gone.
            StoreUnavailable: The database could not be reached (retrying is safe).
            ValueError: ``state`` is not DONE or FAILED.
        """
        if state not in (State.DONE, State.FAILED):
            raise ValueError(f"record() takes DONE or FAILED, not {state}")
        params = [state.value, content_type, bytes(data), float(ttl), *self._fence(key, token, claim_id)]
        if self._one(self._sql["record"], params)[0] == 1:
            return
        current = self.get(key)
        if (current is not None and current.token == token and current.state is state
                and (not claim_id or current.claim_id == claim_id)):
            return  # the holder retrying a record whose reply it lost
        raise lease_lost("record", key, token, current, claim_id)

    def release(self, key: str, token: int, *, claim_id: str | None = None) -> None:
        """Give the claim back: one fenced UPDATE to a RELEASED tombstone that keeps the token.

        Raises:
            LeaseLost: The row has another token or claim id, is not in progress, or is gone.
            StoreUnavailable: The database could not be reached.
        """
        if self._one(self._sql["release"], self._fence(key, token, claim_id))[0] != 1:
            raise lease_lost("release", key, token, self.get(key), claim_id)

    def renew(self, key: str, token: int, lease: float, *, claim_id: str | None = None) -> float:
        """Extend the caller's lease to database-now + ``lease``: one fenced UPDATE.

        PostgreSQL and SQLite hand the new expiry back with ``RETURNING``; MySQL/MariaDB read it
        with a fenced SELECT (LeaseLost if the key was taken over in between).

        Raises:
            LeaseLost: The row has another token or claim id, is not in progress, or is gone.
            StoreUnavailable: The database could not be reached.
        """
        lease = float(lease)
        params = [lease, lease, lease, *self._fence(key, token, claim_id)]
        row: tuple[Any, ...] | None = None
        if self._d.vendor == "mysql":
            if self._one(self._sql["renew"], params)[0] == 1:
                _, row = self._one(self._sql["renew_read"], self._fence(key, token, claim_id))
        else:
            _, row = self._one(self._sql["renew"] + f" RETURNING {self._d.q('lease_expires')}", params)
        if row is None:
            raise lease_lost("renew", key, token, self.get(key), claim_id)
        return float(row[0])

    def forget(self, key: str, token: int) -> None:
        """Forget a done or failed outcome: one fenced UPDATE to a RELEASED tombstone.

        Raises:
            LeaseLost: The row has another token, is not done or failed, or is gone.
            StoreUnavailable: The database could not be reached.
        """
        if self._one(self._sql["forget"], [self._stored(key), token])[0] != 1:
            raise lease_lost("forget", key, token, self.get(key))

    # -- reads --------------------------------------------------------------------------------

    def get(self, key: str) -> Record | None:
        """Read one record, or None when the key is absent or its TTL has passed.

        Raises:
            StoreUnavailable: The database could not be reached.
            CorruptRecord: The stored row cannot be read.
        """
        _, row = self._one(self._sql["get"], [self._stored(key)])
        return None if row is None else self._record(row)

    def expires_at(self, key: str) -> float | None:
        """When the row of ``key`` expires (database clock), or None when it is absent."""
        q = self._d.q
        _, row = self._one(
            f"SELECT {q('expires')} FROM {q(self.table_name)} WHERE {q('key')} = %s AND "
            f"{q('expires')} > {self._d.now}", [self._stored(key)])
        return None if row is None else float(row[0])

    def scan(self, state: State | None = None, count: int = 100) -> Iterator[Record]:
        """Iterate over this prefix's live records in key order, ``count`` rows per query.

        Keyset pagination along the primary key; not a snapshot.

        Raises:
            StoreUnavailable: The database could not be reached.
            CorruptRecord: A stored row cannot be read.
        """
        q = self._d.q
        page_size = max(1, int(count))
        last: str | None = None
        while True:
            where = [f"{q('expires')} > {self._d.now}"]
            params: list[Any] = []
            if self.prefix:
                # An exact comparison: LIKE is case-insensitive on SQLite and needs escaping.
                where.append(f"substr({q('key')}, 1, {len(self.prefix)}) = %s")
                params.append(self.prefix)
            if state is not None:
                where.append(f"{q('state')} = %s")
                params.append(state.value)
            if last is not None:
                where.append(f"{q('key')} > %s")
                params.append(last)
            sql = (f"SELECT {', '.join(q(c) for c in COLUMNS)} FROM {q(self.table_name)} "
                   f"WHERE {' AND '.join(where)} ORDER BY {q('key')} LIMIT {page_size}")
            with self._cursor() as cursor:
                cursor.execute(sql, params)
                rows = cursor.fetchall()
            for row in rows:
                yield self._record(row)
            if len(rows) < page_size:
                return
            last = rows[-1][0]

    def now(self) -> float:
        """The database server's clock (epoch seconds).

        Raises:
            StoreUnavailable: The database could not be reached.
        """
        _, row = self._one(f"SELECT {self._d.now}", [])
        assert row is not None
        return float(row[0])

    def purge_expired(self, limit: int = 1000) -> int:
        """Delete up to ``limit`` of this prefix's rows whose TTL has passed; return how many.

        The clock is read first and bound as a value, so PostgreSQL can use the expires index.
        """
        q = self._d.q
        t = q(self.table_name)
        now = self.now()
        cond = f"{q('expires')} <= %s"
        params: list[Any] = [now]
        if self.prefix:
            cond += f" AND substr({q('key')}, 1, {len(self.prefix)}) = %s"
            params.append(self.prefix)
        if self._d.vendor == "mysql":
            sql = f"DELETE FROM {t} WHERE {cond} LIMIT {int(limit)}"
            all_params = params
        else:
            # The outer condition is checked again on the row deleted: a claim may have brought
            # it back to life since the subquery read it.
            sql = (f"DELETE FROM {t} WHERE {q('key')} IN (SELECT {q('key')} FROM {t} WHERE {cond} "
                   f"LIMIT {int(limit)}) AND {cond}")
            all_params = params + params
        with self._cursor() as cursor:
            cursor.execute(sql, all_params)
            return int(cursor.rowcount or 0)

    def close(self) -> None:
        """Close this thread's connection for the alias (Django reopens it on next use)."""
        self.connection.close()

    def __repr__(self) -> str:
        return (f"<{type(self).__name__} using={self.using!r} table={self.table_name!r} "
                f"prefix={self.prefix!r}>")
