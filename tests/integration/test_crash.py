"""SIGKILL, slow bodies and a store that goes away, with real workers."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from tests.integration import app as tasks
from tests.integration.conftest import Cluster
from tests.integration.harness import RedisServer, wait_for

pytestmark = [pytest.mark.worker, pytest.mark.crash]


def claim_tokens(marker: Path) -> list[int]:
    """The tokens slow_charge's claims got, in the order they ran (tests/integration/app.py)."""
    path = Path(f"{marker}.tokens")
    return [int(t) for t in path.read_text().split()] if path.exists() else []


def test_holder_killed_mid_body_is_taken_over_after_its_lease_with_token_plus_one(
    cluster: Cluster, tmp_path: Path
) -> None:
    # Given a worker whose child is running a body that has not committed its effect yet
    w = cluster.worker(concurrency=1)
    marker = tmp_path / "pids"
    r = tasks.slow_charge.delay("ord_k1", str(marker), 60)
    # When the child is SIGKILLed before the commit
    killed = w.kill_child_running(marker)
    # Then the redelivered message waits out the lease (2 s), takes over with a higher token
    wait_for(lambda: len(marker.read_text().split()) >= 2, timeout=40, what="the takeover")
    cluster.set_flag("release:ord_k1")
    out = r.get(timeout=40)
    t1, t2 = claim_tokens(marker)
    assert out["token"] == t2 > t1 and out["pid"] != killed and out["redelivered"]
    assert cluster.effects("charge:ord_k1") == [r.id]
    assert "celery_idem takeover" in w.text()


def test_a_slow_body_keeps_its_lease_alive_and_is_never_taken_over(cluster: Cluster, tmp_path: Path) -> None:
    # Given a body that runs 3x its 2 s lease
    cluster.worker(concurrency=2)
    marker = tmp_path / "pids"
    holder = tasks.slow_charge.delay("ord_k2", str(marker), 6)
    wait_for(marker.exists, what="the holder to start")
    # When a duplicate arrives while it runs
    dup = tasks.slow_charge.delay("ord_k2", str(marker), 6)
    # Then the duplicate never runs the body: the heartbeat renewed the lease
    assert dup.get(timeout=40) == holder.get(timeout=40)
    assert [holder.get()["token"]] == claim_tokens(marker)  # one claim, never taken over
    assert len(marker.read_text().split()) == 1
    assert len(cluster.effects("charge:ord_k2")) == 1


def test_store_unreachable_at_claim_runs_no_body_until_it_is_back(make_cluster) -> None:  # type: ignore[no-untyped-def]
    store = RedisServer()
    try:
        cluster: Cluster = make_cluster(IDEM_STORE=store.url)
        w = cluster.worker(concurrency=1)
        # Given the store is down
        store.stop(signal.SIGKILL)
        # When a task is enqueued
        r = tasks.charge.delay("ord_k3", 7)
        # Then it is re-queued (at least twice) and its body never runs meanwhile
        wait_for(lambda: w.text().count("celery_idem requeued") >= 2, timeout=40,
                 what="two re-queues while the store is down")
        assert cluster.effects("charge:ord_k3") == []
        # And once the store is back, the action completes exactly once
        store.start()
        assert r.get(timeout=60)["order_id"] == "ord_k3"
        assert len(cluster.effects("charge:ord_k3")) == 1
    finally:
        store.cleanup()


def test_worker_main_process_killed_the_message_comes_back_and_runs_once(
    make_cluster, tmp_path: Path  # type: ignore[no-untyped-def]
) -> None:
    # A private broker: a 4 s visibility timeout restores every old unacknowledged message of
    # the broker's database, and the shared Redis carries other suites' messages.
    broker = RedisServer()
    workers = []
    try:
        cluster: Cluster = make_cluster(IDEM_BROKER=broker.url, IDEM_VISIBILITY="4")
        workers = cluster.workers
        w1 = cluster.worker("a", concurrency=1)
        marker = tmp_path / "pids"
        sent = time.time()
        r = tasks.slow_charge.delay("ord_k4", str(marker), 60)
        wait_for(marker.exists, what="the body to start")
        w1.kill()  # main process and child: the message stays unacked in Redis
        # A worker that starts once the message is older than the visibility timeout restores it
        # at once, on every kombu (the periodic scan is every 100 s before kombu 5.7; see
        # test_recovery.py)
        wait_for(lambda: time.time() - sent > 4.5, timeout=10, what="the visibility timeout")
        cluster.worker("b", concurrency=1)
        wait_for(lambda: len(marker.read_text().split()) >= 2, timeout=60, what="the redelivery")
        cluster.set_flag("release:ord_k4")
        t1, t2 = claim_tokens(marker)
        assert r.get(timeout=60)["token"] == t2 > t1
        assert len(cluster.effects("charge:ord_k4")) == 1
        assert os.path.exists(marker)
    finally:
        for w in workers:
            w.kill()  # before the broker goes: a warm shutdown would wait for it
        broker.cleanup()


def test_a_paused_holder_that_lost_its_lease_cannot_overwrite_the_new_holder(
    cluster: Cluster, tmp_path: Path
) -> None:
    from celery_idem import LeaseLost

    # Given holder A running a body, frozen (SIGSTOP) past its 2 s lease
    a = cluster.worker("a", concurrency=1)
    marker = tmp_path / "pids"
    first = tasks.slow_charge.delay("ord_k5", str(marker), 60)
    pid_a = int(wait_for(lambda: marker.exists() and marker.read_text().split(), what="A")[0])
    os.kill(pid_a, signal.SIGSTOP)
    try:
        # When a duplicate reaches worker B, it takes over once the lease has run out
        cluster.worker("b", concurrency=1)
        # (a canvas option: the copy is published, not attached to A's claim at enqueue)
        second = tasks.slow_charge.apply_async(("ord_k5", str(marker), 60),
                                               link_error=tasks.plain.si("x"))
        wait_for(lambda: len(marker.read_text().split()) >= 2, timeout=40, what="B's takeover")
        cluster.set_flag("release:ord_k5")
        t1, t2 = claim_tokens(marker)
        assert second.get(timeout=40)["token"] == t2 > t1
    finally:
        os.kill(pid_a, signal.SIGCONT)
    # Then A, resumed, finishes its body but its record is fenced off: LeaseLost, loudly
    with pytest.raises(LeaseLost):
        first.get(timeout=40)
    rec = cluster.store.get(tasks.slow_charge.idempotency_key_for(("ord_k5", "", 0)))
    assert rec.state.value == "done" and rec.token == t2 and rec.task_id == second.id
    assert "celery_idem lease_lost" in a.text()
    # The body itself did run twice: only a remote that checks the token can refuse A's write
    # (see docs/limits.md); what the gate guarantees is that A cannot overwrite B's record.
    assert len(cluster.effects("charge:ord_k5")) == 2
