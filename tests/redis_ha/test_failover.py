"""A master SIGKILLed mid-run: Redis Cluster and Redis Sentinel stores with real workers.

Each test has its own deployment (a 6-node cluster, or a master + replica + 3 sentinels), a
private plain ``redis-server`` as broker, two prefork workers, and a PostgreSQL ledger every body
commits its effect to (tests/chaos/support.py). It enqueues every action three times, kills the
master that holds the store's keys once a quarter of the effects are committed, waits for the
promotion, restarts the dead server (it rejoins as a replica), and then checks:

* exactly one effect per action in the ledger (zero duplicates, zero lost actions);
* every copy of an action got the same result, from one body run;
* the done records survived the failover: enqueueing every action again publishes nothing.

The store runs with ``wait_replicas=1``: each claim and record is confirmed by the replica that
the failover promotes, so no acknowledged write can be lost (docs/redis-cluster.md measures the
``wait_replicas=0`` against 1, the default, with ``python -m tests.redis_ha.measure``).

Set ``IDEM_HA_WAIT=0`` to run these tests without ``WAIT`` (the measurement script does).
"""

from __future__ import annotations

import contextlib
import gc
import os
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from celery.result import AsyncResult

from celery_idem import CachedResult
from tests.chaos.support import ChaosRedis, Ledger, libpq_url
from tests.conftest import PG_URL, require
from tests.integration import app as tasks
from tests.integration.harness import wait_for
from tests.redis_ha.support import MASTER_NAME, HaStack, LocalCluster, SentinelGroup

# The bounded waits below (promotion, rejoin, every result) add up past pytest-timeout's 300 s
# default on a loaded machine.
pytestmark = [pytest.mark.worker, pytest.mark.crash, pytest.mark.timeout(900)]

ACTIONS = int(os.environ.get("IDEM_HA_ACTIONS", "30"))
COPIES = 3
WAIT_REPLICAS = int(os.environ.get("IDEM_HA_WAIT", "1"))


@dataclass
class Run:
    """What one failover run saw (printed, and used by tests/redis_ha/measure.py)."""

    kind: str
    wait_replicas: int
    actions: int
    effects_before_kill: int = 0
    failover_s: float = 0.0
    rejoin_s: float = 0.0
    duplicates: dict[str, int] = field(default_factory=dict)
    lost: list[str] = field(default_factory=list)
    requeued_store_down: int = 0
    renew_failed: int = 0
    record_failed: int = 0
    lease_lost: int = 0
    wall_s: float = 0.0

    def line(self) -> str:
        return (f"{self.kind} wait_replicas={self.wait_replicas}: {self.actions} actions x {COPIES}"
                f" copies, master killed after {self.effects_before_kill} effects, promoted in "
                f"{self.failover_s:.1f} s, old master back as replica after {self.rejoin_s:.1f} s;"
                f" duplicates={sum(self.duplicates.values())} lost={len(self.lost)}; "
                f"requeued(store down)={self.requeued_store_down} renew_failed="
                f"{self.renew_failed} record_failed={self.record_failed} lease_lost="
                f"{self.lease_lost}; {self.wall_s:.0f} s")


@pytest.fixture
def pg_ledger_url() -> str:
    require(PG_URL, 5432, "PostgreSQL")
    return libpq_url(PG_URL)


def outcome(result: AsyncResult) -> Any:
    """The task's return value, read by polling the result backend (a plain GET each time,
    so nothing depends on the pub/sub subscription the client had to the old master)."""
    wait_for(result.ready, timeout=240, interval=0.1, what=f"the result of {result.id}")
    assert result.successful(), result.result
    return result.result


def run_failover(stack: HaStack, kind: str, kill: Callable[[], tuple[float, Callable[[], None]]],
                 wait_replicas: int) -> Run:
    """Enqueue, kill mid-run (``kill`` returns (promotion seconds, restart)), settle, count."""
    start = time.monotonic()
    run = Run(kind, wait_replicas, ACTIONS)
    base = uuid.uuid4().hex[:8]
    names = [f"{base}-a{i}" for i in range(ACTIONS)]
    stack.worker("w1", concurrency=2)
    stack.worker("w2", concurrency=2)
    sent: list[tuple[str, AsyncResult]] = []
    for _ in range(COPIES):
        for name in names:
            sent.append((name, tasks.ha_effect.delay(name, hold=0.2)))

    def effects() -> int:
        return sum(stack.ledger.effect_counts(base).values())

    run.effects_before_kill = wait_for(lambda: (n := effects()) >= ACTIONS // 4 and n,
                                       timeout=180, what="a quarter of the effects")
    run.failover_s, restart = kill()
    t = time.monotonic()
    restart()
    run.rejoin_s = run.failover_s + time.monotonic() - t

    values: dict[str, list[Any]] = {n: [] for n in names}
    for name, result in sent:
        values[name].append(outcome(result))
    del result
    sent.clear()
    forget_results()
    counts = stack.ledger.effect_counts(base)
    run.duplicates = {n: c - 1 for n, c in counts.items() if c > 1}
    run.lost = [n for n in names if counts.get(n, 0) == 0]
    logs = stack.logs()
    run.requeued_store_down = logs.count("reason=store_unavailable")
    run.renew_failed = logs.count("renew failed")
    run.record_failed = logs.count("RECORD FAILED")
    run.lease_lost = logs.count("lease_lost")
    run.wall_s = time.monotonic() - start
    print(run.line())

    # Every copy of an action returned what its one body run returned
    for name in names:
        assert all(v == values[name][0] for v in values[name]), (name, values[name])
    # The done records survived the failover: a fresh enqueue of every action publishes nothing
    again = [tasks.ha_effect.delay(name, hold=0.2) for name in names]
    assert all(isinstance(r, CachedResult) for r in again), [type(r) for r in again]
    assert [r.get() for r in again] == [values[n][0] for n in names]
    return run


