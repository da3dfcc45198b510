"""The SQL store's PostgreSQL fast path (psycopg 3): one prepared round trip per verb, and the
same exceptions as the SQLAlchemy path.

On ``postgresql+psycopg`` the store runs its pre-built statements on the pooled psycopg
connection itself (see celery_idem/stores/sql/psycopg.py). Its semantics are the store contract's,
tested in test_contract.py. Here, against the real server:

* round trips are counted at the wire: libpq's protocol trace of the store's one pooled
  connection, one ``ReadyForQuery`` per round trip; SQLAlchemy's cursor events show that the
  verbs do not go through SQLAlchemy's execution at all;
* errors are compared with the SQLAlchemy path (the same store with ``_psycopg`` None): the same
  exception types, the pool recovering the same way after the server drops its connections;
* a verb interrupted mid-query (a soft time limit) must not hand its busy connection back.

Every test has its own table and drops it.
"""

from __future__ import annotations

import contextlib
import signal
import tempfile
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from billiard.exceptions import SoftTimeLimitExceeded
from celery import Celery

from celery_idem import IdempotentTask
from celery_idem.codec import KombuCodec
from celery_idem.config import accelerate_switch
from celery_idem.exceptions import LeaseLost, StoreUnavailable
from celery_idem.gate import Attempt, Gate
from celery_idem.records import ClaimStatus, State
from celery_idem.stores.sql import SQLStore
from celery_idem.stores.sql.psycopg import KEPT_CURSOR, KEPT_RESULT_BYTES, RawSession
from celery_idem.stores.sql.store import SASession

from .support import LONG, claim, drop_table, poll

# The SQL store's wire traffic: no Celery, kombu or redis-py version changes what it asserts
# (the one Celery task below only names a key), so make test-compat runs it once (pyproject.toml).
# An acceleration's own tests: with accelerations off (make test-plain) the store has no psycopg
# path to compare with.
pytestmark = [pytest.mark.celery_independent,
              pytest.mark.skipif(not accelerate_switch(),
                                 reason="accelerations off (CELERY_IDEM_ACCELERATE)")]


class Wire:
    """libpq's protocol trace of every connection the store's pool opens."""

    def __init__(self, store: SQLStore) -> None:
        self.connections: list[Any] = []  # psycopg connections, in the order they were opened
        self.statements = 0  # statements SQLAlchemy executed (its cursor events)
        sa.event.listen(store._engine, "connect", lambda dbapi_conn, _: self.connections.append(dbapi_conn))
        sa.event.listen(store._engine, "before_cursor_execute", self._count)

    def _count(self, *_: Any) -> None:
        self.statements += 1

    def messages(self, fn: Callable[[], Any]) -> tuple[Any, list[str]]:
        """Run ``fn`` with every open connection traced; its result and the messages, in order."""
        from psycopg.pq import Trace

        with contextlib.ExitStack() as files:
            traced = []
            for conn in self.connections:
                if not conn.closed:
                    f = files.enter_context(tempfile.TemporaryFile(mode="w+"))
                    conn.pgconn.trace(f.fileno())
                    conn.pgconn.set_trace_flags(Trace.SUPPRESS_TIMESTAMPS | Trace.REGRESS_MODE)
                    traced.append((conn, f))
            try:
                result = fn()
            finally:
                lines: list[str] = []
                for conn, f in traced:
                    if not conn.closed:
                        conn.pgconn.untrace()  # flushes libpq's buffer
                    f.seek(0)
                    lines += f.read().splitlines()
            return result, lines


def round_trips(lines: list[str]) -> int:
    # The client ends each exchange with Sync; the server's ReadyForQuery closes it.
    return sum(1 for line in lines if line.startswith("B") and "ReadyForQuery" in line)


def parses(lines: list[str]) -> int:
    return sum(1 for line in lines if line.startswith("F") and "\tParse\t" in line)


