"""Time limits with real workers: a duplicate that waits is never failed by its own limit.

Each test leaves the action with one message: a duplicate with a 3 s soft or hard limit, from
the task option, the app setting or the call, on a Redis broker and on RabbitMQ. It finds the
key held by a holder that died right after its claim: an in-progress record whose 5 s lease
nobody renews (the store's state after a SIGKILL, written here directly, so the test does not
depend on how fast the pool notices a dead child). A wait to the end of the lease would be cut
off by the limit: FAILURE, message acknowledged, 0 effects. One more test kills a real holder
and lets its redelivered message be the duplicate. Effects are counted in the ledger, not in
results.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from billiard.exceptions import TimeLimitExceeded

from celery_idem.records import ClaimStatus, State
from tests.integration import app as tasks
from tests.integration.conftest import Cluster
from tests.integration.harness import wait_for

pytestmark = [pytest.mark.worker, pytest.mark.crash]

LIMIT = 3


@pytest.fixture(params=["redis", "amqp"])
def broker(request: pytest.FixtureRequest) -> str:
    """The broker URL: the shared Redis, or RabbitMQ (one queue per test, deleted after)."""
    return str(request.getfixturevalue(f"{request.param}_url"))


def _setup(source: str, kind: str) -> tuple[Any, dict[str, str], dict[str, Any]]:
    """The task, the worker's environment and the call's options that set a ``kind`` limit."""
    option = "soft_time_limit" if kind == "soft" else "time_limit"
    if source == "task":
        return (tasks.limited_soft if kind == "soft" else tasks.limited_hard), {}, {}
    if source == "app":
        return tasks.limited, {"IDEM_CONF": json.dumps({f"task_{option}": LIMIT})}, {}
    return tasks.limited, {}, {option: LIMIT}


def _assert_never_failed_by_its_limit(log: str, task_id: str, key: str) -> None:
    assert f"celery_idem requeued key={key} task_id={task_id}" in log  # the wait was cut short
    assert f"[{task_id}] raised" not in log, log[-3000:]  # how Celery logs a FAILURE


@pytest.mark.parametrize("kind", ["soft", "hard"])
@pytest.mark.parametrize("source", ["task", "app", "call"])
def test_a_duplicate_waiting_on_a_dead_holders_lease_is_not_failed_by_its_own_time_limit(
    make_cluster: Callable[..., Cluster], broker: str, source: str, kind: str, tmp_path: Path,
) -> None:
    task, env, options = _setup(source, kind)
    cluster = make_cluster(IDEM_BROKER=broker, **env)
    w = cluster.worker(concurrency=1)
    order = f"ord_tl_{source}_{kind}"
    args = (order, str(tmp_path / "pids"))
    key = task.idempotency_key_for(args)
    # Given a holder that died right after its claim: the key is leased for 5 s more
    held = cluster.store.claim(key, owner="dead:1", task_id="t-dead", attempt=0,
                               lease=tasks._LIMITED["idempotency_lease"], ttl=600)
    assert held.status is ClaimStatus.CLAIMED
    # When the action's last message arrives, with a 3 s limit, and finds the key busy
    dup = task.apply_async(args, **options)
    out = dup.get(timeout=60)
    # Then the action ran exactly once, in that message, once the lease ran out (a takeover)
    assert cluster.effects(f"charge:{order}") == [dup.id]
    assert out["token"] > held.token
    # And its wait was cut short by re-queues, never by its own limit
    log = w.text()
    _assert_never_failed_by_its_limit(log, dup.id, key)
    assert f"exceeded for {task.name}[{dup.id}]" not in log, log[-3000:]


def test_a_redelivered_message_waiting_on_its_killed_holders_lease_is_not_failed_by_its_limit(
    cluster: Cluster, tmp_path: Path,
) -> None:
    task = tasks.limited_soft_redelivered
    w = cluster.worker(concurrency=1)
    order = "ord_tl_redelivered"
    marker = tmp_path / "pids"
    args = (order, str(marker))
    # Given a holder whose child is SIGKILLed right after its claim (20 s lease, 3 s soft limit)
    r = task.apply_async(args, {"die": True})
    # When its message is redelivered (within about 5 s idle) and finds the key still leased
    out = r.get(timeout=90)
    # Then the action ran exactly once, in the redelivered message, after a takeover
    assert cluster.effects(f"charge:{order}") == [r.id]
    key = task.idempotency_key_for(args)
    assert f"celery_idem takeover key={key} task_id={r.id}" in w.text()
    rec = cluster.store.get(key)
    assert rec is not None and rec.state is State.DONE and rec.token == out["token"]
    assert len(marker.read_text().split()) == 2  # the killed holder's body, and one more
    # (The dead holder's job may still log "Soft time limit exceeded" under the same task id:
    # the pool notices the death after the limit. A SIGUSR1 to a dead process does nothing.)
    _assert_never_failed_by_its_limit(w.text(), r.id, key)


def test_a_hard_limit_in_the_body_holds_the_claim_until_its_lease_ends_then_the_next_duplicate_runs(
    cluster: Cluster, tmp_path: Path,
) -> None:
    # time_limit=3 and a 15 s lease: with the 5 s lease of limited_hard, the claim could run out
    # 3.3 s after the kill, before a loaded machine's test sends the duplicate, which would then
    # take over at once instead of waiting
    task = tasks.limited_hard_held
    lease = task.idempotency_lease
    w = cluster.worker(concurrency=1)
    order = "ord_tl_body"
    marker = tmp_path / "pids"
    args = (order, str(marker), 60)
    key = task.idempotency_key_for(args)
    # Given a body that runs into its hard time limit (3 s) before its effect
    first = task.apply_async(args)
    wait_for(lambda: first.state == "FAILURE", timeout=30, what="the hard limit to fail it")
    with pytest.raises(TimeLimitExceeded):
        first.get(timeout=5)
    killed_at = time.monotonic()
    # Then the killed child's claim stays held (no heartbeat) until its lease ends
    rec = cluster.store.get(key)
    assert rec is not None and rec.state is State.IN_PROGRESS
    # When the next duplicate of the action arrives
    cluster.set_flag(f"release:{order}")
    dup = task.apply_async(args)
    out = dup.get(timeout=60 + lease)
    # Then it waited and re-queued (never failed by its own limit), then took over (a higher token)
    # once the lease ran out, not at some later bound
    assert out["token"] > rec.token
    assert time.monotonic() - killed_at < lease + 25
    assert cluster.effects(f"charge:{order}") == [dup.id]
    log = w.text()
    assert f"celery_idem requeued key={key} task_id={dup.id}" in log
    assert f"celery_idem takeover key={key} task_id={dup.id}" in log
    assert f"exceeded for {task.name}[{first.id}]" in log  # the body's own kill
    assert f"exceeded for {task.name}[{dup.id}]" not in log
    assert len(marker.read_text().split()) == 2


def test_a_worker_whose_time_limit_leaves_no_wait_refuses_to_start_naming_the_setting(
    make_cluster: Callable[..., Cluster],
) -> None:
    cluster = make_cluster(IDEM_CONF=json.dumps({"task_soft_time_limit": 0.5}))
    with pytest.raises(AssertionError, match=r"task_soft_time_limit=0\.5 \(app setting\)"):
        cluster.worker()


def test_a_worker_warns_once_when_a_limit_cuts_the_wait_naming_both_settings(
    make_cluster: Callable[..., Cluster],
) -> None:
    cluster = make_cluster(IDEM_CONF=json.dumps({"task_time_limit": 4}))
    log = cluster.worker().text()
    warnings = [line for line in log.splitlines() if "idempotency_wait is longer" in line]
    assert len(warnings) == 1
    assert "idempotency_wait=10, task_time_limit=4 (app setting): waits at most 3.2 s" in warnings[0]
