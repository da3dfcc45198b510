"""What only the SQL store does: PostgreSQL, MariaDB/MySQL and SQLite.

The store contract itself (claim, record, release, renew, get, scan, TTLs, fencing) is tested
for every store, this one included, in test_contract.py. Here: forked processes, the table
created by racing workers, uncommitted rows, ``purge_expired``, rows written
by hand, unreachable servers and the database clock. The engine's URLs, drivers and settings are
test_sql_engine.py's; the tables' types and migration, test_sql_schema.py's.

Every test gets its own table (``t_<hex>``) and drops it afterwards. A server that does not
answer skips its tests locally and fails them in CI (``CI=true``), through tests/conftest.py.
"""

from __future__ import annotations

import multiprocessing
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from celery_idem.exceptions import CorruptRecord, StoreUnavailable
from celery_idem.records import ClaimStatus, State
from celery_idem.stores import store_from_url
from celery_idem.stores.sql import SQLStore
from tests.conftest import store_kinds

from .support import DEADLINE, LONG, claim, drop_table, poll

# SQLAlchemy and the database drivers only: no Celery, kombu or redis-py (make test-compat).
pytestmark = pytest.mark.celery_independent


@pytest.fixture(params=store_kinds("postgresql", "mysql", "sqlite"))
def backend_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"db+sqlite:///{tmp_path / 'idem.db'}"
    return "db+" + request.getfixturevalue("pg_url" if request.param == "postgresql" else "mysql_url")


@pytest.fixture
def table_name() -> str:
    return f"t_{uuid.uuid4().hex[:12]}"


@pytest.fixture
def make_store(backend_url: str, table_name: str) -> Iterator[Callable[..., SQLStore]]:
    """Build stores on this test's table (several prefixes may share it); drop it at the end."""
    stores: list[SQLStore] = []

    def make(prefix: str = "celery-idem:") -> SQLStore:
        store = SQLStore.from_url(backend_url, prefix=prefix, table_name=table_name)
        stores.append(store)
        return store

    yield make
    try:
        if stores:
            drop_table(stores[0])
    finally:
        for store in stores:
            store.close()


@pytest.fixture
def store(make_store: Callable[..., SQLStore]) -> SQLStore:
    return make_store()


def raw_rows(store: SQLStore) -> list[dict[str, Any]]:
    with store._engine.connect() as conn:
        return [dict(r) for r in conn.execute(sa.select(store._table)).mappings()]


# -- concurrency ------------------------------------------------------------------------------


def _lock_waits(store: SQLStore) -> int:
    """How many sessions wait for a row lock (0 on SQLite, which cannot tell).

    MariaDB does not always list an autocommit INSERT blocked on an uncommitted duplicate key as
    ``LOCK WAIT`` in ``innodb_trx`` (seen after many earlier connections); the process list
    shows it running, so an INSERT into this test's table that is still running counts too.
    """
    query = {
        "postgresql": "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'",
        "mysql": "SELECT (SELECT count(*) FROM information_schema.innodb_trx "
                 "WHERE trx_state = 'LOCK WAIT') + (SELECT count(*) FROM "
                 "information_schema.processlist WHERE command = 'Query' "
                 f"AND info LIKE 'INSERT INTO {store._table.name} %%')",  # %%: DBAPI escape
    }.get(store._engine.dialect.name)
    if query is None:
        return 0
    with store._engine.connect() as conn:
        return int(conn.exec_driver_sql(query).scalar_one())


def test_a_claim_racing_an_uncommitted_first_claim_reports_busy(store: SQLStore) -> None:
    """The loser of a first-claim race sees no row, meets the winner's INSERT, and re-decides."""
    claim(store, "create-the-table")
    now = store.now()
    winner_engine = sa.create_engine(store._engine.url)  # transactional, unlike the store's
    try:
        with ThreadPoolExecutor(1) as pool:
            with winner_engine.begin() as winner:
                winner.execute(
                    sa.insert(store._table).values(
                        key=store.prefix + "k",
                        state="in_progress",
                        token=1,
                        owner="host:w",
                        task_id="task-w",
                        attempt=0,
                        lease_expires=now + LONG,
                        updated=now,
                        expires=now + LONG,
                    )
                )
                loser = pool.submit(claim, store, who="b")
                if store._engine.dialect.name != "sqlite":
                    poll(store, lambda: _lock_waits(store) > 0, "the loser to wait on the winner's row")
            result = loser.result(timeout=DEADLINE)
    finally:
        winner_engine.dispose()
    assert result.status is ClaimStatus.BUSY
    assert result.record is not None
    assert (result.record.owner, result.record.token) == ("host:w", 1)


_FORKED_STORE: SQLStore | None = None


