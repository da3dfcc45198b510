"""Results follow Celery's rules: every result handle Celery hands out resolves.

An enqueue answered from the record publishes nothing; when the caller (or Celery, for a chain
step, a chord body or a frozen link) chose the task id, the recorded outcome is stored under
that id, so whoever waits on it hears. Results are stored as Celery stores them (through the
backend's ``prepare_value``), and a CachedResult works in a ResultSet or GroupResult. Real
prefork workers, Redis broker, backend and store.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
from celery import chain
from celery.result import AsyncResult, GroupResult, ResultSet

from celery_idem import CachedResult, TerminalError
from celery_idem.records import State
from tests.integration import app as base_tasks
from tests.integration import results_app as tasks
from tests.integration.conftest import Cluster
from tests.integration.harness import wait_for

pytestmark = pytest.mark.worker

APP = "tests.integration.results_app"




def fresh(result_id: str) -> AsyncResult:
    """A new handle on ``result_id``: nothing cached in it."""
    return AsyncResult(result_id, app=tasks.app)


def stored(result_id: str) -> dict[str, Any]:
    """The meta stored under ``result_id`` in the result backend (not this process's cache)."""
    meta: dict[str, Any] = tasks.app.backend.get_task_meta(result_id, cache=False)
    return meta


def test_an_id_chosen_by_freeze_or_task_id_resolves_when_the_key_is_done(
    cluster: Cluster, published: list[str]
) -> None:
    # Given a done action
    cluster.worker(app=APP)
    first = tasks.echo.delay("f1")
    assert first.get(timeout=30) == "f1"
    published.clear()

    # When it is enqueued again under an id frozen into the signature, or passed as task_id
    sig = tasks.echo.s("f1")
    frozen = sig.freeze()
    by_freeze = sig.apply_async()
    mine = f"mine-{uuid.uuid4().hex}"
    by_task_id = tasks.echo.apply_async(("f1",), task_id=mine)

    # Then nothing is published, each handle has the chosen id, and that id resolves for anyone
    assert published == []
    assert isinstance(by_freeze, CachedResult) and by_freeze.id == frozen.id
    assert isinstance(by_task_id, CachedResult) and by_task_id.id == mine
    assert by_freeze.original_task_id == by_task_id.original_task_id == first.id
    for chosen in (frozen.id, mine):
        meta = stored(chosen)
        assert (meta["status"], meta["result"], meta["task_id"]) == ("SUCCESS", "f1", chosen)
        assert fresh(chosen).get(timeout=10) == "f1"
    assert frozen.get(timeout=10) == "f1"
    assert cluster.effects("echo:f1") == [first.id]


def test_a_chosen_id_of_a_terminally_failed_key_raises_the_recorded_error(
    cluster: Cluster,
) -> None:
    cluster.worker(app=APP)
    with pytest.raises(TerminalError, match="declined d1"):
        tasks.echo_declined.delay("d1").get(timeout=30)
    mine = f"mine-{uuid.uuid4().hex}"
    again = tasks.echo_declined.apply_async(("d1",), task_id=mine)
    assert isinstance(again, CachedResult) and again.id == mine
    assert stored(mine)["status"] == "FAILURE"
    assert isinstance(stored(mine)["result"], TerminalError)
    with pytest.raises(TerminalError, match="declined d1"):
        fresh(mine).get(timeout=10)
    assert len(cluster.effects("declined:d1")) == 1


def test_a_chain_whose_last_step_repeats_an_earlier_action_returns(cluster: Cluster) -> None:
    cluster.worker(app=APP)
    # Step 2 gets step 1's result prepended: echo("x") again, the same action, the same key.
    # It is answered from the record, under step 2's own id, which the chain's result is.
    res = chain(tasks.echo.s("x"), tasks.echo.s()).apply_async()
    assert res.get(timeout=30) == "x"
    assert len(cluster.effects("echo:x")) == 1
    # The step is listed among step 1's children, as Celery lists a step it published (step 1's
    # own result is stored just after its chain was dispatched, so it may land after step 2's).
    children = wait_for(lambda: fresh(res.parent.id).children, timeout=10, what="step 1's result")
    assert [c.id for c in children] == [res.id]

    # A chain whose last step is an action done before: its final id resolves too.
    first = tasks.echo.delay("z")
    assert first.get(timeout=30) == "z"
    res = chain(tasks.echo.s("y"), tasks.echo.si("z")).apply_async()
    assert res.get(timeout=30) == "z"
    assert cluster.effects("echo:z") == [first.id]
    # And a chain run twice: every step is answered from its record, the result arrives.
    again = chain(tasks.echo.s("x"), tasks.echo.s()).apply_async()
    assert again.get(timeout=30) == "x"
    assert len(cluster.effects("echo:x")) == 1


def test_a_link_callback_answered_from_the_record_resolves(cluster: Cluster) -> None:
    cluster.worker(app=APP)
    first = tasks.echo.delay("l1")
    assert first.get(timeout=30) == "l1"
    # A frozen link: the caller holds its id.
    callback = tasks.echo.si("l1")
    callback_result = callback.freeze()
    parent = tasks.echo.apply_async(("l0",), link=callback)
    assert parent.get(timeout=30) == "l0"
    assert fresh(callback_result.id).get(timeout=10) == "l1"
    # A link not frozen: its handle is among the parent's children.
    parent = tasks.echo.apply_async(("l2",), link=tasks.echo.si("l1"))
    assert parent.get(timeout=30) == "l2"
    children = wait_for(lambda: fresh(parent.id).children, timeout=10, what="the children")
    assert [c.get(timeout=10) for c in children] == ["l1"]
    assert cluster.effects("echo:l1") == [first.id]


def _as_stored(value: Any) -> Any:
    """What Celery's JSON result backend hands back for ``value``."""
    return json.loads(json.dumps(value))


def test_a_body_that_returns_an_async_result_is_stored_as_celery_stores_it(
    cluster: Cluster,
) -> None:
    cluster.worker(app=APP)
    celery_says = tasks.plain_spawn.delay("a").get(timeout=30)
    assert celery_says == _as_stored(AsyncResult("a-child", app=tasks.app).as_tuple())

    # The first run, a duplicate the worker answers from the record, and an enqueue answered
    # from the record all return what plain Celery's get() returns.
    first = tasks.spawn.delay("a")
    assert first.get(timeout=30) == celery_says
    key = tasks.spawn.idempotency_key_for(("a",))
    assert cluster.store.get(key).state is State.DONE  # recorded, not an encoding failure
    dup = tasks.spawn.apply_async(("a",), link_error=base_tasks.plain.si("x"))  # reaches the worker
    assert not isinstance(dup, CachedResult)
    assert dup.get(timeout=30) == celery_says
    cached = tasks.spawn.delay("a")
    assert isinstance(cached, CachedResult) and cached.get(timeout=5) == celery_says
    assert len(cluster.effects("spawn:a")) == 1

    # A GroupResult, likewise
    group_result = tasks.spawn_group.delay("g").get(timeout=30)
    expected = GroupResult("g-group", [fresh("g-a"), fresh("g-b")], app=tasks.app).as_tuple()
    assert group_result == _as_stored(expected)
    assert tasks.spawn_group.delay("g").get(timeout=5) == group_result


def test_result_sets_and_group_results_holding_a_cached_result_join(cluster: Cluster) -> None:
    cluster.worker(app=APP)
    # The first handles stay referenced: before Celery 5.7 the result consumer keeps one
    # handle per task id, and a collected handle's __del__ cancels the wait of another handle
    # of its id (the cached result's), at whatever moment the collector runs (docs/compat.md).
    first, first_failed = tasks.echo.delay("s1"), tasks.echo_declined.delay("s2")
    assert first.get(timeout=30) == "s1"
    with pytest.raises(TerminalError):
        first_failed.get(timeout=30)
    cached = tasks.echo.delay("s1")
    failed = tasks.echo_declined.delay("s2")
    assert isinstance(cached, CachedResult) and isinstance(failed, CachedResult)
    live = tasks.echo.delay("s3")

    # A cached result first (the set asks it for the backend), and after a live one
    assert ResultSet([cached, live]).get(timeout=30) == ["s1", "s3"]
    assert ResultSet([live, cached]).get(timeout=30) == ["s3", "s1"]
    assert ResultSet([cached, live]).join(timeout=30) == ["s1", "s3"]
    assert ResultSet([cached, live]).join_native(timeout=30) == ["s1", "s3"]
    group = GroupResult(uuid.uuid4().hex, [cached, live])
    assert group.get(timeout=30) == ["s1", "s3"] and group.join(timeout=30) == ["s1", "s3"]
    assert GroupResult(uuid.uuid4().hex, [cached]).join_native(timeout=30) == ["s1"]
    assert [v for _, v in cached.collect(timeout=10)] == ["s1"]
    assert ResultSet([cached]).ready() and ResultSet([cached]).completed_count() == 1

    # A recorded failure propagates, or is handed back with propagate=False
    with pytest.raises(TerminalError, match="declined s2"):
        ResultSet([cached, failed]).get(timeout=30)
    with pytest.raises(TerminalError, match="declined s2"):
        ResultSet([cached, failed]).join(timeout=30)
    values = ResultSet([cached, failed]).join_native(timeout=30, propagate=False)
    assert values[0] == "s1" and isinstance(values[1], TerminalError)
