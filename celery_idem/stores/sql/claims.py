"""The claim strategies: one statement on PostgreSQL, decide-then-write elsewhere.

Both decide with :meth:`~celery_idem.stores.sql.predicates.ClaimArgs.status`; the store picks
one by dialect. Internal to the SQL store package.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import sqlalchemy as sa
from sqlalchemy import exc as sa_exc
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.engine import Connection

from ..base import next_token
from .predicates import HOLDS, LOCKED, ClaimArgs, ClaimRaced
from .schema import db_now, token_for
from .session import Row

__all__ = ["build_pg_claim", "select_then_write", "sqlite_write_transaction"]


def build_pg_claim(table: sa.Table, args: ClaimArgs) -> sa.Select[Any]:
    """The PostgreSQL claim: one statement that decides and, when the claim takes, writes.

    Built once per shape from :func:`~celery_idem.stores.sql.predicates.claim_template`. Its
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
    duplicate of a finished task), that is the answer: the locking branch is skipped by a
    one-time filter and nothing is locked or written, so the transaction gets no xid and its
    commit waits for no WAL flush. The answer is true as of the statement's snapshot, like any
    read's.

    Otherwise the claim decides on the row locked ``FOR UPDATE``: a concurrent claim waits and
    then decides on our row (READ COMMITTED returns the row's latest version). When two claims
    of an absent key run at once, the loser's INSERT meets the winner's row and the token guard
    (expected 0, found >= 1) makes the update a no-op: the statement returns a holding
    decision without an "up" row, and the claim runs again (``ClaimRaced``). The upsert reads
    "decide", so "old" is always locked first.
    """
    t = table
    # The unlocked look at the row, and the decision on it.
    clock = sa.select(db_now().label("now")).subquery("clock")
    peek = (
        sa.select(clock.c.now, *t.c, args.status(t, clock.c.now).label("status"))
        .select_from(clock.outerjoin(t, t.c.key == args.stored_key))
        .cte("peek")
        .prefix_with("MATERIALIZED")
    )
    # Uncorrelated: evaluated once (an InitPlan), it skips the locking scans when false.
    must_lock = sa.exists().where(sa.or_(*(peek.c.status == s for s in LOCKED)))
    old = (
        sa.select(t)
        .where(t.c.key == args.stored_key, must_lock)
        .with_for_update()
        .cte("old")
        .prefix_with("MATERIALIZED")
    )
    # The clock is read in the row that takes the lock, so a claim that waited for the lock
    # decides on the time it got it.
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
                args.status(locked, locked.c.now).label("status"),
            ),
            # NULL (a state we do not know) is answered unlocked too: CorruptRecord.
            sa.select(*peek.c).where(
                sa.or_(peek.c.status.is_(None), sa.and_(*(peek.c.status != s for s in LOCKED)))
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
        sa.select(*values.values()).where(sa.or_(*(decide.c.status == s for s in HOLDS))),
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


def select_then_write(
    conn: Connection, table: sa.Table, dialect: str, args: ClaimArgs
) -> tuple[Row, int | None]:
    """The SQLite and MySQL claim: a SELECT that decides, then a conditional INSERT or UPDATE.

    Returns:
        The decided row (with ``now`` and ``status``) and the token written, None when the
        claim does not take the key.

    Raises:
        ClaimRaced: The row changed between the decision and the write; nothing was written.
    """
    # Neither can return the row an upsert replaced. SQLite serializes the read-decide-write
    # with BEGIN IMMEDIATE (its write lock). MySQL stays in autocommit (FOR UPDATE would cost a
    # transaction's two round trips): the write re-checks in SQL that the row still yields the
    # same decision, and one that finds it changed writes nothing and runs again.
    t = table
    clock = sa.select(db_now().label("now")).subquery("clock")
    status = args.status(t, clock.c.now)
    decide = sa.select(clock.c.now, *t.c, status.label("status")).select_from(
        clock.outerjoin(t, t.c.key == args.stored_key)
    )
    with sqlite_write_transaction(conn, dialect):
        row = conn.execute(decide).mappings().one()
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
            still_same = sa.and_(
                t.c.key == args.stored_key,
                t.c.token == row["token"],
                t.c.state == row["state"],
                args.status(t, sa.literal(now, sa.Double)) == row["status"],
            )
            update = (
                sa.update(t)
                .where(still_same)
                .values({name: value for name, value in values.items() if name != "key"})
            )
            if conn.execute(update).rowcount != 1:
                raise ClaimRaced
    return row, token


@contextlib.contextmanager
def sqlite_write_transaction(conn: Connection, dialect: str) -> Iterator[None]:
    """On SQLite, run the block in ``BEGIN IMMEDIATE ... COMMIT``; elsewhere just run it.

    The engine is in autocommit (pysqlite's own implicit BEGIN is off), so the transaction
    is ours to open and close, as SQLAlchemy's pysqlite documentation recommends.
    """
    if dialect != "sqlite":
        yield
        return
    conn.exec_driver_sql("BEGIN IMMEDIATE")
    try:
        yield
    except BaseException:
        conn.exec_driver_sql("ROLLBACK")
        raise
    conn.exec_driver_sql("COMMIT")