def _claim_in_forked_child(barrier: Any, results: Any, i: int) -> None:
    assert _FORKED_STORE is not None
    barrier.wait()
    result = claim(_FORKED_STORE, who=f"p{i}")
    results.put((result.status.value, result.token, result.claim_id))


def test_concurrent_claims_from_forked_processes_have_one_winner(store: SQLStore) -> None:
    """Forked workers: each child drops the inherited pool and races on its own connection."""
    global _FORKED_STORE
    claim(store, "warm-up")  # the parent's pool holds a connection the children must not use
    _FORKED_STORE = store
    ctx = multiprocessing.get_context("fork")
    barrier, results = ctx.Barrier(4), ctx.Queue()
    procs = [ctx.Process(target=_claim_in_forked_child, args=(barrier, results, i)) for i in range(4)]
    try:
        for p in procs:
            p.start()
        outcomes = [results.get(timeout=DEADLINE) for _ in procs]
        for p in procs:
            p.join(DEADLINE)
            assert p.exitcode == 0
    finally:
        _FORKED_STORE = None
        for p in procs:
            if p.is_alive():
                p.kill()
    assert sorted(status for status, _, _ in outcomes) == ["busy"] * 3 + ["claimed"]
    [(_, token, claim_id)] = [o for o in outcomes if o[0] == "claimed"]
    assert {t for _, t, _ in outcomes} == {token}  # the losers saw the winner's token
    holder = store.get("k")
    assert holder is not None and (holder.token, holder.claim_id) == (token, claim_id)
    assert claim(store, "warm-up", who="b").status is ClaimStatus.BUSY  # parent pool still fine


@pytest.mark.parametrize("last_write", ["record", "release"])
def test_claims_racing_the_holders_last_write_see_the_row_before_or_after_it(
    store: SQLStore, last_write: str
) -> None:
    """Claims keep coming while the holder records (or releases) its key.

    PostgreSQL answers a duplicate of a finished key from an unlocked read, and locks the row
    otherwise: each claim must still see the holder's row either before the write (BUSY) or
    after it (DONE; or, after a release, exactly one new winner), never a key taken twice.
    """
    first = claim(store, who="a")
    t1 = first.token
    threads = 6
    everyone_saw_the_holder = threading.Barrier(threads + 1)

    def contend(i: int) -> list[Any]:
        seen = [claim(store, who=f"w{i}")]
        everyone_saw_the_holder.wait(DEADLINE)
        while seen[-1].status is ClaimStatus.BUSY and seen[-1].record.owner == "host:a":
            assert seen[-1].now < seen[0].now + DEADLINE, "the holder's write never showed"
            time.sleep(0.001)
            seen.append(claim(store, who=f"w{i}"))
        return seen

    with ThreadPoolExecutor(threads) as pool:
        futures = [pool.submit(contend, i) for i in range(threads)]
        everyone_saw_the_holder.wait(DEADLINE)
        if last_write == "record":
            store.record("k", t1, state=State.DONE, content_type="c", data=b"r", ttl=LONG,
                         claim_id=first.claim_id)
        else:
            store.release("k", t1, claim_id=first.claim_id)
        histories = [f.result(timeout=DEADLINE) for f in futures]

    for history in histories:  # before the write: the holder's row, busy
        for before in history[:-1]:
            assert before.status is ClaimStatus.BUSY
            assert (before.record.token, before.record.state) == (t1, State.IN_PROGRESS)
    last = [history[-1] for history in histories]
    if last_write == "record":
        assert {(r.status, r.token, r.record.data) for r in last} == {(ClaimStatus.DONE, t1, b"r")}
        return
    [winner] = [r for r in last if r.status.holds]
    assert winner.status is ClaimStatus.CLAIMED and winner.token > t1
    holder = store.get("k")
    assert holder is not None and holder.token == winner.token
    for loser in last:
        if loser is not winner:
            assert loser.status is ClaimStatus.BUSY
            assert (loser.record.token, loser.record.owner) == (winner.token, holder.owner)


def test_the_table_is_created_once_by_concurrent_stores(make_store: Callable[..., SQLStore]) -> None:
    stores = [make_store() for _ in range(4)]
    barrier = threading.Barrier(len(stores))

    def first_use(s: SQLStore) -> ClaimStatus:
        barrier.wait()  # every store creates the table on its first verb, all at once
        return claim(s, who=str(id(s))).status

    with ThreadPoolExecutor(len(stores)) as pool:
        statuses = list(pool.map(first_use, stores))
    assert sorted(statuses) == [ClaimStatus.BUSY] * 3 + [ClaimStatus.CLAIMED]


# -- scan, expired rows and clean-up ----------------------------------------------------------


