"""The idempotency store on Django's own database connection (``django://<alias>``).

The same table, statements and contract as :class:`celery_idem.stores.sql.SQLStore`: the
record verbs are :mod:`celery_idem.stores.sql_records`'s and the intent verbs
:mod:`celery_idem.stores.sql_intents`'s, run on ``django.db.connections[alias]`` instead of a
SQLAlchemy engine: a Django project keeps one connection per thread and alias, managed by
Django (``CONN_MAX_AGE``, ``CONN_HEALTH_CHECKS``), and no second pool. The database clock is
Django's (:class:`celery_idem.contrib.django.sql.Dialect`): on MySQL/MariaDB it does not depend
on the session time zone, which Django does not pin.

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
from ...stores.base import ClaimRaced
from ...stores.sql_intents import IntentSQL
from ...stores.sql_records import RecordSQL, Run, SQLRecords, immediate
from .lifecycle import close_at_thread_exit, in_task, is_psycopg3, refresh_connection
from .sql import Dialect

__all__ = ["DjangoStore"]

DEFAULT_TABLE: Final = "celery_idem_records"
_VENDORS: Final = ("postgresql", "sqlite", "mysql")


class DjangoStore(SQLRecords):
    """The idempotency store in a Django database, on ``django.db.connections[using]``.

    Records and intents are the SQL store's statements on Django's connection; intents live
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
        # PostgreSQL through psycopg 3: the verbs run as prepared statements (_run_prepared).
        self._prepared = vendor == "postgresql" and is_psycopg3(connections[using])
        self._record_sql = RecordSQL(vendor, self._d.q, self._d.now, table_name, prefix)
        self._intent_sql = IntentSQL(vendor, self._d.q, self._d.now, table_name, prefix)
        self._where = f"the Django database {using!r}"
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

    def _run_sql(self, sql: str, params: Sequence[Any]) -> tuple[int, list[Sequence[Any]]]:
        """Run one statement on this thread's connection (prepared, on psycopg 3)."""
        with self._cursor() as cursor:
            if self._prepared and self.connection.connection is not None:
                return self._run_prepared(sql, params)
            cursor.execute(sql, params)
            return cursor.rowcount, cursor.fetchall() if cursor.description else []

    def _run_prepared(self, sql: str, params: Sequence[Any]) -> tuple[int, list[Sequence[Any]]]:
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
            return cursor.rowcount, cursor.fetchall() if cursor.description else []

    @contextlib.contextmanager
    def _claim_unit(self) -> Iterator[Run]:
        """One cursor for a claim's statements, serialised on SQLite.

        Outside a transaction, SQLite gets ``BEGIN IMMEDIATE`` (Django's connection is in
        autocommit, so the transaction is ours to open and close). Inside the caller's atomic
        block the statements join its transaction, which already holds or will take the lock,
        and each runs in a savepoint: a failed INSERT must not poison the caller's transaction.
        """
        from django.db import IntegrityError, transaction

        atomic = self.connection.in_atomic_block
        with self._cursor() as cursor:
            def run(sql: str, params: Sequence[Any]) -> tuple[int, list[Sequence[Any]]]:
                try:
                    with transaction.atomic(using=self.using) if atomic else contextlib.nullcontext():
                        cursor.execute(sql, params)
                        return cursor.rowcount, cursor.fetchall() if cursor.description else []
                except IntegrityError:
                    raise ClaimRaced from None  # a concurrent first claim inserted the key

            with contextlib.nullcontext() if atomic or self._d.vendor != "sqlite" else immediate(run):
                yield run

    def deferring(self) -> Callable[[Callable[[], None]], None] | None:
        """Inside ``transaction.atomic()`` on the store's alias (the verbs join it): Django's
        ``on_commit`` for it; None in autocommit."""
        if not self.connection.in_atomic_block:
            return None
        from django.db import transaction

        return functools.partial(transaction.on_commit, using=self.using)

    def close(self) -> None:
        """Close this thread's connection for the alias (Django reopens it on next use)."""
        self.connection.close()

    def __repr__(self) -> str:
        return (f"<{type(self).__name__} using={self.using!r} table={self.table_name!r} "
                f"prefix={self.prefix!r}>")
