"""The SQL store on PostgreSQL under contention: 8 worker processes (4 workers x prefork -c 2).

Every body commits its effect to a PostgreSQL ledger table in its own transaction
(:class:`tests.chaos.support.Ledger`), so the ledger counts executions independently of the
store under test. Two workloads:

* one action enqueued many times at once, from several producer threads: exactly one effect,
  and every copy answers with the same result;
* many actions, each enqueued several times, shuffled: exactly one effect per action.

The test prints throughput and the gate's decisions; it fails on any deadlock, serialization
failure or store error in the workers' logs. ``docs/scaling.md`` quotes a run.
"""

from __future__ import annotations

import random
import re
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import psycopg
import pytest

from tests.chaos.support import ChaosRedis, Ledger, Stack, reset_app, wait_for
from tests.conftest import PG_URL
from tests.integration import app as tasks

pytestmark = [pytest.mark.worker, pytest.mark.slow]

WORKERS = 4
CONCURRENCY = 2  # 4 x 2 = 8 worker processes
# Errors that would mean the store's statements fight each other (or the pool ran dry).
TROUBLE = re.compile(
    r"deadlock detected|could not serialize|SerializationFailure|DeadlockDetected|"
    r"StoreUnavailable|QueuePool limit|record_failed|lease_lost|Traceback",
    re.IGNORECASE,
)


@pytest.fixture(scope="module")
def stack(pg_ledger_url: str) -> Iterator[Stack]:
    """Eight worker processes on one private broker and one PostgreSQL store table."""
    broker = ChaosRedis()
    table = f"scale_{uuid.uuid4().hex[:10]}_records"
    application_name = f"idem-{table}"
    store_url = f"db+{PG_URL}?application_name={application_name}"
    stack = Stack(broker, store_url, Ledger(pg_ledger_url), store_options={"table_name": table},
                  name="sql")
    stack.table = table  # type: ignore[attr-defined]
    stack.application_name = application_name  # type: ignore[attr-defined]
    try:
        for i in range(WORKERS):
            stack.worker(f"pg{i}", concurrency=CONCURRENCY)
        yield stack
    finally:
        stack.close()
        stack.ledger.conn.execute(f"DROP TABLE IF EXISTS {table}")
        stack.ledger.drop()
        broker.cleanup()


@pytest.fixture
def active(stack: Stack) -> Iterator[Stack]:
    with stack.active():
        yield stack


def publish(calls: list[dict[str, Any]], threads: int) -> list[Any]:
    """Enqueue ``chaos_effect`` with each kwargs dict, from ``threads`` producer threads."""
    with ThreadPoolExecutor(threads) as pool:
        return list(pool.map(lambda kw: tasks.chaos_effect.apply_async(kwargs=kw), calls))


def wait_all(results: list[Any], timeout: float) -> list[Any]:
    """Every result's value, once all are ready (a bounded poll); fails on any failure."""
    pending = list(results)

    def ready() -> bool:
        done = [r for r in pending if r.ready()]
        for r in done:
            if r.failed():
                r.get(timeout=1)  # raise the failure now instead of waiting for the rest
        pending[:] = [r for r in pending if r not in done]
        return not pending

    wait_for(ready, timeout=timeout, interval=0.2, what=f"{len(pending)} results")
    return [r.get(timeout=10) for r in results]


def pg_counters(ledger_url: str) -> dict[str, int]:
    with psycopg.connect(ledger_url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT deadlocks, conflicts, xact_rollback FROM pg_stat_database "
            "WHERE datname = current_database()").fetchone()
    assert row is not None
    return {"deadlocks": int(row[0]), "conflicts": int(row[1]), "rollbacks": int(row[2])}


def decisions(stack: Stack) -> Counter[str]:
    """The INFO-level gate decisions (re-queues, takeovers) in the workers' logs so far."""
    return Counter(m.group(1) for m in re.finditer(r"celery_idem (\w+) key=chaos_effect:",
                                                   stack.logs()))


def assert_no_trouble(stack: Stack) -> None:
    bad = [line for line in stack.logs().splitlines() if TROUBLE.search(line)]
    assert not bad, "\n".join(bad[:20])


def store_connections(stack: Stack, ledger_url: str) -> int:
    with psycopg.connect(ledger_url, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name = %s",
                           (stack.application_name,)).fetchone()  # type: ignore[attr-defined]
    return int(row[0]) if row else 0


def test_one_action_enqueued_many_times_at_once_runs_once(
    active: Stack, action: Callable[[str], str], pg_ledger_url: str
) -> None:
    # Given one action, enqueued 96 times at once from 8 producer threads, with a body that
    # holds 0.3 s so the copies really meet on the 8 worker processes
    name = action("one")
    copies = 96
    before = pg_counters(pg_ledger_url)
    started = time.monotonic()
    results = publish([{"action": name, "hold": 0.3}] * copies, threads=8)
    # When every copy has answered
    values = wait_all(results, timeout=180)
    took = time.monotonic() - started
    # Then the body ran once, and every copy got that run's result
    effects = active.effects(name)
    assert len(effects) == 1, effects
    assert {v["task_id"] for v in values} == {effects[0]["task_id"]}
    assert len({v["token"] for v in values}) == 1  # one claim: no takeover, no second token
    assert_no_trouble(active)
    after = pg_counters(pg_ledger_url)
    print(f"\n[scale/sql one action] copies={copies} processes={WORKERS * CONCURRENCY} "
          f"seconds={took:.2f} effects={len(effects)} "
          f"store_connections={store_connections(active, pg_ledger_url)} "
          f"db_deadlocks_delta={after['deadlocks'] - before['deadlocks']}")


def test_many_actions_with_duplicates_run_once_each(
    active: Stack, action: Callable[[str], str], pg_ledger_url: str
) -> None:
    # Given 250 actions, each enqueued 3 times, shuffled, from 4 producer threads
    n_actions, dup = 250, 3
    names = [action(f"a{i}") for i in range(n_actions)]
    calls = [{"action": n} for n in names for _ in range(dup)]
    random.Random(8).shuffle(calls)
    before = pg_counters(pg_ledger_url)
    started = time.monotonic()
    results = publish(calls, threads=4)
    values = wait_all(results, timeout=300)
    took = time.monotonic() - started
    # Then each action's body ran exactly once, and all its copies answer with that run
    counts = active.ledger.effect_counts(action(""))
    assert set(counts) == set(names), f"missing: {sorted(set(names) - set(counts))[:5]}"
    assert set(counts.values()) == {1}, {k: v for k, v in counts.items() if v != 1}
    by_action: dict[str, set[str]] = {}
    for v in values:
        by_action.setdefault(v["action"], set()).add(v["task_id"])
    assert all(len(ids) == 1 for ids in by_action.values())
    assert_no_trouble(active)
    after = pg_counters(pg_ledger_url)
    seen = decisions(active)  # both tests of the module
    reset_app(active.app)  # close the test process's own pool: count only the workers' connections
    print(f"\n[scale/sql many actions] actions={n_actions} messages={len(calls)} "
          f"processes={WORKERS * CONCURRENCY} seconds={took:.2f} "
          f"messages_per_s={len(calls) / took:.0f} actions_per_s={n_actions / took:.0f} "
          f"effects={sum(counts.values())} requeued={seen['requeued']} "
          f"takeover={seen['takeover']} "
          f"workers_store_connections={store_connections(active, pg_ledger_url)} "
          f"db_deadlocks_delta={after['deadlocks'] - before['deadlocks']}")