def forget_results() -> None:
    """Collect the AsyncResults of a run while the servers still answer.

    Each one unsubscribes from its result channel when it is collected, which makes Celery's
    result consumer reconnect (through the sentinels); after the deployment is gone that
    reconnect retries for minutes inside a ``__del__``.
    """
    gc.collect()


@contextlib.contextmanager
def stack_on(deployment: LocalCluster | SentinelGroup, ledger_url: str, store_url: str,
             **kwargs: Any) -> Iterator[HaStack]:
    """A stack (private broker, ledger, ``wait_replicas=WAIT_REPLICAS``) on ``deployment``,
    torn down with it."""
    broker = ChaosRedis()
    ledger = Ledger(ledger_url)
    stack = HaStack(broker, store_url, ledger, store_options={"wait_replicas": WAIT_REPLICAS},
                    **kwargs)
    try:
        with stack.active():
            yield stack
    finally:
        forget_results()
        stack.close()
        ledger.drop()
        broker.cleanup()
        deployment.cleanup()


@pytest.fixture
def cluster_stack(pg_ledger_url: str) -> Iterator[tuple[HaStack, LocalCluster]]:
    cluster = LocalCluster()
    with stack_on(cluster, pg_ledger_url, cluster.url, name="cluster") as stack:
        yield stack, cluster


def test_cluster_master_killed_mid_run_zero_duplicate_effects(
    cluster_stack: tuple[HaStack, LocalCluster],
) -> None:
    stack, cluster = cluster_stack
    store = stack.store
    # Given the records spread over all three masters (the hash tag is the idempotency key)
    homes = {cluster.master_of(store.name_of(f"probe{i}")) for i in range(30)}
    assert len(homes) == 3

    def kill() -> tuple[float, Callable[[], None]]:
        # When the master holding the most keys of this run is SIGKILLed mid-run
        victim = max(cluster.masters(),
                     key=lambda p: sum(1 for r in store.scan() if
                                       cluster.master_of(store.name_of(r.key)) == p))
        t = time.monotonic()
        cluster.kill_master(victim)
        cluster.wait_promoted(victim)
        return time.monotonic() - t, lambda: cluster.restart(victim)

    run = run_failover(stack, "cluster", kill, WAIT_REPLICAS)
    # Then no action ran twice and none was lost
    assert run.duplicates == {} and run.lost == []


@pytest.fixture
def sentinel_stack(pg_ledger_url: str) -> Iterator[tuple[HaStack, SentinelGroup]]:
    # Sentinels that call a master down after 1 s without a PING reply fail over on their own
    # when a loaded machine starves a server that long: mid-run, or while the test enqueues its
    # last copies. 5 s leaves the failover to the test's SIGKILL.
    group = SentinelGroup(down_after_ms=5000)
    # The store is not configured: it is the Celery result backend, a sentinel:// URL whose
    # master name is in result_backend_transport_options, as Celery users already write it.
    with stack_on(group, pg_ledger_url, "", name="sentinel", backend_url=group.url,
                  backend_options={"master_name": MASTER_NAME}) as stack:
        yield stack, group


def test_sentinel_master_killed_mid_run_zero_duplicate_effects(
    sentinel_stack: tuple[HaStack, SentinelGroup],
) -> None:
    stack, group = sentinel_stack
    assert type(stack.store).__name__ == "RedisSentinelStore"
    assert stack.store.master_name == MASTER_NAME

    def kill() -> tuple[float, Callable[[], None]]:
        t = time.monotonic()
        # a failed election is retried after twice the 10 s failover-timeout
        old, _new = group.fail_over(timeout=120)
        return time.monotonic() - t, lambda: group.restart(old)

    run = run_failover(stack, "sentinel", kill, WAIT_REPLICAS)
    assert run.duplicates == {} and run.lost == []
