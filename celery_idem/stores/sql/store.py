"""The SQL store itself: :class:`SQLStore`, the contract's verbs as statements built once
(what each costs per dialect: docs/stores.md, "Statements")."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, TypeAlias

import sqlalchemy as sa
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import URL, Connection
from sqlalchemy.sql.elements import ColumnElement

from ...config import DEFAULT_PREFIX
from ...exceptions import StoreUnavailable
from ...records import Claim, ClaimStatus, Record, State
from ..base import BackendWrite, ClaimRaced, lease_lost, new_claim_id, record_from_row
from ..sql_intents import IntentSQL, SQLIntents
from .claims import HOLDS, ClaimArgs, build_pg_claim, select_then_write
from .engine import build_engine, sqlalchemy_url
from .schema import DEFAULT_TABLE_NAME, add_missing_columns, db_now, intent_tables, records_table

if TYPE_CHECKING:  # the fast twins, imported when the store takes them
    from .psycopg import PsycopgPath, RawSession

__all__ = ["SASession", "SQLStore"]

logger = logging.getLogger("celery_idem")

# A row by column name (a SQLAlchemy RowMapping, or a dict on the psycopg path).
Row: TypeAlias = Mapping[Any, Any]
# What a session's execute gives back: the row count, and the first row when there are rows.
Outcome: TypeAlias = "tuple[int, Row | None]"
Statement: TypeAlias = "sa.Select[Any] | sa.Update"

# A claim that raced a concurrent first claim runs again on the winner's row; more runs than
# this mean something keeps deleting and re-inserting the row.
_CLAIM_RUNS: Final = 3

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
    (the fast twin: :class:`celery_idem.stores.sql.psycopg.RawSession`, the same ``execute``)."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def execute(self, statement: Statement, params: Mapping[str, Any]) -> Outcome:
        result = self.conn.execute(statement, params)
        if not result.returns_rows:
            return result.rowcount, None
        return result.rowcount, result.mappings().first()


@dataclass(frozen=True)
class VerbStatements:
    """The fenced writes' and the reads' statements, built once per table with ``idem_*`` bind
    parameters (the key and token ones take the type of the column they are compared with)."""

    record: sa.Update
    release: sa.Update
    renew: sa.Update
    renew_returning: sa.Update  # renew handing back the new lease, where UPDATE can RETURNING
    renew_read: sa.Select[Any]  # where it cannot: the new lease read back, still fenced
    get: sa.Select[Any]
    expires: sa.Select[Any]
    forget: sa.Update  # an operator's verb: a DONE or FAILED row, fenced by the token alone

    @classmethod
    def build(cls, t: sa.Table) -> VerbStatements:
        key: sa.BindParameter[str] = sa.bindparam("idem_key")
        live = (t.c.key == key, t.c.expires > db_now())
        claim_id: sa.BindParameter[str] = sa.bindparam("idem_claim_id", type_=t.c.claim_id.type)
        # Only the holder's live IN_PROGRESS row: the fence of record, release and renew. The
        # claim id names the claim beside the token ('' = a caller that checks the token alone).
        fenced = sa.and_(*live, t.c.token == sa.bindparam("idem_token"),
                         sa.or_(claim_id == "", t.c.claim_id == claim_id),
                         t.c.state == State.IN_PROGRESS.value)
        lease = sa.bindparam("idem_lease", type_=sa.Double)
        # The record must outlive the lease too: a body running past the TTL keeps its record
        # (and with it the token that fences every earlier holder).
        renew = sa.update(t).where(fenced).values(
            lease_expires=db_now() + lease,
            expires=sa.case((t.c.expires < db_now() + lease, db_now() + lease), else_=t.c.expires))
        # A RELEASED tombstone keeps the token and the TTL, and nothing of the holder.
        tombstone = {"state": State.RELEASED.value, "owner": "", "task_id": "", "attempt": 0,
                     "lease_expires": None, "payload_hash": None, "content_type": None,
                     "data": None, "updated": db_now()}
        return cls(
            record=sa.update(t).where(fenced).values(
                state=sa.bindparam("idem_state"), content_type=sa.bindparam("idem_content_type"),
                data=sa.bindparam("idem_data", type_=t.c.data.type), lease_expires=None,
                updated=db_now(), expires=db_now() + sa.bindparam("idem_ttl", type_=sa.Double)),
            release=sa.update(t).where(fenced).values(**tombstone, claim_id=None),
            renew=renew,
            renew_returning=renew.returning(t.c.lease_expires),
            renew_read=sa.select(t.c.lease_expires).where(fenced),
            get=sa.select(t).where(*live),
            expires=sa.select(t.c.expires).where(*live),
            forget=sa.update(t).where(
                *live, t.c.token == sa.bindparam("idem_token"),
                sa.or_(t.c.state == State.DONE.value, t.c.state == State.FAILED.value)).values(**tombstone))


class SQLStore(SQLIntents):
    """The idempotency store in a SQL database, through SQLAlchemy Core (intents: the shared
    statements of :mod:`celery_idem.stores.sql_intents`, in tables beside the records table).

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
        self._intent_sql = IntentSQL(
            "mysql" if self.dialect in ("mysql", "mariadb") else self.dialect,
            dialect.identifier_preparer.quote_identifier, str(db_now().compile(dialect=dialect)),
            table_name, prefix, "?" if dialect.loaded_dbapi.paramstyle == "qmark" else "%s")
        self._table_ready = False
        self._table_lock = threading.Lock()
        # Statements built once with ``idem_*`` bind parameters: building one costs more client
        # CPU than its round trip.
        self._pg_claims: dict[bool, sa.Select[Any]] = {}
        self._verbs = VerbStatements.build(self._table)
        # The seam: psycopg 3's connection (the fast twin), or None: SQLAlchemy's, the plain path.
        self._psycopg: PsycopgPath | None = None
        if accelerate and self.dialect == "postgresql" and self._engine.dialect.driver == "psycopg":
            from .psycopg import PsycopgPath

            self._psycopg = PsycopgPath(self._engine)
        # record_with's statements, per Celery result table and column set (.taskmeta).
        self._folds: dict[tuple[sa.Table, tuple[str, ...]], sa.Select[Any]] = {}
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
        """A pooled connection to the store's database, with errors translated."""
        with self._translate_errors():
            self._ensure_table()
            with self._engine.connect() as conn:
                yield conn

    @contextlib.contextmanager
    def _session(self) -> Iterator[SASession | RawSession]:
        """A pooled session for the verbs' statements (SQLAlchemy's, or psycopg's), errors translated."""
        if self._psycopg is None:
            with self._connect() as conn:
                yield SASession(conn)
            return
        with self._translate_errors():
            self._ensure_table()
            with self._psycopg.session() as session:
                yield session

    def _execute(self, statement: Statement, params: Mapping[str, Any]) -> Outcome:
        """Run one statement on a pooled connection, with errors translated: a verb's hot path."""
        with self._session() as session:
            return session.execute(statement, params)

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

    def _stored(self, key: str) -> str:
        return self.prefix + key

    def _run_intent_sql(self, sql: str, params: Sequence[Any]) -> tuple[int, list[Sequence[Any]]]:
        with self._connect() as conn:
            result = conn.exec_driver_sql(sql, tuple(params))
            return result.rowcount, list(result.all()) if result.returns_rows else []

    def _record(self, row: Row) -> Record:
        return record_from_row(row, self.prefix, self._table.name)

    def claim(self, key: str, *, owner: str, task_id: str, attempt: int, lease: float, ttl: float,
              payload_hash: str | None = None) -> Claim:
        """Claim ``key`` (see :meth:`Store.claim`), deciding on the database clock.

        PostgreSQL: one statement (:func:`~celery_idem.stores.sql.claims.build_pg_claim`);
        elsewhere a deciding SELECT, then a conditional INSERT or UPDATE.
        """
        args = ClaimArgs(self._stored(key), owner, task_id, attempt, lease, ttl, payload_hash,
                          new_claim_id())
        for _ in range(_CLAIM_RUNS):
            try:
                if self.dialect == "postgresql":
                    return self._claim_postgresql(args, self._execute)
                with self._connect() as conn:
                    row, token = select_then_write(conn, self._table, self.dialect, args)
                return self._claim_result(row, taken_token=token, claim_id=args.claim_id)
            except ClaimRaced:
                continue  # the winner's row is committed now; the next run sees it
        raise StoreUnavailable(
            f"the claim of {key!r} lost {_CLAIM_RUNS} races in a row in the SQL store at "
            f"{self._shown_url}: the row kept changing between the decision and the write")

    def _claim_postgresql(self, args: ClaimArgs,
                          execute: Callable[[Statement, Mapping[str, Any]], Outcome]) -> Claim:
        # A holding decision without a taken token lost the race for an absent key: no write.
        validate = bool(args.payload_hash)
        query = self._pg_claims.get(validate)
        if query is None:
            query = self._pg_claims[validate] = build_pg_claim(self._table, validate)
        _, row = execute(query, args.params())
        assert row is not None  # the statement always returns its one "decide" row
        if row["status"] in HOLDS and row["taken_token"] is None:
            raise ClaimRaced
        return self._claim_result(row, taken_token=row["taken_token"], claim_id=args.claim_id)

    def _claim_result(self, row: Row, *, taken_token: int | None, claim_id: str = "") -> Claim:
        now = float(row["now"])
        live = row["key"] is not None and float(row["expires"]) > now
        # A live row in an unknown state raises CorruptRecord here, before its NULL status.
        before = self._record(row) if live else None
        status = ClaimStatus(row["status"])
        if taken_token is not None:
            return Claim(status, int(taken_token), before, now, claim_id)
        assert before is not None  # only a live row can refuse a claim
        return Claim(status, before.token, before, now)

    # -- fenced writes ------------------------------------------------------------------------

    def record(self, key: str, token: int, *, state: State, content_type: str, data: bytes,
               ttl: float, claim_id: str | None = None) -> None:
        """One fenced UPDATE (see :meth:`Store.record`)."""
        params = self._record_params(key, token, state, content_type, data, ttl, claim_id)
        if self._execute(self._verbs.record, params)[0] != 1:
            self._unmatched_record(key, token, state, claim_id)

    def record_with(self, key: str, token: int, *, state: State, content_type: str, data: bytes,
                    ttl: float, also: BackendWrite, claim_id: str | None = None) -> bool:
        """:meth:`record`, and Celery's database result row in the same statement (PostgreSQL).

        The result fold's seam (:mod:`celery_idem.results_db`): a
        :class:`~celery_idem.stores.sql.taskmeta.TaskMetaWrite` ``also`` is written exactly when
        the record is; otherwise, or on another dialect, only the record is written.

        Returns:
            True when Celery's row was written in the record's statement, else False.
        """
        # Only the database result writer builds a write with a table (and imports .taskmeta).
        table = getattr(also, "table", None)
        if table is not None and self.dialect == "postgresql" and not self._fold_refused:
            from .taskmeta import TaskMetaWrite, build_fold, fold_params

            assert isinstance(also, TaskMetaWrite)
            params = self._record_params(key, token, state, content_type, data, ttl, claim_id)
            columns = tuple(also.row)
            fold = self._folds.get((table, columns))
            if fold is None:
                fold = self._folds[(table, columns)] = build_fold(
                    self._verbs.record, self._table, table, columns)
            try:
                _, row = self._execute(fold, {**params, **fold_params(also)})
            except sa_exc.DBAPIError as exc:
                # Not an outage (StoreUnavailable by now): Celery's table is not what the fold
                # expects. Nothing was written; record alone from now on.
                self._fold_refused = True
                logger.warning("celery_idem cannot write Celery's result row %s in the record's "
                               "statement, leaving it to Celery from now on: %s",
                               table.fullname, getattr(exc, "orig", exc))
            else:
                assert row is not None  # the statement always returns its one row
                if row["recorded"] != 1:
                    # A retry whose first reply was lost committed the row with the record: written.
                    self._unmatched_record(key, token, state, claim_id)
                return True
        self.record(key, token, state=state, content_type=content_type, data=data, ttl=ttl,
                    claim_id=claim_id)
        return False

    def _record_params(self, key: str, token: int, state: State, content_type: str, data: bytes,
                       ttl: float, claim_id: str | None) -> dict[str, Any]:
        if state not in (State.DONE, State.FAILED):
            raise ValueError(f"record() takes DONE or FAILED, not {state}")
        return self._fenced(key, token, claim_id, idem_state=state.value,
                            idem_content_type=content_type, idem_data=data, idem_ttl=ttl)

    def _fenced(self, key: str, token: int, claim_id: str | None, **more: Any) -> dict[str, Any]:
        """The parameters of a fenced statement (see VerbStatements), and ``more``."""
        return {"idem_key": self._stored(key), "idem_token": token, "idem_claim_id": claim_id or "",
                **more}

    def _unmatched_record(self, key: str, token: int, state: State, claim_id: str | None) -> None:
        """A record whose fenced UPDATE matched no row: a retry of ours, or LeaseLost."""
        current = self.get(key)
        if (current is not None and current.token == token and current.state is state
                and (not claim_id or current.claim_id == claim_id)):
            return  # the holder retrying a record whose reply it lost
        raise lease_lost("record", key, token, current, claim_id)

    def release(self, key: str, token: int, *, claim_id: str | None = None) -> None:
        """One fenced UPDATE to a RELEASED tombstone that keeps the token and the TTL."""
        if self._execute(self._verbs.release, self._fenced(key, token, claim_id))[0] != 1:
            raise lease_lost("release", key, token, self.get(key), claim_id)

    def renew(self, key: str, token: int, lease: float, *, claim_id: str | None = None) -> float:
        """One fenced UPDATE (MySQL/MariaDB: and a fenced read of the new lease)."""
        params = self._fenced(key, token, claim_id, idem_lease=lease)
        row: Row | None = None
        if self._engine.dialect.update_returning:
            _, row = self._execute(self._verbs.renew_returning, params)
        else:
            with self._session() as session:
                if session.execute(self._verbs.renew, params)[0] == 1:
                    _, row = session.execute(self._verbs.renew_read, params)
        if row is None:
            raise lease_lost("renew", key, token, self.get(key), claim_id)
        return float(row["lease_expires"])

    def forget(self, key: str, token: int) -> None:
        """One UPDATE, fenced by the token, of a DONE or FAILED row to a RELEASED tombstone."""
        if self._execute(self._verbs.forget, {"idem_key": self._stored(key), "idem_token": token})[0] != 1:
            raise lease_lost("forget", key, token, self.get(key))

    def expires_at(self, key: str) -> float | None:
        """When the row of ``key`` expires (database clock), or None when it is absent."""
        _, row = self._execute(self._verbs.expires, {"idem_key": self._stored(key)})
        return None if row is None else float(row["expires"])

    def get(self, key: str) -> Record | None:
        """Read one record, or None when the key is absent or its TTL has passed."""
        _, row = self._execute(self._verbs.get, {"idem_key": self._stored(key)})
        return None if row is None else self._record(row)

    def _own_rows(self) -> ColumnElement[bool]:
        if not self.prefix:
            return sa.true()
        # An exact comparison: LIKE is case-insensitive on SQLite and needs escaping.
        return sa.func.substr(self._table.c.key, 1, len(self.prefix)) == self.prefix

    def scan(self, state: State | None = None, count: int = 100) -> Iterator[Record]:
        """Iterate over this prefix's live records in key order, ``count`` rows per query (keyset
        pagination along the primary key; not a snapshot: each page is read as it is then)."""
        t = self._table
        page_size = max(1, count)
        query = (
            sa.select(t).where(self._own_rows(), t.c.expires > db_now()).order_by(t.c.key).limit(page_size))
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
        """The database server's clock (epoch seconds)."""
        with self._connect() as conn:
            return float(conn.execute(sa.select(db_now())).scalar_one())

    # -- maintenance --------------------------------------------------------------------------

    def purge_expired(self, limit: int = 1000) -> int:
        """Delete up to ``limit`` of this prefix's rows whose TTL has passed.

        They count as absent already; this reclaims space (the next claim's token is still
        higher: the clock term). Call again while it returns ``limit``.

        Returns:
            How many rows were deleted.

        Raises:
            StoreUnavailable: The database could not be reached.
        """
        t = self._table
        now = self.now()
        # Bound as a value: an index serves `expires <= :now`, not clock_timestamp() (volatile).
        expired = sa.and_(self._own_rows(), t.c.expires <= sa.literal(now, sa.Double))
        if self.dialect in ("mysql", "mariadb"):
            # MySQL has DELETE ... LIMIT, but no LIMIT in an IN (subquery).
            delete = sa.delete(t).where(expired).with_dialect_options(mysql_limit=limit)
        else:
            batch = sa.select(t.c.key).where(expired).limit(limit).scalar_subquery()
            # Checked again on the row deleted: a claim may have revived it since the subquery.
            delete = sa.delete(t).where(t.c.key.in_(batch), expired)
        with self._connect() as conn:
            return int(conn.execute(delete).rowcount)

    def close(self) -> None:
        """Close the pooled connections. The store must not be used afterwards."""
        self._engine.dispose()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self._shown_url} table={self._table.name!r} prefix={self.prefix!r}>"
