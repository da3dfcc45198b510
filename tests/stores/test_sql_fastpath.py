"""The SQL store's PostgreSQL fast path (psycopg 3): one prepared round trip per verb, and the
same exceptions as the SQLAlchemy path.

On ``postgresql+psycopg`` the store runs its pre-built statements on the pooled psycopg
connection itself (see celery_idem/stores/sql.py). Its semantics are the store contract's,
tested in test_contract.py. Here, against the real server:

* round trips are counted at the wire: libpq's protocol trace of the store's one pooled
  connection, one ``ReadyForQuery`` per round trip; SQLAlchemy's cursor events show that the
  verbs do not go through SQLAlchemy's execution at all;
* errors are compared with the SQLAlchemy path (the same store with ``_fast`` off): the same
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
from celery_idem.exceptions import LeaseLost, StoreUnavailable
from celery_idem.gate import Attempt, Gate
from celery_idem.records import ClaimStatus, State
from celery_idem.stores.sql import SQLStore

from .support import LONG, claim, drop_table, poll


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
    assert store._fast
    wire = Wire(store)

    def every_verb(tag: str) -> None:
        first = claim(store, f"{tag}-a")
        store.record(f"{tag}-a", first.token, state=State.DONE, content_type="application/json",
                     data=b'{"ok": true}', ttl=LONG)
        claim(store, f"{tag}-a")
        claim(store, f"{tag}-v", payload_hash="h1")
        store.renew(f"{tag}-v", 1, LONG)
        store.release(f"{tag}-v", 1)
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
    _, n = trips(lambda: store.renew("b", taken.token, LONG))
    assert n == 1
    _, n = trips(lambda: store.record("b", taken.token, state=State.DONE,
                                      content_type="application/json", data=b"{}", ttl=LONG))
    assert n == 1
    dup, n = trips(lambda: claim(store, "b"))
    assert (dup.status, dup.record and dup.record.data, n) == (ClaimStatus.DONE, b"{}", 1)
    rec, n = trips(lambda: store.get("b"))
    assert (rec and rec.state, n) == (State.DONE, 1)
    validated, n = trips(lambda: claim(store, "c", payload_hash="h2"))
    assert (validated.status, n) == (ClaimStatus.CLAIMED, 1)
    _, n = trips(lambda: store.release("c", validated.token))
    assert n == 1
    # A refused fenced write reads the row once more to say why: two round trips, off the hot path
    with pytest.raises(LeaseLost, match="now has token 1"):
        trips(lambda: store.record("b", 99, state=State.DONE, content_type="x", data=b"", ttl=LONG))

    def refused_release() -> None:
        with pytest.raises(LeaseLost):
            store.release("b", 99)

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
        return gate.run(attempt, lambda token: {"action": action, "token": token})

    run("warm")
    run("warm")
    sa_statements = wire.statements  # creating the table
    result, lines = wire.messages(lambda: run("first"))
    assert (result, round_trips(lines)) == ({"action": "first", "token": 1}, 2)
    result, lines = wire.messages(lambda: run("first"))
    assert (result, round_trips(lines)) == ({"action": "first", "token": 1}, 1)
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
    store._fast = path == "fast"
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
    claim(store, "k")
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
        store.record("k", 1, state=State.DONE, content_type="application/json", data=b"1", ttl=LONG)
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
    claim(store, "k", lease=LONG)
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
    assert rec is not None and (rec.token, rec.owner) == (1, "host:a")
