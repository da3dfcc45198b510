"""The SQL store itself, :class:`SQLStore` (what each verb costs per dialect: docs/stores.md,
"Statements")."""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, Final

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import URL, Connection
from sqlalchemy.orm import Session

from ...config import DEFAULT_PREFIX
from ...exceptions import ImproperlyConfigured, StoreUnavailable
from ...records import State
from ..base import BackendWrite, ClaimRaced
from ..sql_intents import IntentSQL
from ..sql_records import RecordSQL, Run, SQLRecords, immediate
from .engine import build_engine, sqlalchemy_url
from .schema import DEFAULT_TABLE_NAME, add_missing_columns, db_now, intent_tables, records_table

if TYPE_CHECKING:  # the fast twins, imported when the store takes them
    from .psycopg import PsycopgPath, RawSession

__all__ = ["SASession", "SQLStore"]

logger = logging.getLogger("celery_idem")

# The errors that mean "the store cannot be reached" (and any SQLAlchemy saw as a disconnect);
# every other one is a bug or bad data and propagates (tests/stores/test_sql_errors.py).
_OUTAGES: Final = (
    sa_exc.TimeoutError,  # the pool had no free connection in time
    sa_exc.DisconnectionError,
    sa_exc.OperationalError,  # the server went away, refused the connection, shut down
    sa_exc.InterfaceError,  # the driver could not talk to it
)