@pytest.fixture
def make_store(pg_url: str) -> Iterator[Callable[..., SQLStore]]:
    stores: list[SQLStore] = []
    table = f"t_{uuid.uuid4().hex[:12]}"

    def make(**engine_options: Any) -> SQLStore:
        store = SQLStore.from_url("db+" + pg_url, prefix="fast:", table_name=table,
                                  engine_options=engine_options)
        stores.append(store)
        return store

    yield make
    try:
        if stores:
            drop_table(stores[0])
    finally:
        for store in stores:
            store.close()


def _gate(store: SQLStore) -> tuple[Gate, Any]:
    app = Celery("fastpath", set_as_current=False)
    app.conf.update(idempotency_store=store, idempotency_key_prefix="fast:")

    @app.task(shared=False, name="fastpath.noop", base=IdempotentTask, idempotency_fields=("action",))
    def noop(action: str) -> dict[str, Any]:
        return {"action": action}

    task = app.tasks["fastpath.noop"]
    return Gate(store, task.idempotency_config, KombuCodec("json", ["json"])), task


def test_each_verb_is_one_prepared_round_trip_outside_sqlalchemy(make_store: Callable[..., SQLStore]) -> None:
    # Given a store with one pooled connection, traced at the wire, whose statements have all
    # run once (psycopg prepares a statement on its first run on a connection)
    store = make_store(pool_size=1, max_overflow=0)
    assert store._psycopg is not None
    wire = Wire(store)

    def every_verb(tag: str) -> None:
        first = claim(store, f"{tag}-a")
        store.record(f"{tag}-a", first.token, state=State.DONE, content_type="application/json",
                     data=b'{"ok": true}', ttl=LONG)
        claim(store, f"{tag}-a")
        held = claim(store, f"{tag}-v", payload_hash="h1")
        store.renew(f"{tag}-v", held.token, LONG, claim_id=held.claim_id)
        store.release(f"{tag}-v", held.token, claim_id=held.claim_id)
        store.get(f"{tag}-a")

    every_verb("warm")
    assert len(wire.connections) == 1
    sa_statements = wire.statements

    # When each verb runs again on other keys, Then each is exactly one round trip, running a
    # statement prepared before (no Parse), and SQLAlchemy executes nothing
    def trips(fn: Callable[[], Any]) -> tuple[Any, int]:
        result, lines = wire.messages(fn)
        assert parses(lines) == 0, lines
        assert any("\tBind\t" in line and '"_pg3_' in line for line in lines), lines
        return result, round_trips(lines)

    taken, n = trips(lambda: claim(store, "b"))
    assert (taken.status, n) == (ClaimStatus.CLAIMED, 1)
    _, n = trips(lambda: store.renew("b", taken.token, LONG, claim_id=taken.claim_id))
    assert n == 1
    _, n = trips(lambda: store.record("b", taken.token, state=State.DONE,
                                      content_type="application/json", data=b"{}", ttl=LONG,
                                      claim_id=taken.claim_id))
    assert n == 1
    dup, n = trips(lambda: claim(store, "b"))
    assert (dup.status, dup.record and dup.record.data, n) == (ClaimStatus.DONE, b"{}", 1)
    rec, n = trips(lambda: store.get("b"))
    assert (rec and rec.state, n) == (State.DONE, 1)
    validated, n = trips(lambda: claim(store, "c", payload_hash="h2"))
    assert (validated.status, n) == (ClaimStatus.CLAIMED, 1)
    _, n = trips(lambda: store.release("c", validated.token, claim_id=validated.claim_id))
    assert n == 1
    # A refused fenced write reads the row once more to say why: two round trips, off the hot path
    with pytest.raises(LeaseLost, match=f"now has token {taken.token}"):
        trips(lambda: store.record("b", taken.token + 99, state=State.DONE, content_type="x",
                                   data=b"", ttl=LONG))

    def refused_release() -> None:
        with pytest.raises(LeaseLost):
            # A wrong token of the same width as real ones (psycopg sends a small int as int2,
            # which would need a statement of its own)
            store.release("b", taken.token + 99)

    _, lines = wire.messages(refused_release)
    assert round_trips(lines) == 2
    assert wire.statements == sa_statements


