"""A copy of a running action attaches to it and never holds a worker.

Real ``celery worker -P prefork`` processes on Redis (broker, backend and store on one server,
so the enqueue check rides on the publish), and a SIGKILLed pool process.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from celery_idem.attach import AttachedResult
from celery_idem.config import accelerate_switch
from celery_idem.enqueue_redis import WithinPublish
from tests.integration import app as tasks
from tests.integration.conftest import Cluster
from tests.integration.harness import wait_for

pytestmark = pytest.mark.worker


@pytest.fixture(params=["store", "own"])
def answered_by(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Who tells a copy it may attach: the store (a copy from another process, or a moment
    later), or this process's memory of its own message (WithinPublish.mine), which with
    accelerations off does not exist."""
    if request.param == "own":
        if not accelerate_switch():
            pytest.skip("accelerations off: a copy always asks the store")
        monkeypatch.setattr(WithinPublish, "RECENT", 120.0)
    else:
        monkeypatch.setattr(WithinPublish, "RECENT", 0.0)
    return str(request.param)


def _claimed(cluster: Cluster, task: object, order_id: str) -> object:
    key = task.idempotency_key_for((order_id,))  # type: ignore[attr-defined]
    return wait_for(lambda: (rec := cluster.store.get(key)) is not None
                    and rec.state.value == "in_progress" and rec, what="the holder's claim")


def test_copies_of_a_running_action_publish_nothing_and_get_its_result(
    cluster: Cluster, published: list[str], answered_by: str,
) -> None:
    cluster.worker(concurrency=2)
    holder = tasks.held_action.delay("a-1", hold=30)
    _claimed(cluster, tasks.held_action, "a-1")
    # When 4 copies are enqueued while the body runs
    copies = [tasks.held_action.delay("a-1", hold=30) for _ in range(4)]
    # Then none is published: each attached to the holder's task id
    assert published == [holder.id]
    assert all(isinstance(c, AttachedResult) and c.id == holder.id for c in copies)
    # and the other pool process is free: an unrelated task is not queued behind copies
    started = time.monotonic()
    assert tasks.plain.delay("quick").get(timeout=10) == "quick"
    assert time.monotonic() - started < 2.0
    cluster.set_flag("release:a-1")
    value = holder.get(timeout=30)
    assert [c.get(timeout=30) for c in copies] == [value] * 4
    assert cluster.effects("action:a-1") == [holder.id]


def test_copies_enqueued_before_any_worker_claimed_attach_to_the_first_message(
    cluster: Cluster, published: list[str], answered_by: str,
) -> None:
    # Given no worker yet: the first message is still queued, no record exists
    first = tasks.held_action.delay("a-2")
    copies = [tasks.held_action.delay("a-2") for _ in range(4)]
    # Then the copies found the first enqueue's reservation and published nothing
    assert published == [first.id]
    assert all(isinstance(c, AttachedResult) and c.id == first.id for c in copies)
    cluster.worker(concurrency=2)
    value = first.get(timeout=30)
    assert [c.get(timeout=30) for c in copies] == [value] * 4
    assert cluster.effects("action:a-2") == [first.id]


def test_with_the_check_off_copies_are_published_but_hold_no_process(
    cluster: Cluster, published: list[str],
) -> None:
    w = cluster.worker(concurrency=2)
    holder = tasks.held_action_unchecked.delay("a-3", hold=30)
    _claimed(cluster, tasks.held_action_unchecked, "a-3")
    copies = [tasks.held_action_unchecked.delay("a-3", hold=30) for _ in range(4)]
    assert len(published) == 5  # the check is off: every copy goes out
    # Each copy finds the key busy and goes back with a countdown at once: the second pool
    # process stays free for other work.
    wait_for(lambda: w.text().count("celery_idem requeued") >= 4, what="the copies' re-queues")
    started = time.monotonic()
    assert tasks.plain.delay("quick").get(timeout=10) == "quick"
    assert time.monotonic() - started < 2.0
    cluster.set_flag("release:a-3")
    value = holder.get(timeout=30)
    assert [c.get(timeout=60) for c in copies] == [value] * 4
    assert cluster.effects("action:a-3") == [holder.id]


def test_copies_attached_to_a_killed_holder_get_the_takeovers_result(
    cluster: Cluster, published: list[str], tmp_path: Path, answered_by: str,
) -> None:
    w = cluster.worker(concurrency=2)
    marker = tmp_path / "pids"
    holder = tasks.held_action.delay("a-4", hold=60, marker=str(marker))
    _claimed(cluster, tasks.held_action, "a-4")
    copies = [tasks.held_action.delay("a-4", hold=60, marker=str(marker)) for _ in range(4)]
    assert published == [holder.id]
    # When the holder's pool process is SIGKILLed mid-body
    killed = w.kill_child_running(marker)
    # Then the redelivered message takes the claim over after the 3 s lease (another pid)
    wait_for(lambda: len(marker.read_text().split()) >= 2, timeout=60, what="the takeover")
    assert int(marker.read_text().split()[-1]) != killed
    cluster.set_flag("release:a-4")
    value = holder.get(timeout=60)
    assert [c.get(timeout=60) for c in copies] == [value] * 4
    # One body committed its effect in all (the killed one never reached it)
    assert cluster.effects("action:a-4") == [holder.id]
    assert "celery_idem takeover" in w.text()