def test_scan_pages_come_in_key_order(make_store: Callable[..., SQLStore]) -> None:
    store, other = make_store("app1:"), make_store("app2:")
    tokens = {key: claim(store, key).token for key in ["e", "a", "d", "c", "b"]}
    store.record("b", tokens["b"], state=State.DONE, content_type="c", data=b"", ttl=LONG)
    store.record("d", tokens["d"], state=State.DONE, content_type="c", data=b"", ttl=LONG)
    claim(other, "a")  # another app's row in the same table

    assert [r.key for r in store.scan(count=2)] == ["a", "b", "c", "d", "e"]
    assert [r.key for r in store.scan(count=100)] == ["a", "b", "c", "d", "e"]
    assert [r.key for r in store.scan(State.DONE, count=1)] == ["b", "d"]
    assert [r.key for r in store.scan(State.IN_PROGRESS, count=2)] == ["a", "c", "e"]


def test_an_expired_row_keeps_its_token_until_purged(store: SQLStore) -> None:
    first = claim(store, ttl=0.3)
    poll(store, lambda: store.get("k") is None, "the TTL to pass")
    assert [row["token"] for row in raw_rows(store)] == [first.token]  # absent, but still there
    result = claim(store, who="b")
    assert result.status is ClaimStatus.CLAIMED
    assert result.record is None
    assert result.token > first.token  # the expired row's token stays monotonic


def test_purge_expired_deletes_only_this_prefixs_expired_rows(
    make_store: Callable[..., SQLStore],
) -> None:
    store, other = make_store("app1:"), make_store("app2:")
    purged = {key: claim(store, key, ttl=0.2).token for key in ["x1", "x2", "x3"]}
    claim(store, "live1")
    claim(store, "live2")
    claim(other, "x1", ttl=0.2)
    poll(store, lambda: all(store.get(k) is None for k in ["x1", "x2", "x3"]), "the TTLs to pass")

    assert store.purge_expired(limit=2) == 2
    assert store.purge_expired() == 1
    assert store.purge_expired() == 0
    keys = sorted(row["key"] for row in raw_rows(store))
    assert keys == ["app1:live1", "app1:live2", "app2:x1"]  # the other app's row is its own
    # Purged, the row and its token are gone; the clock term still puts the next token above it
    assert claim(store, "x1").token > purged["x1"]


# -- errors and configuration -----------------------------------------------------------------


def test_an_unreachable_postgresql_server_is_store_unavailable() -> None:
    store = SQLStore.from_url(
        "db+postgresql+psycopg://root:sekrit@127.0.0.1:1/test",
        engine_options={"connect_args": {"connect_timeout": 2}},
    )
    try:
        for verb in (lambda: claim(store), lambda: store.get("k"), store.now):
            with pytest.raises(StoreUnavailable, match="could not reach the SQL store") as info:
                verb()
            assert "127.0.0.1:1" in str(info.value)
            assert "sekrit" not in str(info.value)
            assert isinstance(info.value.__cause__, sa.exc.OperationalError)
    finally:
        store.close()


def test_an_unreachable_mysql_server_is_store_unavailable() -> None:
    store = SQLStore.from_url(
        "db+mysql+pymysql://root@127.0.0.1:1/test",
        engine_options={"connect_args": {"connect_timeout": 2}},
    )
    try:
        with pytest.raises(StoreUnavailable, match="could not reach"):
            store.get("k")
    finally:
        store.close()


def test_a_hand_written_row_with_a_bogus_state_is_corrupt_record(store: SQLStore) -> None:
    claim(store)  # creates the table
    with store._engine.connect() as conn:
        conn.execute(
            sa.insert(store._table).values(
                key=store.prefix + "bad",
                state="exploded",
                token=1,
                owner="",
                task_id="",
                attempt=0,
                updated=0.0,
                expires=store.now() + 3600,
            )
        )
    with pytest.raises(CorruptRecord, match="'bad'") as info:
        store.get("bad")
    assert info.value.key == "bad"
    with pytest.raises(CorruptRecord, match="'bad'"):
        claim(store, "bad")
    with pytest.raises(CorruptRecord):
        list(store.scan())
    [bad] = [row for row in raw_rows(store) if row["key"].endswith("bad")]
    assert bad["state"] == "exploded"  # the claim wrote nothing