def test_the_gate_takes_two_round_trips_on_a_first_run_and_one_on_a_duplicate(
    make_store: Callable[..., SQLStore],
) -> None:
    store = make_store(pool_size=1, max_overflow=0)
    wire = Wire(store)
    gate, task = _gate(store)

    def run(action: str) -> Any:
        attempt = Attempt(key=task.idempotency_key_for((action,)), task_id=str(uuid.uuid4()), owner="h:1")
        return gate.run(attempt, lambda token: {"action": action, "token": token}).value

    run("warm")
    run("warm")
    sa_statements = wire.statements  # creating the table
    result, lines = wire.messages(lambda: run("first"))
    token = result["token"]
    assert isinstance(token, int) and token > 1_000_000_000_000_000  # a clock token
    assert (result, round_trips(lines)) == ({"action": "first", "token": token}, 2)
    result, lines = wire.messages(lambda: run("first"))
    assert (result, round_trips(lines)) == ({"action": "first", "token": token}, 1)
    assert wire.statements == sa_statements


def test_a_statement_is_prepared_once_per_connection_unless_psycopg_is_told_not_to(
    make_store: Callable[..., SQLStore],
) -> None:
    # psycopg prepares on the first run: one extra round trip (Parse), once per connection
    prepared = make_store(pool_size=1, max_overflow=0)
    wire = Wire(prepared)
    prepared.now()  # the table and the connection exist
    _, lines = wire.messages(lambda: prepared.get("x"))
    assert (parses(lines), round_trips(lines)) == (1, 2)
    _, lines = wire.messages(lambda: prepared.get("x"))
    assert (parses(lines), round_trips(lines)) == (0, 1)
    # With prepare_threshold=None (PgBouncer in transaction mode before 1.21), nothing is
    # prepared: every run sends its unnamed statement, still in one round trip
    unprepared = make_store(pool_size=1, max_overflow=0, connect_args={"prepare_threshold": None})
    wire = Wire(unprepared)
    unprepared.now()
    for _ in range(3):
        _, lines = wire.messages(lambda: unprepared.get("x"))
        assert round_trips(lines) == 1
        assert [line for line in lines if "\tParse\t" in line and '"_pg3_' in line] == []


