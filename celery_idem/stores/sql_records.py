"""The record verbs in SQL, one statement set for the SQL store and the Django store.

As :mod:`celery_idem.stores.sql_intents`: plain SQL text per dialect, run by each store on its
own connection (a SQLAlchemy engine, or Django's) through one seam, so this module imports
neither. The table is the records table (:data:`RECORD_COLUMNS`); every lease and expiry is
computed on the database clock inside the statement. What each verb costs:

* the claim: on PostgreSQL one statement (:attr:`RecordSQL.pg_claim`); elsewhere a deciding
  SELECT, then a conditional INSERT or UPDATE (:meth:`SQLRecords.claim`);
* record, release, forget: one fenced UPDATE each; renew one fenced UPDATE ``RETURNING`` the
  new lease (MySQL/MariaDB, without ``RETURNING``: and a fenced SELECT);
* get, expires_at: one SELECT; scan one SELECT per page; purge_expired a read of the clock and
  one DELETE.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any, Final, TypeAlias

from ..exceptions import StoreUnavailable
from ..records import Claim, ClaimStatus, Record, State
from .base import TOKEN_CLOCK_SCALE, ClaimRaced, lease_lost, new_claim_id, next_token, record_from_row
from .sql_intents import RECORD_COLUMNS, SQLIntents, Statements, keyset

__all__ = ["HOLDS", "RecordSQL", "Run", "SQLRecords", "status_sql"]

#: The claim statuses under which the caller holds the key (the claim wrote its row).
HOLDS: Final = (ClaimStatus.CLAIMED.value, ClaimStatus.TAKEOVER.value)
# A claim that raced a concurrent first claim of the same key wrote nothing and runs again;
# more runs than this mean something keeps deleting and re-inserting the row.
_CLAIM_RUNS: Final = 3
# The statuses the PostgreSQL claim decides again on the locked row.
_LOCKED: Final = "('claimed', 'takeover', 'busy')"

#: Runs one statement: its row count and its rows (none for a statement without).
Run: TypeAlias = Callable[[str, Sequence[Any]], "tuple[int, list[Sequence[Any]]]"]


def status_sql(q: Callable[[str], str], row: str, now: str, *, validate: bool,
               param: str = "%s") -> tuple[str, Callable[..., list[Any]]]:
    """The claim's decision as a CASE over ``row`` (may be an outer-joined NULL row) at ``now``.

    The order and meaning of :meth:`celery_idem.stores.base.Store.claim`. ``now`` is SQL (a
    column, or ``param``: a value bound); ``validate``: the caller gives a payload hash. Returns
    the SQL and a function of ``(payload_hash, task_id, attempt[, now])`` giving its
    parameters in placeholder order.
    """
    def c(name: str) -> str:
        return f"{row}.{q(name)}"

    # A validating caller refuses a record with another hash or with none.
    mismatch = f"({c('payload_hash')} IS NULL OR {c('payload_hash')} <> {param})" if validate else "(1 = 0)"
    sql = (
        f"CASE WHEN {c('key')} IS NULL OR {c('expires')} <= {now} OR {c('state')} = 'released' "
        f"THEN 'claimed' WHEN {mismatch} THEN 'mismatch' "
        f"WHEN {c('state')} = 'done' THEN 'done' WHEN {c('state')} = 'failed' THEN 'failed' "
        f"WHEN {c('state')} = 'in_progress' AND (({c('lease_expires')} IS NOT NULL AND "
        f"{c('lease_expires')} <= {now}) OR ({c('task_id')} = {param} AND {c('attempt')} < {param})) "
        f"THEN 'takeover' WHEN {c('state')} = 'in_progress' THEN 'busy' ELSE NULL END")
    bound = now == param

    def params(payload_hash: str | None, task_id: str, attempt: int, *at: float) -> list[Any]:
        clock = list(at) if bound else []
        return [*clock, *([payload_hash] if validate else []), *clock, task_id, attempt]

    return sql, params


class RecordSQL(Statements):
    """The record statements of one store (:class:`Statements`)."""

    def __init__(self, vendor: str, quote: Callable[[str], str], now: str, table: str,
                 prefix: str, param: str = "%s") -> None:
        super().__init__(vendor, quote, now, table, prefix, param)
        q, p, n, t = quote, param, now, quote(table)
        cols = ", ".join(q(c) for c in RECORD_COLUMNS)
        own = self.own(q("key"))
        live = f"{q('key')} = {p} AND {q('expires')} > {n}"
        # Only the holder's live IN_PROGRESS row: the fence of record, release and renew. The
        # claim id names the claim beside the token ('' = a caller that checks the token alone).
        fenced = (f"{live} AND {q('token')} = {p} AND ({p} = '' OR {q('claim_id')} = {p}) "
                  f"AND {q('state')} = 'in_progress'")
        # A RELEASED tombstone keeps the token and the TTL, and nothing of the holder.
        tombstone = (f"{q('state')} = 'released', {q('owner')} = '', {q('task_id')} = '', "
                     f"{q('attempt')} = 0, {q('lease_expires')} = NULL, {q('payload_hash')} = NULL, "
                     f"{q('content_type')} = NULL, {q('data')} = NULL, {q('updated')} = {n}")
        self.clock = f"SELECT {n}"
        self.record = (f"UPDATE {t} SET {q('state')} = {p}, {q('content_type')} = {p}, {q('data')} = {p}, "
                       f"{q('lease_expires')} = NULL, {q('updated')} = {n}, {q('expires')} = {n} + {p} "
                       f"WHERE {fenced}")
        self.release = f"UPDATE {t} SET {tombstone}, {q('claim_id')} = NULL WHERE {fenced}"
        # The record must outlive the lease too: a body running past the TTL keeps its record
        # (and with it the token that fences every earlier holder).
        self.renew = (f"UPDATE {t} SET {q('lease_expires')} = {n} + {p}, {q('expires')} = CASE WHEN "
                      f"{q('expires')} < {n} + {p} THEN {n} + {p} ELSE {q('expires')} END WHERE {fenced}")
        self.renew_returning = (None if vendor == "mysql"
                                else f"{self.renew} RETURNING {q('lease_expires')}")
        self.renew_read = f"SELECT {q('lease_expires')} FROM {t} WHERE {fenced}"
        self.forget = (f"UPDATE {t} SET {tombstone} WHERE {live} AND {q('token')} = {p} "
                       f"AND {q('state')} IN ('done', 'failed')")
        self.get = f"SELECT {cols} FROM {t} WHERE {live}"
        self.expires = f"SELECT {q('expires')} FROM {t} WHERE {live}"
        self.insert = f"INSERT INTO {t} ({cols}) VALUES ({', '.join([p] * len(RECORD_COLUMNS))})"
        self._page = f"SELECT {cols} FROM {t} WHERE {own} AND {q('expires')} > {n}"
        # Bound as a value: an index serves `expires <= %s`, not the (volatile) clock.
        expired = f"{own} AND {q('expires')} <= {p}"
        if vendor == "mysql":
            # MySQL has DELETE ... LIMIT, but no LIMIT in an IN (subquery).
            self.purge, self.purge_twice = f"DELETE FROM {t} WHERE {expired} LIMIT {p}", False
        else:
            # Checked again on the row deleted: a claim may have revived it since the subquery.
            self.purge = (f"DELETE FROM {t} WHERE {q('key')} IN (SELECT {q('key')} FROM {t} "
                          f"WHERE {expired} LIMIT {p}) AND {expired}")
            self.purge_twice = True
        self.decide = {validate: self._decide(validate) for validate in (False, True)}
        self.pg_claim = {validate: self._pg_claim(validate) for validate in (False, True)}
        self.update_same = {validate: self._update_same(validate) for validate in (False, True)}

    def page(self, state: bool, after: bool) -> str:
        """One page of :meth:`SQLRecords.scan`: this prefix's live rows (of a state; after a
        key), in key order (parameters: the prefix's, the state, the key, the page size)."""
        q, p = self.q, self.param
        return (self._page + (f" AND {q('state')} = {p}" if state else "")
                + (f" AND {q('key')} > {p}" if after else "") + f" ORDER BY {q('key')} LIMIT {p}")

    def _decide(self, validate: bool) -> tuple[str, Callable[..., list[Any]]]:
        """The unlocked look at the key's row (NULLs when absent): ``now``, the row, ``status``."""
        q, p = self.q, self.param
        status, params = status_sql(q, "r", "clock.now", validate=validate, param=p)
        return ("SELECT clock.now, " + ", ".join(f"r.{q(c)}" for c in RECORD_COLUMNS)
                + f", {status} FROM (SELECT {self.now} AS now) clock "
                f"LEFT JOIN {q(self.table)} r ON r.{q('key')} = {p}"), params

    def _update_same(self, validate: bool) -> tuple[str, Callable[..., list[Any]]]:
        """A taking claim's UPDATE of the row decided on, only while it still gives the same
        decision at the clock read (parameters: the new row but its key, the key, the token
        and state decided on, the decision's, the status)."""
        q, p = self.q, self.param
        same, params = status_sql(q, q(self.table), p, validate=validate, param=p)
        sets = ", ".join(f"{q(c)} = {p}" for c in RECORD_COLUMNS if c != "key")
        return (f"UPDATE {q(self.table)} SET {sets} WHERE {q('key')} = {p} AND {q('token')} = {p} "
                f"AND {q('state')} = {p} AND ({same}) = {p}"), params

    def _pg_claim(self, validate: bool) -> str:
        """The PostgreSQL claim: one statement that decides and, when the claim takes, writes.

        Its one row is the decision (the clock ``now``, the row decided on, ``status``) and the
        token written (NULL when nothing was). Parameters: the decision's on ``peek``, the key
        twice, the decision's on ``locked``, then the new row's (key, owner, task id, attempt,
        lease, payload hash, TTL, claim id)::

            peek:   the row without a lock and the decision on it. DONE, FAILED and MISMATCH (a
                    duplicate of a finished action) are answered from it: nothing is locked or
                    written, so the transaction gets no xid and its commit waits for no WAL flush;
            old:    otherwise the row locked FOR UPDATE (in READ COMMITTED a waiter re-reads the
                    latest version), so the row decided on is the row the upsert meets;
            locked: the clock read after the lock, and the locked row;
            decide: the decision on the locked row, or peek's answer;
            up:     the upsert, only on a holding decision and only over the row decided on (its
                    token; 0 when the key was absent and a concurrent first claim inserted it:
                    nothing is written, and the claim runs again).
        """
        q, p, n, t = self.q, self.param, self.now, self.q(self.table)
        cols = ", ".join(q(c) for c in RECORD_COLUMNS)
        peek, _ = status_sql(q, "r", "clock.now", validate=validate, param=p)
        status, _ = status_sql(q, "locked", "locked.now", validate=validate, param=p)
        must_lock = f"EXISTS (SELECT 1 FROM peek WHERE peek.status IN {_LOCKED})"
        sets = ", ".join(f"{q(c)} = EXCLUDED.{q(c)}" for c in RECORD_COLUMNS if c != "key")
        token = (f"GREATEST(COALESCE(decide.token, 0) + 1, "
                 f"CAST(decide.now * {TOKEN_CLOCK_SCALE} AS BIGINT))")
        return (
            "WITH peek AS MATERIALIZED (SELECT clock.now, " + ", ".join(f"r.{q(c)}" for c in RECORD_COLUMNS)
            + f", {peek} AS status FROM (SELECT {n} AS now) clock LEFT JOIN {t} r ON r.{q('key')} = {p}), "
            f"old AS MATERIALIZED (SELECT * FROM {t} WHERE {q('key')} = {p} AND {must_lock} FOR UPDATE), "
            f"locked AS MATERIALIZED (SELECT {n} AS now, " + ", ".join(f"old.{q(c)}" for c in RECORD_COLUMNS)
            + f" FROM (SELECT 1 AS one) one LEFT JOIN old ON true WHERE {must_lock}), "
            f"decide AS MATERIALIZED (SELECT locked.*, {status} AS status FROM locked UNION ALL "
            f"SELECT * FROM peek WHERE peek.status IS NULL OR peek.status NOT IN {_LOCKED}), "
            f"up AS (INSERT INTO {t} ({cols}) SELECT {p}, 'in_progress', {token}, {p}, {p}, {p}, "
            f"decide.now + {p}, {p}, NULL, NULL, decide.now, decide.now + {p}, {p} FROM decide "
            f"WHERE decide.status IN ('claimed', 'takeover') ON CONFLICT ({q('key')}) DO UPDATE SET "
            f"{sets} WHERE {t}.{q('token')} = (SELECT COALESCE(decide.token, 0) FROM decide) "
            f"RETURNING {t}.{q('token')}) "
            "SELECT decide.now, " + ", ".join(f"decide.{q(c)}" for c in RECORD_COLUMNS)
            + ", decide.status, up.token FROM decide LEFT JOIN up ON true")


class SQLRecords(SQLIntents):
    """The record verbs of :class:`~celery_idem.stores.base.Store` on :class:`RecordSQL`'s
    statements, beside the intent verbs; a store gives its statements (``_record_sql``,
    ``_intent_sql``), a way to run one (:meth:`_run_sql`, the intents' seam) and the unit a
    claim's decision and write run in (:meth:`_claim_unit`)."""

    _record_sql: RecordSQL
    #: Where the claim ran out of races, for its StoreUnavailable ("the SQL store at ...").
    _where: str = "the SQL store"

    @abc.abstractmethod
    def _claim_unit(self) -> AbstractContextManager[Run]:
        """Run the statements of one claim as one unit: serialised on SQLite (``BEGIN
        IMMEDIATE``); a unique violation in it raises :class:`ClaimRaced` (a concurrent first
        claim inserted the key)."""

    def _stored(self, key: str) -> str:
        return self.prefix + key

    def _one(self, sql: str, params: Sequence[Any]) -> Sequence[Any] | None:
        """Run one statement: its first row, or None."""
        _, rows = self._run_sql(sql, params)
        return rows[0] if rows else None

    def _record(self, row: Sequence[Any]) -> Record:
        return record_from_row(dict(zip(RECORD_COLUMNS, row, strict=False)), self.prefix,
                               self._record_sql.table)

    def _fence(self, key: str, token: int, claim_id: str | None) -> list[Any]:
        """The parameters of a fenced statement's WHERE."""
        return [self._stored(key), token, claim_id or "", claim_id or ""]

    def claim(self, key: str, *, owner: str, task_id: str, attempt: int, lease: float, ttl: float,
              payload_hash: str | None = None) -> Claim:
        """Claim ``key`` (see :meth:`Store.claim`), deciding on the database clock."""
        args = (self._stored(key), owner, task_id, int(attempt), float(lease), float(ttl),
                payload_hash, new_claim_id())
        for _ in range(_CLAIM_RUNS):
            try:
                if self._record_sql.vendor == "postgresql":
                    return self._claim_in_one(*args)
                return self._claim_select_then_write(*args)
            except ClaimRaced:
                continue  # the winner's row is committed now; the next run sees it
        raise StoreUnavailable(
            f"the claim of {key!r} lost {_CLAIM_RUNS} races in a row in {self._where}: the row "
            f"kept changing between the decision and the write")

    def _claim_in_one(self, stored: str, owner: str, task_id: str, attempt: int, lease: float,
                      ttl: float, payload_hash: str | None, claim_id: str) -> Claim:
        s = self._record_sql
        validate = bool(payload_hash)
        _, decision = s.decide[validate]
        params = [*decision(payload_hash, task_id, attempt), stored, stored,
                  *decision(payload_hash, task_id, attempt),
                  stored, owner, task_id, attempt, lease, payload_hash, ttl, claim_id]
        row = self._one(s.pg_claim[validate], params)
        assert row is not None  # the statement always returns its one "decide" row
        status, taken = row[14], row[15]
        if status in HOLDS and taken is None:
            raise ClaimRaced  # a holding decision without a write lost the race for an absent key
        return self._claim_result(float(row[0]), row[1:14], status, taken, claim_id)

    def _claim_select_then_write(self, stored: str, owner: str, task_id: str, attempt: int,
                                 lease: float, ttl: float, payload_hash: str | None,
                                 claim_id: str) -> Claim:
        # Neither SQLite nor MySQL can return the row an upsert replaced. SQLite serialises the
        # read-decide-write in its unit (BEGIN IMMEDIATE). MySQL stays in autocommit (FOR UPDATE
        # would cost a transaction's two round trips): the write re-checks in SQL that the row
        # still gives the same decision, and one that finds it changed writes nothing and runs again.
        s = self._record_sql
        validate = bool(payload_hash)
        decide, decision = s.decide[validate]
        with self._claim_unit() as run:
            _, rows = run(decide, [*decision(payload_hash, task_id, attempt), stored])
            now, row, status = float(rows[0][0]), rows[0][1:14], rows[0][14]
            if status not in HOLDS:
                return self._claim_result(now, row, status, None, claim_id)
            previous = None if row[0] is None else int(row[2])
            # next_token on the database's clock, read in the decision's statement.
            token = next_token(previous, now)
            new = [stored, State.IN_PROGRESS.value, token, owner, task_id, attempt, now + lease,
                   payload_hash, None, None, now, now + ttl, claim_id]
            if previous is None:
                run(s.insert, new)
            else:
                update, same = s.update_same[validate]
                params = [*new[1:], stored, previous, row[1], *same(payload_hash, task_id, attempt, now),
                          status]
                if run(update, params)[0] != 1:
                    raise ClaimRaced
        return self._claim_result(now, row, status, token, claim_id)

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

    def record(self, key: str, token: int, *, state: State, content_type: str, data: bytes,
               ttl: float, claim_id: str | None = None) -> None:
        """:meth:`Store.record`: one fenced UPDATE."""
        params = self._record_params(key, token, state, content_type, data, ttl, claim_id)
        if self._run_sql(self._record_sql.record, params)[0] != 1:
            self._unmatched_record(key, token, state, claim_id)

    def _record_params(self, key: str, token: int, state: State, content_type: str, data: bytes,
                       ttl: float, claim_id: str | None) -> list[Any]:
        if state not in (State.DONE, State.FAILED):
            raise ValueError(f"record() takes DONE or FAILED, not {state}")
        return [state.value, content_type, bytes(data), float(ttl), *self._fence(key, token, claim_id)]

    def _unmatched_record(self, key: str, token: int, state: State, claim_id: str | None) -> None:
        """A record whose fenced UPDATE matched no row: a retry of ours, or LeaseLost."""
        current = self.get(key)
        if (current is not None and current.token == token and current.state is state
                and (not claim_id or current.claim_id == claim_id)):
            return  # the holder retrying a record whose reply it lost
        raise lease_lost("record", key, token, current, claim_id)

    def release(self, key: str, token: int, *, claim_id: str | None = None) -> None:
        """:meth:`Store.release`: one fenced UPDATE to a RELEASED tombstone that keeps the token."""
        if self._run_sql(self._record_sql.release, self._fence(key, token, claim_id))[0] != 1:
            raise lease_lost("release", key, token, self.get(key), claim_id)

    def renew(self, key: str, token: int, lease: float, *, claim_id: str | None = None) -> float:
        """:meth:`Store.renew` on the database clock: one fenced UPDATE (MySQL/MariaDB: and a
        fenced SELECT of the new lease, LeaseLost if the key was taken over in between)."""
        s, lease = self._record_sql, float(lease)
        params = [lease, lease, lease, *self._fence(key, token, claim_id)]
        row: Sequence[Any] | None = None
        if s.renew_returning is not None:
            row = self._one(s.renew_returning, params)
        elif self._run_sql(s.renew, params)[0] == 1:
            row = self._one(s.renew_read, self._fence(key, token, claim_id))
        if row is None:
            raise lease_lost("renew", key, token, self.get(key), claim_id)
        return float(row[0])

    def forget(self, key: str, token: int) -> None:
        """:meth:`Store.forget`: one UPDATE, fenced by the token, to a RELEASED tombstone."""
        if self._run_sql(self._record_sql.forget, [self._stored(key), token])[0] != 1:
            raise lease_lost("forget", key, token, self.get(key))

    # -- reads --------------------------------------------------------------------------------

    def get(self, key: str) -> Record | None:
        """:meth:`Store.get`; a row whose TTL has passed counts as absent."""
        row = self._one(self._record_sql.get, [self._stored(key)])
        return None if row is None else self._record(row)

    def expires_at(self, key: str) -> float | None:
        """When the row of ``key`` expires (database clock), or None when it is absent."""
        row = self._one(self._record_sql.expires, [self._stored(key)])
        return None if row is None else float(row[0])

    def scan(self, state: State | None = None, count: int = 100) -> Iterator[Record]:
        """This prefix's live records in key order (:func:`keyset`: not a snapshot)."""
        s = self._record_sql
        chosen = [] if state is None else [state.value]
        pages = keyset(self._run_sql, lambda after: s.page(state is not None, after),
                       [*s.own_params, *chosen], count)
        return (self._record(row) for row in pages)

    def now(self) -> float:
        """The database server's clock (epoch seconds)."""
        row = self._one(self._record_sql.clock, [])
        assert row is not None
        return float(row[0])

    def purge_expired(self, limit: int = 1000) -> int:
        """Delete up to ``limit`` of this prefix's rows whose TTL has passed; return how many.

        They count as absent already; this reclaims space (the next claim's token is still
        higher: the clock term). Call again while it returns ``limit``. The clock is read first
        and bound as a value, so PostgreSQL can use the expires index.
        """
        s = self._record_sql
        expired = [*s.own_params, self.now()]
        params = [*expired, int(limit), *expired] if s.purge_twice else [*expired, int(limit)]
        return int(self._run_sql(s.purge, params)[0] or 0)


@contextlib.contextmanager
def immediate(run: Run) -> Iterator[None]:
    """SQLite's ``BEGIN IMMEDIATE ... COMMIT`` around the block (ROLLBACK if it raises), on a
    connection in autocommit: the transaction is ours to open and close."""
    run("BEGIN IMMEDIATE", [])
    try:
        yield
    except BaseException:
        run("ROLLBACK", [])
        raise
    run("COMMIT", [])
