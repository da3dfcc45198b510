"""Behaviour through real ``celery worker`` processes, Redis broker, backend and store."""

from __future__ import annotations

import pytest
from celery.signals import before_task_publish

from celery_idem import CachedResult, IdempotencyKeyMismatch, TerminalError
from tests.integration import app as tasks
from tests.integration.conftest import Cluster
from tests.integration.harness import wait_for

pytestmark = pytest.mark.worker


def test_first_attempt_claims_runs_once_and_records(cluster: Cluster) -> None:
    cluster.worker()
    r = tasks.charge.delay("ord_1", 4200)
    out = r.get(timeout=30)
    assert out["effects"] == 1 and out["token"] > 1_000_000_000_000_000  # a clock token
    rec = cluster.store.get(out["key"])
    assert rec.state.value == "done" and rec.task_id == r.id and rec.token == out["token"]
    assert cluster.effects("charge:ord_1") == [r.id]


def test_second_enqueue_of_a_done_key_publishes_nothing_and_resolves_at_once(cluster: Cluster) -> None:
    cluster.worker()
    first = tasks.charge.delay("ord_2", 4200)
    value = first.get(timeout=30)
    published: list[str] = []

    def count(sender: object = None, headers: dict | None = None, **_: object) -> None:
        published.append((headers or {}).get("id", ""))

    before_task_publish.connect(count, weak=False)
    try:
        second = tasks.charge.delay("ord_2", 4200, note="retry by the agent")
        tasks.charge.delay("ord_2b", 1).get(timeout=30)  # proves the counter sees publishes
    finally:
        before_task_publish.disconnect(count)
    assert len(published) == 1
    assert isinstance(second, CachedResult)
    assert second.id == first.id and second.get(timeout=1) == value
    assert len(cluster.effects("charge:ord_2")) == 1


def test_duplicate_delivered_to_the_worker_does_not_run_and_gets_the_cached_result(cluster: Cluster) -> None:
    cluster.worker()
    first = tasks.charge.delay("ord_3", 4200)
    value = first.get(timeout=30)
    # A duplicate that reaches the worker anyway (as a redelivery or a racing enqueue does):
    # publish with a canvas option, which skips the producer-side short-circuit.
    dup = tasks.charge.apply_async(("ord_3", 4200), link_error=tasks.plain.si("x"))
    assert not isinstance(dup, CachedResult)
    assert dup.get(timeout=30) == value
    assert len(cluster.effects("charge:ord_3")) == 1


def test_concurrent_duplicate_waits_for_the_holder_and_ends_with_its_result(cluster: Cluster) -> None:
    cluster.worker(concurrency=2)
    # The holder runs until released (a fixed hold could end before a slow test enqueues the
    # duplicate, which the record would then answer at enqueue)
    holder = tasks.charge.delay("ord_4", 100, hold=60)
    wait_for(lambda: cluster.store.get(tasks.charge.idempotency_key_for(("ord_4", 100))),
             what="the holder's claim")
    dup = tasks.charge.delay("ord_4", 100, hold=60)
    assert not isinstance(dup, CachedResult)
    assert not dup.ready()  # it waits: the holder still runs
    cluster.set_flag("release:ord_4")
    assert dup.get(timeout=30) == holder.get(timeout=30)
    assert len(cluster.effects("charge:ord_4")) == 1


def test_timeout_error_releases_and_autoretry_runs_through_the_gate_again(cluster: Cluster) -> None:
    cluster.worker()
    r = tasks.flaky.delay("ord_5", fail_times=2)
    out = r.get(timeout=30)
    assert out["attempts"] == 3 and out["retries"] == 2
    assert len(cluster.effects("charge:ord_5")) == 1
    rec = cluster.store.get(tasks.flaky.idempotency_key_for(("ord_5",), {"fail_times": 2}))
    tokens = [int(t) for t in cluster.effects("token:ord_5")]
    assert len(tokens) == 3 and tokens == sorted(set(tokens))  # one claim per attempt, higher each
    assert rec.state.value == "done" and rec.token == tokens[-1]


def test_terminal_error_is_recorded_and_duplicates_reraise_without_running(cluster: Cluster) -> None:
    cluster.worker()
    r = tasks.declined.delay("ord_6")
    with pytest.raises(TerminalError, match="card declined for ord_6"):
        r.get(timeout=30)
    again = tasks.declined.delay("ord_6")
    assert isinstance(again, CachedResult)
    with pytest.raises(TerminalError, match="card declined for ord_6"):
        again.get(timeout=5)
    dup = tasks.declined.apply_async(("ord_6",), link_error=tasks.plain.si("x"))
    with pytest.raises(TerminalError, match="card declined for ord_6"):
        dup.get(timeout=30)
    assert len(cluster.effects("charge:ord_6")) == 1


def test_validate_refuses_the_same_key_with_another_payload(cluster: Cluster) -> None:
    cluster.worker()
    assert tasks.validated.apply_async(("ord_7", 1), idempotency_key="k-7").get(timeout=30) == 1
    dup = tasks.validated.apply_async(("ord_7", 2), idempotency_key="k-7",
                                      link_error=tasks.plain.si("x"))
    with pytest.raises(IdempotencyKeyMismatch):
        dup.get(timeout=30)
    assert len(cluster.effects("charge:ord_7")) == 1


def test_send_task_by_name_derives_the_key_on_the_worker(cluster: Cluster) -> None:
    cluster.worker()
    first = tasks.app.send_task("tests.integration.app.charge", ("ord_8", 5))
    second = tasks.app.send_task("tests.integration.app.charge", ("ord_8", 5), {"note": "again"})
    assert first.get(timeout=30) == second.get(timeout=30)
    assert len(cluster.effects("charge:ord_8")) == 1


def test_a_busy_duplicate_requeues_itself_without_using_max_retries(cluster: Cluster) -> None:
    # Given a holder that runs well past the duplicate's 0.3 s wait, and max_retries=0
    w = cluster.worker(concurrency=2)
    holder = tasks.impatient.delay("ord_9", hold=30)
    wait_for(lambda: cluster.store.get(tasks.impatient.idempotency_key_for(("ord_9",))),
             what="the holder's claim")
    # (a canvas option: the copy is published, not attached to the holder at enqueue)
    dup = tasks.impatient.apply_async(("ord_9",), {"hold": 30}, link_error=tasks.plain.si("x"))
    # When it has re-queued itself a few times
    wait_for(lambda: w.text().count("celery_idem requeued") >= 2, timeout=30, what="re-queues")
    cluster.set_flag("release:ord_9")
    # Then it still ends with the holder's result: re-queues are not retries
    assert dup.get(timeout=30) == holder.get(timeout=30)
    assert cluster.effects("charge:ord_9") == [holder.id]
