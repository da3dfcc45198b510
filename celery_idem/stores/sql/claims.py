"""The claim: its decision as one SQL CASE, and the strategies that run it.

:meth:`ClaimArgs.status` is the single SQL definition of the order in
:meth:`celery_idem.stores.base.Store.claim`; PostgreSQL decides and writes in one statement
(:func:`build_pg_claim`), the other dialects decide, then write (:func:`select_then_write`).
Internal to the SQL store package.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Final

import sqlalchemy as sa
from sqlalchemy import exc as sa_exc
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.engine import Connection, RowMapping
from sqlalchemy.sql.elements import ColumnElement
from sqlalchemy.sql.selectable import FromClause

from ...records import ClaimStatus, State
from ..base import ClaimRaced, next_token
from .schema import db_now, token_for

__all__ = ["HOLDS", "ClaimArgs", "build_pg_claim", "select_then_write"]

#: The claim statuses under which the caller holds the key (the claim wrote its row).
HOLDS: Final = (ClaimStatus.CLAIMED.value, ClaimStatus.TAKEOVER.value)
# The statuses the PostgreSQL claim decides again on the locked row (see build_pg_claim).
LOCKED: Final = (*HOLDS, ClaimStatus.BUSY.value)
# The claim arguments' SQL types as bind parameters (the others are strings).
_BIND_TYPES: Final = {"attempt": sa.Integer, "lease": sa.Double, "ttl": sa.Double}


@dataclass(frozen=True)
class ClaimArgs:
    """One claim's arguments (plain values, or a :meth:`template`'s bind parameters) and their SQL."""

    key: str  # the stored key (prefix + key)
    owner: str
    task_id: str
    attempt: int
    lease: float
    ttl: float
    payload_hash: str | None
    claim_id: str

    def status(self, row: FromClause, now: ColumnElement[float]) -> ColumnElement[str | None]:
        """The decision on ``row`` (NULLs: absent) at ``now`` in the order of
        :meth:`Store.claim`, as a CASE (NULL for an unknown state)."""
        c = row.c
        in_progress = c.state == State.IN_PROGRESS.value
        lease_expired = sa.and_(c.lease_expires.is_not(None), c.lease_expires <= now)
        earlier_attempt_of_same_task = sa.and_(c.task_id == self.task_id, c.attempt < self.attempt)
        # A validating caller (a hash given) refuses a record with another hash or with none.
        validating = isinstance(self.payload_hash, sa.BindParameter) or self.payload_hash
        payload_mismatch = (sa.or_(c.payload_hash.is_(None), c.payload_hash != self.payload_hash)
                            if validating else sa.false())
        return sa.case(
            (sa.or_(c.key.is_(None), c.expires <= now, c.state == State.RELEASED.value),
             ClaimStatus.CLAIMED.value),
            (payload_mismatch, ClaimStatus.MISMATCH.value),
            (c.state == State.DONE.value, ClaimStatus.DONE.value),
            (c.state == State.FAILED.value, ClaimStatus.FAILED.value),
            (sa.and_(in_progress, sa.or_(lease_expired, earlier_attempt_of_same_task)),
             ClaimStatus.TAKEOVER.value),
            (in_progress, ClaimStatus.BUSY.value),
            else_=sa.null())

    @classmethod
    def template(cls, validate: bool) -> ClaimArgs:
        """The arguments as ``idem_<name>`` bind parameters, to build a claim statement once."""
        binds: dict[str, Any] = {
            f.name: sa.bindparam(f"idem_{f.name}", type_=_BIND_TYPES.get(f.name, sa.String))
            for f in dataclasses.fields(cls)}
        if not validate:
            binds["payload_hash"] = None  # validation changes the predicates' shape (constant false)
        return cls(**binds)

    def params(self) -> dict[str, Any]:
        """This claim's values of :meth:`template`'s parameters."""
        return {f"idem_{name}": value for name, value in vars(self).items()}

    def values(self, *, now: ColumnElement[float], token: Any) -> dict[str, Any]:
        """The IN_PROGRESS row a taking claim writes, in column order."""
        return {
            "key": self.key, "state": sa.literal(State.IN_PROGRESS.value, sa.String), "token": token,
            "owner": self.owner, "task_id": self.task_id, "attempt": self.attempt,
            "lease_expires": now + self.lease,
            "payload_hash": sa.null() if self.payload_hash is None else self.payload_hash,
            "content_type": sa.null(), "data": sa.null(), "updated": now, "expires": now + self.ttl,
            "claim_id": self.claim_id}


def _decide(t: sa.Table, args: ClaimArgs) -> sa.Select[Any]:
    """The unlocked look at the key's row (NULLs when absent) with ``now`` and ``status``."""
    clock = sa.select(db_now().label("now")).subquery("clock")
    return sa.select(clock.c.now, *t.c, args.status(t, clock.c.now).label("status")).select_from(
        clock.outerjoin(t, t.c.key == args.key))