@pytest.fixture(params=["fast", "sqlalchemy"])
def path(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _on(path: str, store: SQLStore) -> SQLStore:
    if path != "fast":
        store._psycopg = None
    return store


def test_a_database_error_propagates_as_sqlalchemys_and_leaves_the_connection_usable(
    make_store: Callable[..., SQLStore], path: str
) -> None:
    store = _on(path, make_store(pool_size=1, max_overflow=0))
    claim(store, "k")
    # A key longer than the column is a bug of the caller, not an outage: SQLAlchemy's
    # DataError, as it was before the fast path
    with pytest.raises(sa.exc.DataError, match="too long") as info:
        claim(store, "x" * 300)
    assert not isinstance(info.value, StoreUnavailable)
    assert not info.value.connection_invalidated
    rec = store.get("k")
    assert rec is not None and rec.state is State.IN_PROGRESS


def test_connections_the_server_dropped_cost_one_verb_then_the_pool_recovers(
    make_store: Callable[..., SQLStore], pg_url: str, path: str
) -> None:
    # Given two idle pooled connections, both terminated by the server (a restart)
    store = _on(path, make_store(pool_size=2, max_overflow=0))
    held = claim(store, "k")
    with store._engine.connect() as c1, store._engine.connect() as c2:
        pids = [c.exec_driver_sql("SELECT pg_backend_pid()").scalar() for c in (c1, c2)]
    admin = sa.create_engine(pg_url, isolation_level="AUTOCOMMIT")  # fresh statistics each poll
    try:
        with admin.connect() as conn:
            for pid in pids:
                conn.execute(sa.text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
            poll(_AdminClock(conn), lambda: _gone(conn, pids), "terminated backends")  # type: ignore[arg-type]
    finally:
        admin.dispose()
    # When verbs run, Then the first is StoreUnavailable caused by SQLAlchemy's
    # OperationalError, and every later one works: the pool dropped both dead connections
    with pytest.raises(StoreUnavailable, match="could not reach the SQL store") as info:
        store.record("k", held.token, state=State.DONE, content_type="application/json", data=b"1",
                     ttl=LONG, claim_id=held.claim_id)
    assert isinstance(info.value.__cause__, sa.exc.OperationalError)
    assert info.value.__cause__.connection_invalidated
    for _ in range(3):
        assert claim(store, "k").status is ClaimStatus.BUSY  # the record did not happen


class _AdminClock:
    """``poll``'s clock from the admin connection (the store's own connections are dead)."""

    def __init__(self, conn: sa.Connection) -> None:
        self.conn = conn

    def now(self) -> float:
        return float(self.conn.exec_driver_sql("SELECT EXTRACT(EPOCH FROM clock_timestamp())").scalar_one())


def _gone(conn: sa.Connection, pids: list[int]) -> bool:
    alive = conn.execute(sa.text("SELECT count(*) FROM pg_stat_activity WHERE pid = ANY(:pids)"),
                         {"pids": pids}).scalar_one()
    return alive == 0


def test_a_verb_interrupted_mid_query_does_not_return_its_busy_connection(
    make_store: Callable[..., SQLStore], pg_url: str
) -> None:
    # Given a row locked by another session, so a claim of it blocks inside the database
    store = make_store(pool_size=1, max_overflow=0)
    wire = Wire(store)
    held = claim(store, "k", lease=LONG)
    holder = sa.create_engine(pg_url)
    conn = holder.connect()
    trans = conn.begin()
    conn.execute(sa.text(f"SELECT 1 FROM {store._table.name} WHERE key = 'fast:k' FOR UPDATE"))

    # When Celery's soft time limit fires while the claim waits for the lock
    def soft_time_limit(*_: Any) -> None:
        raise SoftTimeLimitExceeded("soft time limit")

    assert threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGALRM, soft_time_limit)
    try:
        # The claim blocks on the lock until the alarm: a generous delay costs nothing and
        # makes sure, on a loaded machine, the query is on the wire when the alarm fires
        signal.setitimer(signal.ITIMER_REAL, 2.0)
        with pytest.raises(SoftTimeLimitExceeded):
            claim(store, "k", who="b")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        trans.rollback()
        conn.close()
        holder.dispose()
    # Then the connection with the query still running is not pooled, and the next verb gets
    # a fresh one and the right answer (a pooled busy connection would fail it)
    [interrupted] = wire.connections
    assert interrupted.closed
    assert claim(store, "k", who="b").status is ClaimStatus.BUSY
    assert len(wire.connections) == 2
    rec = store.get("k")
    assert rec is not None and (rec.token, rec.owner) == (held.token, "host:a")


# -- a duplicate claim of a finished key locks and writes nothing -------------------------------


def _finished_keys(store: SQLStore) -> dict[str, tuple[ClaimStatus, str | None]]:
    """Keys a second claim finds finished, each with that claim's status and payload hash."""
    done, failed, mismatch, mismatch_held = (claim(store, k, payload_hash="h1")
                                             for k in ("done", "failed", "mismatch", "mismatch-held"))
    for key, taken, state in (("done", done, State.DONE), ("failed", failed, State.FAILED),
                              ("mismatch", mismatch, State.DONE)):
        store.record(key, taken.token, state=state, content_type="application/json", data=b"1", ttl=LONG)
    assert mismatch_held.status is ClaimStatus.CLAIMED  # still in progress, with another hash
    return {"done": (ClaimStatus.DONE, "h1"), "failed": (ClaimStatus.FAILED, "h1"),
            "mismatch": (ClaimStatus.MISMATCH, "h2"), "mismatch-held": (ClaimStatus.MISMATCH, "h2")}


def _claim_in_a_transaction(store: SQLStore, key: str, payload_hash: str | None) -> tuple[ClaimStatus, Any]:
    """Run the store's PostgreSQL claim, as the store runs it, inside a transaction of ours.

    Returns its status and ``txid_current_if_assigned()`` just after it: PostgreSQL assigns a
    transaction id at its first write (a row lock included), so None means nothing was
    written, and the commit would have had no WAL to flush. The transaction is rolled back.
    """
    with store._engine.connect() as conn:
        fairy = conn.connection
        driver = fairy.driver_connection
        assert driver is not None
        with driver.transaction(force_rollback=True):  # BEGIN on the store's autocommit connection
            session = RawSession(store._psycopg, fairy) if store._psycopg else SASession(conn)
            # The store's statements on this session (an instance attribute over the method).
            store._run_sql = session.run  # type: ignore[method-assign]
            try:
                result = store.claim(key, owner="host:b", task_id="task-b", attempt=0, lease=LONG,
                                     ttl=LONG, payload_hash=payload_hash)
            finally:
                del store._run_sql
            xid = driver.execute("SELECT txid_current_if_assigned()").fetchone()
    assert xid is not None
    return result.status, xid[0]


def test_a_claim_that_finds_the_key_finished_assigns_no_transaction_id(
    make_store: Callable[..., SQLStore], path: str
) -> None:
    # Given keys whose next claim is DONE, FAILED or MISMATCH, one held (BUSY) and one absent
    store = _on(path, make_store(pool_size=1, max_overflow=0))
    finished = _finished_keys(store)
    claim(store, "held")
    # When each is claimed inside a transaction we control, Then the finished ones wrote
    # nothing: no transaction id (so no row lock, no WAL, no commit flush)
    for key, (status, payload_hash) in finished.items():
        assert _claim_in_a_transaction(store, key, payload_hash) == (status, None), key
    # And the others still lock or write (the check can tell): a BUSY claim locks the row it
    # decides on, a first claim inserts one (rolled back)
    status, xid = _claim_in_a_transaction(store, "held", None)
    assert (status, xid is not None) == (ClaimStatus.BUSY, True)
    status, xid = _claim_in_a_transaction(store, "absent", None)
    assert (status, xid is not None) == (ClaimStatus.CLAIMED, True)
    assert store.get("absent") is None


def test_a_claim_that_finds_the_key_finished_does_not_wait_for_a_row_lock(
    make_store: Callable[..., SQLStore], pg_url: str, path: str
) -> None:
    # Given finished keys, a held key, and another session holding a lock on all their rows;
    # the store's sessions give up waiting for a lock after a second (a bound, not a timing)
    store = _on(path, make_store(pool_size=1, max_overflow=0,
                                 connect_args={"options": "-c lock_timeout=1000"}))
    finished = _finished_keys(store)
    claim(store, "held")
    holder = sa.create_engine(pg_url)
    try:
        with holder.connect() as conn, conn.begin():
            locked = conn.execute(sa.text(f"SELECT key FROM {store._table.name} FOR UPDATE")).all()
            assert len(locked) == len(finished) + 1
            # When they are claimed again, Then the finished ones answer at once, read unlocked
            for key, (status, payload_hash) in finished.items():
                dup = claim(store, key, who="b", payload_hash=payload_hash)
                assert dup.status is status, key
                assert dup.record is not None and dup.record.owner == "host:a"
            # And a claim that may take the key waits for the lock (here: until lock_timeout)
            with pytest.raises(StoreUnavailable, match="lock timeout"):
                claim(store, "held", who="b")
    finally:
        holder.dispose()
    assert claim(store, "held", who="b").status is ClaimStatus.BUSY


# -- the statements as the fast path sends them ---------------------------------------------------


def test_a_statements_text_runs_numbered_and_as_written_with_its_literals_intact(
    make_store: Callable[..., SQLStore],
) -> None:
    # Given a statement's text with literals that need quoting and escaping (a quote, a percent
    # sign, %% in the driver's SQL), run by a store whose cursors are psycopg's RawCursor (the
    # default) and by one whose connections have a cursor class of their own (the %s SQL)
    import psycopg

    opened: list[Any] = []

    class OwnCursor(psycopg.Cursor[Any]):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            opened.append(self)
            super().__init__(*args, **kwargs)

    numbered, named = make_store(), make_store(connect_args={"cursor_factory": OwnCursor})
    token = claim(numbered, "k").token
    sql = (f"SELECT owner, 'it''s 100%%' AS note FROM {numbered._table.name} WHERE key = %s "
           f"AND task_id <> 'x''%%' AND token = %s AND key = %s")
    assert numbered._psycopg is not None
    raw = numbered._psycopg.numbered(sql)
    assert (b"$3" in raw, b"%s" in raw, b"'it''s 100%'" in raw, b"'x''%'" in raw) == (True, False, True, True)
    # When both run it, Then both get the literals back as they were written
    params = ["fast:k", token, "fast:k"]
    expected = (1, [("host:a", "it's 100%")])
    assert numbered._run_sql(sql, params) == expected
    assert opened == []
    named.now()  # its connection is open (SQLAlchemy's own queries use the class too)
    opened.clear()
    assert named._run_sql(sql, params) == expected
    assert len(opened) == 1


def test_every_verb_works_on_connections_with_their_own_cursor_class(
    make_store: Callable[..., SQLStore],
) -> None:
    # Given connections whose cursor class is the application's (or psycopg older than 3.2,
    # without RawCursor): the fast path sends the %(name)s SQL through that class
    import psycopg

    opened: list[Any] = []

    class OwnCursor(psycopg.Cursor[Any]):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            opened.append(self)
            super().__init__(*args, **kwargs)

    store = make_store(connect_args={"cursor_factory": OwnCursor})
    store.now()  # the connection and the table exist
    opened.clear()
    # When every verb runs, Then each answers as on the numbered SQL (the contract's answers)
    taken = claim(store, "k", payload_hash="h1")
    assert taken.status is ClaimStatus.CLAIMED and taken.claim_id
    assert claim(store, "k", who="b", payload_hash="h1").status is ClaimStatus.BUSY
    assert claim(store, "k", who="b", payload_hash="h2").status is ClaimStatus.MISMATCH
    assert store.renew("k", taken.token, LONG, claim_id=taken.claim_id) > taken.now
    store.record("k", taken.token, state=State.DONE, content_type="application/json", data=b"[1]",
                 ttl=LONG, claim_id=taken.claim_id)
    dup = claim(store, "k", who="b", payload_hash="h1")
    assert (dup.status, dup.record and dup.record.data) == (ClaimStatus.DONE, b"[1]")
    rec = store.get("k")
    assert rec is not None and rec.state is State.DONE
    released = claim(store, "r")
    store.release("r", released.token, claim_id=released.claim_id)
    assert claim(store, "r", who="b").token > released.token
    with pytest.raises(LeaseLost):
        store.release("r", released.token, claim_id=released.claim_id)
    assert len(opened) == 12  # one cursor per statement, the refused release's second read included


def test_one_cursor_is_kept_per_pooled_connection_unless_it_holds_a_large_result(
    make_store: Callable[..., SQLStore],
) -> None:
    store = make_store(pool_size=1, max_overflow=0)

    def kept() -> Any:
        fairy = store._engine.raw_connection()  # the pool's one connection
        try:
            return fairy.info.get(KEPT_CURSOR)
        finally:
            fairy.close()

    # Given a connection that ran a verb, Then every later verb runs on the same cursor
    taken = claim(store, "k")
    first = kept()
    assert first is not None and not first.closed
    store.record("k", taken.token, state=State.DONE, content_type="c", data=b"small", ttl=LONG)
    assert claim(store, "k", who="b").status is ClaimStatus.DONE
    rec = store.get("k")
    assert rec is not None and rec.data == b"small"
    assert kept() is first
    # When a verb reads a result larger than the cursor may hold on to, Then it is closed, and
    # the next verb gets a new one
    big = b"x" * (KEPT_RESULT_BYTES + 1)
    taken = claim(store, "big")
    store.record("big", taken.token, state=State.DONE, content_type="c", data=big, ttl=LONG)
    assert kept() is first
    rec = store.get("big")
    assert rec is not None and rec.data == big
    assert (kept(), first.closed) == (None, True)
    store.get("k")
    second = kept()
    assert second is not None and second is not first
    # And a verb that fails does not keep its cursor either
    with pytest.raises(sa.exc.DataError):
        claim(store, "x" * 300)
    assert (kept(), second.closed) == (None, True)
    assert claim(store, "k", who="c").status is ClaimStatus.DONE
