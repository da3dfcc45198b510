"""SQLStore against real databases: PostgreSQL, MariaDB/MySQL and SQLite.

Every test gets its own table (``t_<hex>``) and drops it afterwards. A server that does not
answer skips its tests locally and fails them in CI (``CI=true``), like tests/conftest.py; it is
probed with the plain driver, so a store bug never reads as a skip. URLs come from
CELERY_IDEM_TEST_PG and CELERY_IDEM_TEST_MYSQL.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from celery_idem.exceptions import CorruptRecord, LeaseLost, StoreUnavailable
from celery_idem.records import Claim, ClaimStatus, State
from celery_idem.stores import store_from_url
from celery_idem.stores.sql import SQLStore

POSTGRES_URL = os.environ.get("CELERY_IDEM_TEST_PG", "postgresql+psycopg://root@127.0.0.1:5432/test")
MYSQL_URL = os.environ.get("CELERY_IDEM_TEST_MYSQL", "mysql+pymysql://root@127.0.0.1:3306/test")
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")

LONG = 60.0  # a lease or TTL that never runs out during a test
DEADLINE = 15.0  # upper bound for every poll loop


def _server_reachable(url: str) -> bool:
    parsed = sa.engine.make_url(url)
    try:
        if parsed.get_backend_name() == "postgresql":
            import psycopg

            psycopg.connect(
                host=parsed.host,
                port=parsed.port or 5432,
                user=parsed.username,
                password=parsed.password,
                dbname=parsed.database,
                connect_timeout=3,
            ).close()
        else:
            import pymysql

            pymysql.connect(
                host=parsed.host,
                port=parsed.port or 3306,
                user=parsed.username,
                password=parsed.password or "",
                database=parsed.database,
                connect_timeout=3,
            ).close()
    except Exception:
        return False
    return True


@pytest.fixture(params=["postgresql", "mysql", "sqlite"])
def backend_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"db+sqlite:///{tmp_path / 'idem.db'}"
    url = POSTGRES_URL if request.param == "postgresql" else MYSQL_URL
    if not _server_reachable(url):
        message = f"{request.param} server at {url} does not answer"
        if IN_CI:
            pytest.fail(message)
        pytest.skip(message)
    return "db+" + url


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
    if stores:
        sa.Table(table_name, sa.MetaData()).drop(stores[0]._engine, checkfirst=True)
    for store in stores:
        store.close()


@pytest.fixture
def store(make_store: Callable[..., SQLStore]) -> SQLStore:
    return make_store()


def claim(
    store: SQLStore,
    key: str = "k",
    *,
    who: str = "a",
    attempt: int = 0,
    lease: float = LONG,
    ttl: float = LONG,
    payload_hash: str | None = None,
) -> Claim:
    return store.claim(
        key,
        owner=f"host:{who}",
        task_id=f"task-{who}",
        attempt=attempt,
        lease=lease,
        ttl=ttl,
        payload_hash=payload_hash,
    )


def poll(check: Callable[[], Any], what: str) -> Any:
    """Call ``check`` until it returns something truthy, within DEADLINE seconds."""
    deadline = time.monotonic() + DEADLINE
    while time.monotonic() < deadline:
        result = check()
        if result:
            return result
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def raw_rows(store: SQLStore) -> list[dict[str, Any]]:
    with store._engine.connect() as conn:
        return [dict(r) for r in conn.execute(sa.select(store._table)).mappings()]


# -- the verbs, one by one --------------------------------------------------------------------


def test_first_claim_gets_token_1(store: SQLStore) -> None:
    result = claim(store)
    assert result.status is ClaimStatus.CLAIMED
    assert result.token == 1
    assert result.record is None
    rec = store.get("k")
    assert rec is not None
    assert (rec.state, rec.token, rec.owner, rec.task_id, rec.attempt) == (
        State.IN_PROGRESS,
        1,
        "host:a",
        "task-a",
        0,
    )
    assert rec.lease_expires == pytest.approx(result.now + LONG, abs=1e-3)


def test_second_claim_is_busy_with_the_holder(store: SQLStore) -> None:
    claim(store, who="a")
    result = claim(store, who="b")
    assert result.status is ClaimStatus.BUSY
    assert result.token == 1
    assert result.record is not None
    assert (result.record.owner, result.record.task_id) == ("host:a", "task-a")
    assert store.get("k") == result.record  # nothing was written


def test_done_is_returned_with_its_data(store: SQLStore) -> None:
    token = claim(store).token
    store.record("k", token, state=State.DONE, content_type="application/json", data=b"[42]", ttl=LONG)
    result = claim(store, who="b")
    assert result.status is ClaimStatus.DONE
    assert result.token == token
    assert result.record is not None
    assert (result.record.state, result.record.content_type, result.record.data) == (
        State.DONE,
        "application/json",
        b"[42]",
    )
    assert result.record.lease_expires is None


def test_failed_is_returned_with_its_error(store: SQLStore) -> None:
    token = claim(store).token
    store.record("k", token, state=State.FAILED, content_type="x-error", data=b"boom", ttl=LONG)
    result = claim(store, who="b", attempt=3)  # a retry does not take over a FAILED record
    assert result.status is ClaimStatus.FAILED
    assert result.record is not None and result.record.data == b"boom"


def test_large_result_fits(store: SQLStore) -> None:
    data = os.urandom(300 * 1024)  # over MySQL's 64 KiB BLOB
    token = claim(store).token
    store.record("k", token, state=State.DONE, content_type="b", data=data, ttl=LONG)
    rec = store.get("k")
    assert rec is not None and rec.data == data


def test_release_keeps_a_tombstone_and_the_next_claim_gets_token_2(store: SQLStore) -> None:
    claim(store, payload_hash="h1")
    store.release("k", 1)
    tomb = store.get("k")
    assert tomb is not None
    assert (
        tomb.state,
        tomb.token,
        tomb.owner,
        tomb.task_id,
        tomb.lease_expires,
        tomb.payload_hash,
        tomb.data,
    ) == (State.RELEASED, 1, "", "", None, None, None)
    result = claim(store, who="b", payload_hash="h2")
    assert result.status is ClaimStatus.CLAIMED
    assert result.token == 2
    assert result.record == tomb


def test_expired_lease_is_taken_over(store: SQLStore) -> None:
    claim(store, who="a", lease=0.3)

    def takeover() -> Claim | None:
        result = claim(store, who="b")
        assert result.status in (ClaimStatus.BUSY, ClaimStatus.TAKEOVER)
        return result if result.status is ClaimStatus.TAKEOVER else None

    result = poll(takeover, "the lease to expire")
    assert result.token == 2
    assert result.record is not None and result.record.owner == "host:a"
    rec = store.get("k")
    assert rec is not None and (rec.owner, rec.token) == ("host:b", 2)


def test_retry_of_the_same_task_takes_over_at_once(store: SQLStore) -> None:
    claim(store, who="a", attempt=0)
    assert claim(store, who="a", attempt=0).status is ClaimStatus.BUSY  # same attempt: busy
    result = claim(store, who="a", attempt=1)
    assert result.status is ClaimStatus.TAKEOVER
    assert result.token == 2
    assert result.record is not None and result.record.attempt == 0
    assert claim(store, who="b", attempt=5).status is ClaimStatus.BUSY  # another task: busy


def test_stale_holder_loses_every_fenced_write(store: SQLStore) -> None:
    claim(store, who="a", attempt=0)
    assert claim(store, who="a", attempt=1).token == 2
    with pytest.raises(LeaseLost, match="now has token 2") as info:
        store.record("k", 1, state=State.DONE, content_type="c", data=b"stale", ttl=LONG)
    assert (info.value.key, info.value.token) == ("k", 1)
    with pytest.raises(LeaseLost, match="now has token 2"):
        store.release("k", 1)
    with pytest.raises(LeaseLost, match="now has token 2"):
        store.renew("k", 1, LONG)
    rec = store.get("k")
    assert rec is not None and (rec.state, rec.token) == (State.IN_PROGRESS, 2)


def test_fenced_writes_on_a_missing_key(store: SQLStore) -> None:
    with pytest.raises(LeaseLost, match="is gone"):
        store.record("nope", 1, state=State.DONE, content_type="c", data=b"", ttl=LONG)
    with pytest.raises(LeaseLost, match="is gone"):
        store.release("nope", 1)
    with pytest.raises(LeaseLost, match="is gone"):
        store.renew("nope", 1, LONG)


def test_record_is_idempotent_for_the_holder(store: SQLStore) -> None:
    token = claim(store).token
    store.record("k", token, state=State.DONE, content_type="c", data=b"first", ttl=LONG)
    first = store.get("k")
    store.record("k", token, state=State.DONE, content_type="c", data=b"again", ttl=LONG)
    assert store.get("k") == first  # succeeded, changed nothing
    with pytest.raises(LeaseLost, match="it is done"):
        store.record("k", token, state=State.FAILED, content_type="c", data=b"", ttl=LONG)
    with pytest.raises(LeaseLost, match="it is done"):
        store.release("k", token)
    with pytest.raises(LeaseLost, match="it is done"):
        store.renew("k", token, LONG)


def test_record_rejects_other_states(store: SQLStore) -> None:
    with pytest.raises(ValueError, match="DONE or FAILED"):
        store.record("k", 1, state=State.RELEASED, content_type="c", data=b"", ttl=LONG)


def test_renew_extends_the_lease_on_the_store_clock(store: SQLStore) -> None:
    first = claim(store, lease=0.5)
    expires = store.renew("k", first.token, 30.0)
    assert expires == pytest.approx(store.now() + 30.0, abs=2.0)
    rec = store.get("k")
    assert rec is not None and rec.lease_expires == pytest.approx(expires, abs=1e-6)
    assert claim(store, who="b").status is ClaimStatus.BUSY


def test_payload_hash_mismatch(store: SQLStore) -> None:
    claim(store, payload_hash="aaa")
    result = claim(store, who="b", payload_hash="bbb")
    assert result.status is ClaimStatus.MISMATCH
    assert result.record is not None and result.record.payload_hash == "aaa"
    # Not validating, or the same hash: no mismatch.
    assert claim(store, who="b").status is ClaimStatus.BUSY
    assert claim(store, who="b", payload_hash="aaa").status is ClaimStatus.BUSY
    # The mismatch is checked before DONE, like the memory store.
    store.record("k", 1, state=State.DONE, content_type="c", data=b"", ttl=LONG)
    assert claim(store, who="b", payload_hash="bbb").status is ClaimStatus.MISMATCH


def test_ttl_expiry_counts_as_absent(store: SQLStore) -> None:
    claim(store, ttl=0.3)
    poll(lambda: store.get("k") is None, "the TTL to pass")
    assert list(store.scan()) == []
    with pytest.raises(LeaseLost, match="is gone"):
        store.record("k", 1, state=State.DONE, content_type="c", data=b"", ttl=LONG)
    result = claim(store, who="b")
    assert result.status is ClaimStatus.CLAIMED
    assert result.record is None
    assert result.token == 2  # the expired row still existed: its token stays monotonic


def test_record_sets_a_new_ttl(store: SQLStore) -> None:
    token = claim(store, ttl=LONG).token
    store.record("k", token, state=State.DONE, content_type="c", data=b"", ttl=0.3)
    poll(lambda: store.get("k") is None, "the recorded TTL to pass")


# -- concurrency ------------------------------------------------------------------------------


@pytest.mark.parametrize("released_first", [False, True], ids=["absent", "released"])
def test_concurrent_claims_have_one_winner(store: SQLStore, released_first: bool) -> None:
    if released_first:
        claim(store, who="setup")
        store.release("k", 1)
    threads = 8
    barrier = threading.Barrier(threads)

    def contend(i: int) -> Claim:
        barrier.wait()
        return claim(store, who=f"w{i}")

    with ThreadPoolExecutor(threads) as pool:
        results = list(pool.map(contend, range(threads)))
    winners = [r for r in results if r.status.holds]
    assert [w.status for w in winners] == [ClaimStatus.CLAIMED]
    winner = winners[0]
    assert winner.token == (2 if released_first else 1)
    for loser in results:
        if loser is winner:
            continue
        assert loser.status is ClaimStatus.BUSY
        assert loser.record is not None
        assert loser.record.token == winner.token
        assert loser.record.owner == store.get("k").owner  # type: ignore[union-attr]


def _lock_waits(store: SQLStore) -> int:
    """How many sessions wait for a row lock (0 on SQLite, which cannot tell)."""
    query = {
        "postgresql": "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'",
        "mysql": "SELECT count(*) FROM information_schema.innodb_trx WHERE trx_state = 'LOCK WAIT'",
    }.get(store._engine.dialect.name)
    if query is None:
        return 0
    with store._engine.connect() as conn:
        return int(conn.exec_driver_sql(query).scalar_one())


def test_claim_racing_an_uncommitted_first_claim_reports_busy(store: SQLStore) -> None:
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
                    poll(lambda: _lock_waits(store) > 0, "the loser to wait on the winner's row")
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
    results.put((result.status.value, result.token))


def test_concurrent_claims_from_processes(store: SQLStore) -> None:
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
    assert sorted(outcomes) == [("busy", 1)] * 3 + [("claimed", 1)]
    assert claim(store, "warm-up", who="b").status is ClaimStatus.BUSY  # parent pool still fine


# -- scan and clean-up ------------------------------------------------------------------------


def test_scan_pages_in_key_order_and_filters(make_store: Callable[..., SQLStore]) -> None:
    store, other = make_store("app1:"), make_store("app2:")
    for key in ["e", "a", "d", "c", "b"]:
        claim(store, key)
    store.record("b", 1, state=State.DONE, content_type="c", data=b"", ttl=LONG)
    store.record("d", 1, state=State.DONE, content_type="c", data=b"", ttl=LONG)
    claim(other, "a")  # another app's row in the same table
    claim(store, "expired", ttl=0.2)
    poll(lambda: store.get("expired") is None, "the TTL to pass")

    assert [r.key for r in store.scan(count=2)] == ["a", "b", "c", "d", "e"]
    assert [r.key for r in store.scan(count=100)] == ["a", "b", "c", "d", "e"]
    assert [r.key for r in store.scan(State.DONE, count=1)] == ["b", "d"]
    assert [r.key for r in store.scan(State.IN_PROGRESS, count=2)] == ["a", "c", "e"]
    assert [r.key for r in other.scan()] == ["a"]


def test_keys_are_case_sensitive(store: SQLStore) -> None:
    assert claim(store, "Refund:x").status is ClaimStatus.CLAIMED
    assert claim(store, "refund:x").status is ClaimStatus.CLAIMED


def test_purge_expired(make_store: Callable[..., SQLStore]) -> None:
    store, other = make_store("app1:"), make_store("app2:")
    for key in ["x1", "x2", "x3"]:
        claim(store, key, ttl=0.2)
    claim(store, "live1")
    claim(store, "live2")
    claim(other, "x1", ttl=0.2)
    poll(lambda: all(store.get(k) is None for k in ["x1", "x2", "x3"]), "the TTLs to pass")

    assert store.purge_expired(limit=2) == 2
    assert store.purge_expired() == 1
    assert store.purge_expired() == 0
    keys = sorted(row["key"] for row in raw_rows(store))
    assert keys == ["app1:live1", "app1:live2", "app2:x1"]  # the other app's row is its own
    assert claim(store, "x1").token == 1  # purged: the key starts over


# -- errors and configuration -----------------------------------------------------------------


def test_unreachable_server_is_store_unavailable() -> None:
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


def test_mysql_unreachable_is_store_unavailable() -> None:
    store = SQLStore.from_url(
        "db+mysql+pymysql://root@127.0.0.1:1/test",
        engine_options={"connect_args": {"connect_timeout": 2}},
    )
    try:
        with pytest.raises(StoreUnavailable, match="could not reach"):
            store.get("k")
    finally:
        store.close()


def test_bogus_state_is_corrupt_record(store: SQLStore) -> None:
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
                expires=time.time() + 3600,
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


def test_now_is_the_database_clock(store: SQLStore) -> None:
    assert store.now() == pytest.approx(time.time(), abs=5.0)
    result = claim(store, lease=10.0)
    assert result.now == pytest.approx(time.time(), abs=5.0)
    rec = store.get("k")
    assert rec is not None and rec.updated == pytest.approx(result.now, abs=1e-3)


def test_now_uses_the_server_not_the_worker(store: SQLStore, monkeypatch: pytest.MonkeyPatch) -> None:
    claim(store, lease=30.0)
    monkeypatch.setattr(time, "time", lambda: 0.0)  # a worker with a wildly wrong clock
    assert store.now() > 1e9
    assert claim(store, who="b").status is ClaimStatus.BUSY


def test_table_is_created_once_by_concurrent_stores(
    backend_url: str, make_store: Callable[..., SQLStore]
) -> None:
    stores = [make_store() for _ in range(4)]
    barrier = threading.Barrier(len(stores))

    def first_use(s: SQLStore) -> ClaimStatus:
        barrier.wait()  # every store creates the table on its first verb, all at once
        return claim(s, who=str(id(s))).status

    with ThreadPoolExecutor(len(stores)) as pool:
        statuses = list(pool.map(first_use, stores))
    assert sorted(statuses) == [ClaimStatus.BUSY] * 3 + [ClaimStatus.CLAIMED]


def test_from_url_options(table_name: str, tmp_path: Path) -> None:
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


def test_url_without_driver_falls_back_to_an_installed_one() -> None:
    from celery_idem.stores.sql import _importable, _sqlalchemy_url

    pg = _sqlalchemy_url("db+postgresql://root@127.0.0.1/test")
    my = _sqlalchemy_url("db+mysql://root@127.0.0.1/test")
    assert pg.drivername == ("postgresql" if _importable("psycopg2") else "postgresql+psycopg")
    assert my.drivername == ("mysql" if _importable("MySQLdb") else "mysql+pymysql")
    assert _sqlalchemy_url("db+postgresql+psycopg://h/db").drivername == "postgresql+psycopg"
    assert _sqlalchemy_url("db+sqlite:///x.db").drivername == "sqlite"
