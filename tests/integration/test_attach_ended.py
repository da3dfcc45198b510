"""A copy attached to an attempt that ends without an outcome runs the action itself, once.

Real ``celery worker -P prefork`` processes on a Redis broker and on RabbitMQ (Redis holds the
results, the store and the ledger). The tasks' copies attach at enqueue. The attempt a copy
follows is killed by its time limit (3 s, hard; a 5 s lease), or was revoked with
``terminate=True`` just before the copy came (no time limit; a 30 s lease): its claim stays held
until the lease runs out, and no outcome is ever recorded. Effects are counted in the ledger, not
in results.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from billiard.exceptions import TimeLimitExceeded
from celery.exceptions import TaskRevokedError

from celery_idem.attach import AttachedResult
from celery_idem.records import State
from tests.integration import app as tasks
from tests.integration.conftest import Cluster
from tests.integration.harness import wait_for

pytestmark = [pytest.mark.worker, pytest.mark.crash]

task = tasks.limited_attach


@pytest.fixture(params=["redis", "amqp"])
def cluster_on(request: pytest.FixtureRequest, make_cluster: Callable[..., Cluster]) -> Cluster:
    """A cluster whose broker is the shared Redis, or RabbitMQ (one queue per test)."""
    return make_cluster(IDEM_BROKER=str(request.getfixturevalue(f"{request.param}_url")))


def _start(cluster: Cluster, order: str, marker: Path,
           task: Any = task) -> tuple[object, tuple[str, str, int]]:
    """Enqueue the action with a body that holds for a minute; wait until it runs."""
    args = (order, str(marker), 60)
    first = task.apply_async(args)
    wait_for(lambda: marker.exists() and marker.read_text().strip(), what="the body to start")
    rec = cluster.store.get(task.idempotency_key_for(args))
    assert rec is not None and rec.state is State.IN_PROGRESS
    return first, args


def test_a_retry_attached_to_an_attempt_killed_by_its_time_limit_runs_the_action_once(
    cluster_on: Cluster, tmp_path: Path,
) -> None:
    cluster = cluster_on
    w = cluster.worker(concurrency=2)
    order = "ord_attach_tl"
    first, args = _start(cluster, order, tmp_path / "pids")
    # Given the caller's retry, enqueued while the first attempt runs: it attaches to it
    retry = task.apply_async(args)
    assert isinstance(retry, AttachedResult) and retry.id == first.id
    # When the hard time limit kills the first attempt before its effect
    with pytest.raises(TimeLimitExceeded):
        first.get(timeout=30)
    cluster.set_flag(f"release:{order}")  # the next run commits its effect at once
    # Then the retry's caller gets the action's result, from a run of its own message
    out = retry.get(timeout=60)
    assert out["order_id"] == order
    # Once: by the retry's own message, or by the killed attempt's redelivered message when it
    # claims the key first (then the retry's message, published too, is answered from the record).
    effects = cluster.effects(f"charge:{order}")
    assert len(effects) == 1, effects
    if retry.followed is not None:
        assert retry.followed.id != first.id and effects[0] in (retry.followed.id, first.id)
    else:
        assert effects == [first.id]
    assert retry.state == "SUCCESS"
    assert f"exceeded for {task.name}[{first.id}]" in w.text()


def test_a_revoke_cancels_the_copies_attached_before_it_not_a_copy_enqueued_after_it(
    cluster_on: Cluster, tmp_path: Path,
) -> None:
    # The task has no time limit (a revoke that comes later than 3 s is still a revoke), and a
    # 30 s lease: the copy enqueued after the REVOKED result must still find the dead attempt's
    # claim held, however long the revoke and its result take on a loaded machine.
    task = tasks.revocable_attach
    cluster = cluster_on
    cluster.worker(concurrency=2)
    # Given a copy attached to a running attempt, and the shared action revoked after that
    cancelled, cancelled_args = _start(cluster, "ord_attach_cancelled", tmp_path / "pids-c", task)
    attached = task.apply_async(cancelled_args)
    assert isinstance(attached, AttachedResult)
    attached.revoke(terminate=True)
    # Then both callers see the cancel, and that action never runs
    with pytest.raises(TaskRevokedError):
        cancelled.get(timeout=30)
    with pytest.raises(TaskRevokedError):
        attached.get(timeout=30)
    assert attached.followed is None
    order = "ord_attach_revoked"
    first, args = _start(cluster, order, tmp_path / "pids", task)
    # Given an attempt revoked with terminate=True: its process is gone, its claim held
    first.revoke(terminate=True)
    with pytest.raises(TaskRevokedError):
        first.get(timeout=30)
    cluster.set_flag(f"release:{order}")
    # When a copy of the action is enqueued right after: it attaches to the revoked attempt
    copy = task.apply_async(args)
    assert isinstance(copy, AttachedResult) and copy.id == first.id
    # Then the copy runs the action (the revoke came before it) and gets its result: its own
    # message takes the key over once the dead attempt's lease runs out (at most 30 s)
    out = copy.get(timeout=120)
    assert out["order_id"] == order
    assert copy.followed is not None
    assert cluster.effects(f"charge:{order}") == [copy.followed.id]
    assert cluster.effects("charge:ord_attach_cancelled") == []