def build_pg_claim(table: sa.Table, validate: bool) -> sa.Select[Any]:
    """The PostgreSQL claim: one statement that decides and, when the claim takes, writes.

    Built once per shape (``validate``: with a payload hash) on :meth:`ClaimArgs.template`. Its
    one row is the decision (``status``, the clock ``now``, the row decided on) and
    ``taken_token``, the token written (NULL when nothing was)::

        WITH peek   AS MATERIALIZED (SELECT now, t.*, CASE <predicates> END AS status
                                     FROM (SELECT <db clock> AS now) clock
                                     LEFT JOIN t ON t.key = :k),
             old    AS MATERIALIZED (SELECT * FROM t WHERE key = :k AND <must lock> FOR UPDATE),
             locked AS MATERIALIZED (SELECT <db clock> AS now, old.*
                                     FROM (SELECT 1) one LEFT JOIN old ON true
                                     WHERE <must lock>),
             decide AS MATERIALIZED (SELECT locked.*, CASE <predicates> END FROM locked
                                     UNION ALL
                                     SELECT * FROM peek WHERE NOT <must lock>),
             up     AS (INSERT INTO t SELECT ... FROM decide
                        WHERE status IN ('claimed', 'takeover')
                        ON CONFLICT (key) DO UPDATE SET ... WHERE t.token = excluded.token - 1
                        RETURNING token)
        SELECT decide.*, up.token FROM decide LEFT JOIN up ON true
          where <must lock> = EXISTS (SELECT FROM peek WHERE status IN ('claimed', 'takeover', 'busy'))

    "peek" reads the row without a lock. When it decides DONE, FAILED or MISMATCH (the
    duplicate of a finished task), that is the answer (as of the statement's snapshot, like any
    read's): the locking branch is skipped by a one-time filter and nothing is locked or
    written, so the transaction gets no xid and its commit waits for no WAL flush.

    Otherwise the claim decides on the row locked ``FOR UPDATE``: a concurrent claim waits, then
    decides on our row (READ COMMITTED returns its latest version). When two claims of an absent
    key run at once, the loser's INSERT meets the winner's row and the token guard (expected 0,
    found >= 1) makes the update a no-op: a holding decision without an "up" row, and the claim
    runs again (``ClaimRaced``). The upsert reads "decide", so "old" is always locked first.
    """
    t = table
    args = ClaimArgs.template(validate)
    peek = _decide(t, args).cte("peek").prefix_with("MATERIALIZED")
    # Uncorrelated: evaluated once (an InitPlan), it skips the locking scans when false.
    must_lock = sa.exists().where(sa.or_(*(peek.c.status == s for s in LOCKED)))
    old = sa.select(t).where(t.c.key == args.key, must_lock).with_for_update().cte("old") \
        .prefix_with("MATERIALIZED")
    # The clock is read in the row that takes the lock, so a claim that waited for the lock
    # decides on the time it got it.
    one = sa.select(sa.literal(1).label("one")).subquery("one")
    locked = sa.select(db_now().label("now"), *old.c).select_from(one.outerjoin(old, sa.true())) \
        .where(must_lock).cte("locked").prefix_with("MATERIALIZED")
    decide = (
        sa.union_all(
            sa.select(locked.c.now, *(locked.c[c.name] for c in t.c),
                      args.status(locked, locked.c.now).label("status")),
            # NULL (a state we do not know) is answered unlocked too: CorruptRecord.
            sa.select(*peek.c).where(
                sa.or_(peek.c.status.is_(None), sa.and_(*(peek.c.status != s for s in LOCKED)))))
        .cte("decide")
        .prefix_with("MATERIALIZED"))
    values = args.values(now=decide.c.now, token=token_for(decide.c.token, decide.c.now))
    # Not IN (...): SQLAlchemy expands an IN list at execution time (not the compile-once path).
    insert = pg_insert(t).from_select(
        list(values), sa.select(*values.values()).where(sa.or_(*(decide.c.status == s for s in HOLDS))))
    up = (
        insert.on_conflict_do_update(
            index_elements=[t.c.key],
            set_={name: insert.excluded[name] for name in values if name != "key"},
            # The row met must be the row decided on: its token (0: none, the key was
            # absent and a concurrent first claim inserted it; nothing is written).
            where=t.c.token == sa.select(sa.func.coalesce(decide.c.token, 0)).scalar_subquery())
        .returning(t.c.token)
        .cte("up"))
    return sa.select(decide, up.c.token.label("taken_token")).select_from(
        decide.outerjoin(up, sa.true()))