class SASession:
    """The plain path of ``SQLStore._session``: statements through a SQLAlchemy ``Connection``
    (the fast twin: :class:`celery_idem.stores.sql.psycopg.RawSession`, the same ``run``)."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def run(self, sql: str, params: Sequence[Any]) -> tuple[int, list[Sequence[Any]]]:
        """Run a statement's text with the driver's placeholders: its row count and its rows."""
        result = self.conn.exec_driver_sql(sql, tuple(params))
        return result.rowcount, list(result.all()) if result.returns_rows else []


class SQLStore(SQLRecords):
    """The idempotency store in a SQL database: the shared statements of the records and the
    intents (:mod:`celery_idem.stores.sql_records`, ``sql_intents``) on a SQLAlchemy engine.

    Args:
        url: ``db+postgresql[+driver]://...``, ``db+mysql[+driver]://...``,
            ``db+sqlite:///path.db`` (the ``db+`` is optional).
        prefix: Prepended to every key, so several apps can share one table.
        table_name: The table to use; created on first use.
        engine_options: Keyword arguments for :func:`sqlalchemy.create_engine`, over the defaults.
        accelerate: On PostgreSQL through psycopg 3, run the verbs on psycopg's connection
            (:mod:`celery_idem.stores.sql.psycopg`); the app passes its acceleration switch.

    Attributes:
        url: The SQLAlchemy URL the store connects to (its ``repr`` hides the password).
        dialect: The database's SQLAlchemy dialect name: ``postgresql``, ``mysql``, ``sqlite``...

    Raises:
        ImproperlyConfigured: The URL names no supported database.
    """

    accelerates = True

    def __init__(self, url: str, *, prefix: str = DEFAULT_PREFIX, table_name: str = DEFAULT_TABLE_NAME,
                 engine_options: Mapping[str, Any] | None = None, accelerate: bool = True) -> None:
        super().__init__(prefix)
        self._engine = build_engine(sqlalchemy_url(url), engine_options or {})
        self.url: URL = self._engine.url
        self.dialect: str = self._engine.dialect.name
        self._shown_url = self._engine.url.render_as_string(hide_password=True)
        self._table = records_table(table_name)
        intent_tables(self._table)  # created with it (its MetaData's)
        dialect = self._engine.dialect
        sql = ("mysql" if self.dialect in ("mysql", "mariadb") else self.dialect,
               dialect.identifier_preparer.quote, str(db_now().compile(dialect=dialect)),
               table_name, prefix, "?" if dialect.loaded_dbapi.paramstyle == "qmark" else "%s")
        self._record_sql, self._intent_sql = RecordSQL(*sql), IntentSQL(*sql)
        self._where = f"the SQL store at {self._shown_url}"
        self._table_ready = False
        self._table_lock = threading.Lock()
        # The seam: psycopg 3's connection (the fast twin), or None: SQLAlchemy's, the plain path.
        self._psycopg: PsycopgPath | None = None
        if accelerate and self.dialect == "postgresql" and self._engine.dialect.driver == "psycopg":
            from .psycopg import PsycopgPath

            self._psycopg = PsycopgPath(self._engine)
        # record_with's statements (.taskmeta.build_fold), per Celery result table and column set.
        self._folds: dict[tuple[sa.Table, tuple[str, ...]], tuple[str, Callable[..., list[Any]]]] = {}
        self._fold_refused = False

    @classmethod
    def from_url(cls, url: str, *, prefix: str = DEFAULT_PREFIX, **options: Any) -> SQLStore:
        """Build the store from a ``db+...`` URL; ``options``: the class's keyword arguments.

        Raises:
            TypeError: An option the store does not know.
        """
        unknown = set(options) - {"table_name", "engine_options", "accelerate"}
        if unknown:
            raise TypeError(
                f"SQLStore got unknown option(s) {', '.join(sorted(unknown))}; it takes "
                f"table_name, engine_options (keyword arguments for create_engine) and accelerate")
        return cls(url, prefix=prefix, **options)

    # -- the seam between SQLAlchemy and the contract's exceptions ----------------------------

    @contextlib.contextmanager
    def _translate_errors(self) -> Iterator[None]:
        """Turn "the database cannot be reached" into :class:`StoreUnavailable` (see ``_OUTAGES``)."""
        try:
            yield
        except sa_exc.SQLAlchemyError as exc:
            if not isinstance(exc, _OUTAGES) and not (
                    isinstance(exc, sa_exc.DBAPIError) and exc.connection_invalidated):
                raise
            reason = getattr(exc, "orig", None) or exc
            first_line = (str(reason).strip().splitlines() or [type(reason).__name__])[0]
            raise StoreUnavailable(
                f"celery_idem could not reach the SQL store at {self._shown_url}: {first_line}") from exc

    @contextlib.contextmanager
    def _connect(self) -> Iterator[Connection]:
        """A pooled connection to the store's database, with errors translated (within
        :meth:`joined`, the caller's session's connection: the writes join its transaction)."""
        with self._translate_errors():
            self._ensure_table()
            session = self._joined_session()
            if session is not None:
                yield session.connection()
                return
            with self._engine.connect() as conn:
                yield conn

    @contextlib.contextmanager
    def _session(self) -> Iterator[SASession | RawSession]:
        """A pooled session for the verbs' statements (SQLAlchemy's, or psycopg's), errors translated."""
        if self._psycopg is None or self._joined_session() is not None:
            with self._connect() as conn:
                yield SASession(conn)
            return
        with self._translate_errors():
            self._ensure_table()
            with self._psycopg.session() as session:
                yield session

    @contextlib.contextmanager
    def joined(self, session: Session) -> Iterator[None]:
        """The transactional enqueue: within, an intent task's ``delay()`` writes its intent in
        ``session``'s transaction and publishes once the session commits; a rollback publishes
        nothing, and a crash after the commit leaves the committed intent to the relay.

        Example::

            with Session(engine) as session, session.begin(), store.joined(session):
                session.add(Order(id=order_id))
                charge.delay(order_id)  # sent after the commit; the body sees the order

        The store's other writes within (the enqueue's reservation) join it too. On SQLite, the
        store's tables must exist before (a worker creates them when it starts).

        Raises:
            ImproperlyConfigured: ``session`` is bound to another database than the store's.
        """
        url = session.get_bind().engine.url
        if (url.get_backend_name(), url.host, url.port, url.database) != (
                self.url.get_backend_name(), self.url.host, self.url.port, self.url.database):
            raise ImproperlyConfigured(
                f"the session's database ({url.render_as_string(hide_password=True)}) is not the "
                f"store's ({self._shown_url}): an intent written there would not be the store's")
        token = _JOINED.set((self, session))
        try:
            yield
        finally:
            _JOINED.reset(token)

    def _joined_session(self) -> Session | None:
        """The caller's session this store's writes join now (:meth:`joined`), or None."""
        joined = _JOINED.get()
        return joined[1] if joined is not None and joined[0] is self else None

    def deferring(self) -> Callable[[Callable[[], None]], None] | None:
        session = self._joined_session()
        if session is None:
            return None
        if session.in_nested_transaction():
            raise ImproperlyConfigured(
                "an intent task's enqueue inside a SAVEPOINT (session.begin_nested()) is not "
                "supported: enqueue it in the outer transaction; nothing was sent")
        return functools.partial(_after_commit, session)

    def _ensure_table(self) -> None:
        if self._table_ready:
            return
        with self._table_lock:
            if self._table_ready:
                return
            for run in range(len(self._table.metadata.tables)):
                try:
                    self._table.metadata.create_all(self._engine, checkfirst=True)
                    break
                except sa_exc.DBAPIError:
                    # Another worker created one between our check and our CREATE: as good as
                    # ours; the next run creates those still missing.
                    inspector = sa.inspect(self._engine)
                    if all(inspector.has_table(name) for name in self._table.metadata.tables):
                        break
                    if run == len(self._table.metadata.tables) - 1:
                        raise
            add_missing_columns(self._engine, self._table)
            self._table_ready = True

    def _run_sql(self, sql: str, params: Sequence[Any]) -> tuple[int, list[Sequence[Any]]]:
        """Run one statement on a pooled session (psycopg's, or SQLAlchemy's), errors translated."""
        with self._session() as session:
            return session.run(sql, params)

    @contextlib.contextmanager
    def _claim_unit(self) -> Iterator[Run]:
        """One pooled connection for a claim's statements; on SQLite in ``BEGIN IMMEDIATE``."""
        with self._connect() as conn:
            def run(sql: str, params: Sequence[Any]) -> tuple[int, list[Sequence[Any]]]:
                try:
                    return SASession(conn).run(sql, params)
                except sa_exc.IntegrityError:
                    raise ClaimRaced from None  # a concurrent first claim inserted the key

            with immediate(run) if self.dialect == "sqlite" else contextlib.nullcontext():
                yield run

    # -- fenced writes ------------------------------------------------------------------------

    def record_with(self, key: str, token: int, *, state: State, content_type: str, data: bytes,
                    ttl: float, also: BackendWrite, claim_id: str | None = None) -> bool:
        """:meth:`Store.record_with` for :mod:`celery_idem.results_db`: a
        :class:`~celery_idem.stores.sql.taskmeta.TaskMetaWrite` ``also`` (Celery's database result
        row) in the record's statement, on PostgreSQL; anything else records alone."""
        # Only the database result writer builds a write with a table (and imports .taskmeta).
        table = getattr(also, "table", None)
        if table is not None and self.dialect == "postgresql" and not self._fold_refused:
            from .taskmeta import TaskMetaWrite, build_fold

            assert isinstance(also, TaskMetaWrite)
            params = self._record_params(key, token, state, content_type, data, ttl, claim_id)
            columns = tuple(also.row)
            fold = self._folds.get((table, columns))
            if fold is None:
                fold = self._folds[(table, columns)] = build_fold(
                    self._record_sql.record, self._record_sql.q("key"), table, columns, self._engine.dialect)
            try:
                _, rows = self._run_sql(fold[0], [*params, *fold[1](also)])
            except sa_exc.DBAPIError as exc:
                # Not an outage (StoreUnavailable by now): Celery's table is not what the fold
                # expects. Nothing was written; record alone from now on.
                self._fold_refused = True
                logger.warning("celery_idem cannot write Celery's result row %s in the record's "
                               "statement, leaving it to Celery from now on: %s",
                               table.fullname, getattr(exc, "orig", exc))
            else:
                if rows[0][0] != 1:  # recorded: the statement always returns its one row
                    # A retry whose first reply was lost committed the row with the record: written.
                    self._unmatched_record(key, token, state, claim_id)
                return True
        self.record(key, token, state=state, content_type=content_type, data=data, ttl=ttl,
                    claim_id=claim_id)
        return False

    def close(self) -> None:
        self._engine.dispose()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self._shown_url} table={self._table.name!r} prefix={self.prefix!r}>"


#: The store and the caller's session an intent joins (:meth:`SQLStore.joined`).
_JOINED: ContextVar[tuple[SQLStore, Session] | None] = ContextVar("celery_idem_sql_joined", default=None)
_PENDING = "celery_idem.after_commit"


def _after_commit(session: Session, callback: Callable[[], None]) -> None:
    """Run ``callback`` once ``session``'s transaction commits; drop it if it rolls back."""
    pending = session.info.get(_PENDING)
    if pending is None:  # the first one in this session: hear how its transactions end
        pending = session.info[_PENDING] = []
        event.listen(session, "after_commit", _run_pending)
        event.listen(session, "after_rollback", _drop_pending)
    pending.append(callback)


def _run_pending(session: Session) -> None:
    pending, session.info[_PENDING] = session.info[_PENDING], []
    for callback in pending:
        try:
            callback()
        except Exception:  # committed: the relay sends the message its intent keeps
            logger.exception("celery_idem could not publish after the commit; the relay will")


def _drop_pending(session: Session) -> None:
    session.info[_PENDING] = []