def test_leases_use_the_database_clock_not_the_workers(
    store: SQLStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    claim(store, lease=30.0)
    monkeypatch.setattr(time, "time", lambda: 0.0)  # a worker with a wildly wrong clock
    assert store.now() > 1e9
    assert claim(store, who="b").status is ClaimStatus.BUSY


def test_from_url_passes_table_name_and_engine_options(table_name: str, tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="pool_size"):
        SQLStore.from_url(f"db+sqlite:///{tmp_path / 'x.db'}", pool_size=3)
    store = store_from_url(
        f"db+sqlite:///{tmp_path / 'x.db'}",
        prefix="p:",
        options={"table_name": table_name, "engine_options": {"pool_size": 2}},
    )
    assert isinstance(store, SQLStore)
    assert store._engine.pool.size() == 2  # type: ignore[attr-defined]
    assert table_name in repr(store)
    store.close()


def test_a_connection_the_server_closed_fails_one_verb_then_the_pool_recovers(
    pg_url: str, table_name: str
) -> None:
    # Given a store on PostgreSQL whose pooled connection the server then terminates
    store = store_from_url("db+" + pg_url, prefix="gone:", options={"table_name": table_name})
    try:
        claim(store, "k1")
        with store._engine.connect() as conn:  # the pool's one idle connection
            pid = conn.exec_driver_sql("SELECT pg_backend_pid()").scalar()
        admin = sa.create_engine(pg_url)
        with admin.connect() as conn:
            conn.execute(sa.text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
        admin.dispose()
        # When the next verb uses the dead connection, Then it is StoreUnavailable (no pre-ping)
        with pytest.raises(StoreUnavailable):
            store.get("k1")
        # And the verb after it gets a fresh connection
        rec = store.get("k1")
        assert rec is not None and rec.state is State.IN_PROGRESS
    finally:
        drop_table(store)
        store.close()


# -- a table made before claim ids --------------------------------------------------------------


def test_a_table_made_before_claim_ids_gets_the_column_on_first_use_and_its_rows_still_work(
    make_store: Callable[..., SQLStore],
) -> None:
    store = make_store()
    # The table as an earlier celery_idem made it: every column but claim_id, and one of its
    # rows (token 1, in progress, lease expired)
    old = sa.Table(store._table.name, sa.MetaData(),
                   *(sa.Column(c.name, c.type, primary_key=c.primary_key, nullable=c.nullable)
                     for c in store._table.c if c.name != "claim_id"))
    old.create(store._engine)
    now = time.time()
    with store._engine.begin() as conn:
        conn.execute(sa.insert(old).values(
            key=store.prefix + "old", state="in_progress", token=1, owner="host:old",
            task_id="task-old", attempt=0, lease_expires=now - 1, updated=now - 2,
            expires=now + LONG))
    rec = store.get("old")  # the first verb adds the column
    assert rec is not None and (rec.token, rec.claim_id) == (1, "")
    assert "claim_id" in {c["name"] for c in sa.inspect(store._engine).get_columns(old.name)}
    # The old row's holder is fenced by the token alone; a new claim takes over higher
    taken = claim(store, "old", who="b")
    assert taken.status is ClaimStatus.TAKEOVER and taken.token > 1 and taken.claim_id
    store.record("old", taken.token, state=State.DONE, content_type="c", data=b"new", ttl=LONG,
                 claim_id=taken.claim_id)
    # A second store on the same table (another worker) finds the column there already
    again = make_store()
    fresh = claim(again, "k2")
    assert fresh.status is ClaimStatus.CLAIMED and fresh.claim_id


@pytest.mark.parametrize("backend_url", store_kinds("mysql"), indirect=True)
def test_a_mariadb_table_with_a_trailing_space_blind_collation_gets_the_byte_for_byte_one(
    make_store: Callable[..., SQLStore],
) -> None:
    store = make_store()
    # The table as an earlier celery_idem made it: its text columns in utf8mb4_bin (PAD SPACE)
    old = sa.Table(store._table.name, sa.MetaData(), *(
        sa.Column(c.name, sa.dialects.mysql.VARCHAR(c.type.length, charset="utf8mb4",
                                                   collation="utf8mb4_bin")
                  if isinstance(c.type, sa.String) else c.type,
                  primary_key=c.primary_key, nullable=c.nullable)
        for c in store._table.c))
    old.create(store._engine)
    first = claim(store, "K")  # the first verb changes the collation
    with store._engine.connect() as conn:
        collations = dict(conn.execute(sa.text(
            "SELECT COLUMN_NAME, COLLATION_NAME FROM information_schema.COLUMNS "
            "WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = :t AND COLLATION_NAME IS NOT NULL"),
            {"t": old.name}).all())
    assert set(collations.values()) == {"utf8mb4_nopad_bin"}, collations
    assert first.status is ClaimStatus.CLAIMED
    assert claim(store, "K ").status is ClaimStatus.CLAIMED
    # A second store on the same table (another worker) finds it changed already
    assert claim(make_store(), "K  ").status is ClaimStatus.CLAIMED