def select_then_write(conn: Connection, table: sa.Table, dialect: str,
                      args: ClaimArgs) -> tuple[RowMapping, int | None]:
    """The SQLite and MySQL claim: a SELECT that decides, then a conditional INSERT or UPDATE.

    Returns the decided row (with ``now`` and ``status``) and the token written (None when the
    claim does not take the key); raises :class:`ClaimRaced` when the row changed in between.
    """
    # Neither can return the row an upsert replaced. SQLite serializes the read-decide-write
    # with BEGIN IMMEDIATE (its write lock). MySQL stays in autocommit (FOR UPDATE would cost a
    # transaction's two round trips): the write re-checks in SQL that the row still yields the
    # same decision, and one that finds it changed writes nothing and runs again.
    t = table
    with _immediate_transaction(conn) if dialect == "sqlite" else contextlib.nullcontext():
        row = conn.execute(_decide(t, args)).mappings().one()
        if row["status"] not in HOLDS:
            return row, None
        now = float(row["now"])
        # next_token on the database's clock, read in the decision's statement.
        token = next_token(None if row["key"] is None else int(row["token"]), now)
        values = args.values(now=sa.literal(now, sa.Double), token=token)
        if row["key"] is None:
            try:
                conn.execute(sa.insert(t).values(values))
            except sa_exc.IntegrityError:
                raise ClaimRaced from None  # a concurrent first claim inserted the key
        else:
            still_same = sa.and_(t.c.key == args.key, t.c.token == row["token"], t.c.state == row["state"],
                                 args.status(t, sa.literal(now, sa.Double)) == row["status"])
            update = sa.update(t).where(still_same).values(
                {name: value for name, value in values.items() if name != "key"})
            if conn.execute(update).rowcount != 1:
                raise ClaimRaced
    return row, token


@contextlib.contextmanager
def _immediate_transaction(conn: Connection) -> Iterator[None]:
    """SQLite's ``BEGIN IMMEDIATE ... COMMIT`` around the block (ROLLBACK if it raises); the
    engine is in autocommit, so the transaction is ours to open and close."""
    conn.exec_driver_sql("BEGIN IMMEDIATE")
    try:
        yield
    except BaseException:
        conn.exec_driver_sql("ROLLBACK")
        raise
    conn.exec_driver_sql("COMMIT")
