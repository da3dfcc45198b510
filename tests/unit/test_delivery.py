"""celery_idem.delivery: one delivery through the gate, its re-queue, and its result write.

A worker's delivery is reproduced in the test process: the task's request pushed as the worker
pushes it (not eager, not a direct call), the store ``memory://`` (a key made busy by a claim of
another owner), and the broker kombu's in-memory transport, so a re-queue really publishes.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from celery.exceptions import Ignore, Reject, Retry
from celery.signals import before_task_publish

from celery_idem import IdempotentTask
from celery_idem.app import get_store
from celery_idem.delivery import (
    BUSY_FIRST,
    BUSY_MAX,
    OUTAGE_HEADER,
    REQUEUES_HEADER,
    requeue,
    write_result,
)
from celery_idem.exceptions import StoreUnavailable
from celery_idem.gate import RunOutcome
from celery_idem.probe import requeue_delay


@pytest.fixture
def app() -> Celery:
    app = Celery("test_delivery", broker="memory://", set_as_current=False)
    app.conf.update(idempotency_store="memory://", task_publish_retry=False)
    return app


@pytest.fixture
def published() -> Iterator[list[dict[str, Any]]]:
    """The headers of every message published while the test runs."""
    seen: list[dict[str, Any]] = []

    def record(sender: Any = None, headers: dict[str, Any] | None = None, **_: Any) -> None:
        seen.append(dict(headers or {}))

    before_task_publish.connect(record, weak=False)
    yield seen
    before_task_publish.disconnect(record)


def make_task(app: Celery, runs: list[str]) -> Any:
    @app.task(base=IdempotentTask, bind=True, shared=False, name="shop.charge")
    def charge(self: Any, order: str) -> str:
        runs.append(order)
        return f"charged {order}"

    return charge


def busy(task: Any, order: str, lease: float = 60) -> str:
    """Claim ``order``'s key for another worker: its deliveries find the key busy."""
    key: str = task.idempotency_key_for((order,))
    got = get_store(task.app).claim(key, owner="other:1", task_id="other-task", attempt=0,
                                    lease=lease, ttl=600)
    assert got.status.holds, got
    return key


def deliver_as_worker(task: Any, order: str, requeues: int | None = None,
                      header: str = REQUEUES_HEADER) -> Any:
    """Call ``task`` as a worker delivers a message (``requeues``: its ``header`` count)."""
    headers = {} if requeues is None else {header: requeues}
    task.push_request(id="t-1", args=[order], kwargs={}, headers=headers, retries=0,
                      is_eager=False, called_directly=False, delivery_info={})
    try:
        return task(order)
    finally:
        task.pop_request()


@pytest.mark.parametrize(("requeues", "countdown"), [
    (None, BUSY_FIRST), (1, 2 * BUSY_FIRST), (3, 8 * BUSY_FIRST), (40, BUSY_MAX),
])
def test_a_busy_key_goes_back_to_the_broker_later_each_time(
    app: Celery, published: list[dict[str, Any]], requeues: int | None, countdown: float,
) -> None:
    runs: list[str] = []
    task = make_task(app, runs)
    busy(task, "o1")
    # When a worker delivers a copy of the action while another holds the key
    with pytest.raises(Retry) as retry:
        deliver_as_worker(task, "o1", requeues)
    # Then the body did not run; the copy is published again, counted, same id and retries,
    # with the back-off of its count (capped)
    assert runs == []
    assert retry.value.when == countdown
    [headers] = published
    assert headers[REQUEUES_HEADER] == (requeues or 0) + 1
    assert headers["id"] == "t-1" and headers["retries"] == 0
    assert "still in progress" in str(retry.value)


def test_a_store_outage_requeues_with_the_outage_delay(app: Celery,
                                                       published: list[dict[str, Any]]) -> None:
    # A Redis store that does not answer (nothing listens on port 1)
    app.conf.update(idempotency_store="redis://127.0.0.1:1/0")
    runs: list[str] = []
    task = make_task(app, runs)
    with pytest.raises(Retry) as retry:
        deliver_as_worker(task, "o2", requeues=2, header=OUTAGE_HEADER)
    assert runs == []
    assert isinstance(retry.value.exc, StoreUnavailable)
    assert retry.value.when == requeue_delay(2)
    assert [h[OUTAGE_HEADER] for h in published] == [3]


def test_the_last_outage_requeue_fails_the_callers_result_and_keeps_the_message(
        app: Celery, published: list[dict[str, Any]]) -> None:
    # A Redis store that does not answer, on the delivery after the last allowed re-queue
    app.conf.update(idempotency_store="redis://127.0.0.1:1/0", idempotency_store_requeues=3,
                    result_backend="cache+memory://")
    runs: list[str] = []
    task = make_task(app, runs)
    with pytest.raises(Ignore):
        deliver_as_worker(task, "o3", requeues=3, header=OUTAGE_HEADER)
    assert runs == []
    assert [h[OUTAGE_HEADER] for h in published] == [4]  # the message is kept
    failed = task.backend.get_task_meta("t-1")
    assert failed["status"] == "FAILURE" and "127.0.0.1:1/0" in str(failed["result"])


def test_a_requeue_that_cannot_publish_hands_the_message_back(app: Celery) -> None:
    # A broker that does not answer, and no publish retry: the copy cannot be published
    app.conf.update(broker_url="redis://127.0.0.1:1/0", broker_transport_options={
        "max_retries": 1, "interval_start": 0, "interval_step": 0})
    task = make_task(app, [])
    task.push_request(id="t-9", args=["o9"], kwargs={}, headers={}, retries=1, is_eager=False,
                      called_directly=False, delivery_info={})
    try:
        with pytest.raises(Reject) as rejected:
            requeue(task, countdown=1.0, reason="busy")
    finally:
        task.pop_request()
    # Reject(requeue=True): the broker redelivers the message, nothing is lost
    assert rejected.value.requeue is True


def test_an_eager_call_waits_in_place_for_a_busy_key(app: Celery,
                                                     published: list[dict[str, Any]]) -> None:
    runs: list[str] = []
    task = make_task(app, runs)
    # Given the key held by another worker whose lease runs out shortly (a dead holder)
    busy(task, "o3", lease=0.5)
    # When the action is applied eagerly: no broker to re-queue to
    result = task.apply(("o3",))
    # Then it waited in place, took the key over, and ran once; nothing was published
    assert result.get() == "charged o3" and runs == ["o3"]
    assert published == []


class Writer:
    """A result writer that records what it is asked to write."""

    folds = False

    def __init__(self, accepts: bool = True, builds: bool = True) -> None:
        self.accepts = accepts
        self.builds = builds
        self.written: list[Any] = []

    def build(self, req: Any, value: Any) -> Any:
        return ("built", value) if self.builds else None

    def write(self, write: Any) -> bool:
        self.written.append(write)
        return self.accepts


class Request:
    ignore_result = False


def test_a_result_that_rode_on_the_record_is_not_written_again() -> None:
    writer, req = Writer(), Request()
    write_result(writer, req, RunOutcome(1, ran=True, write=("w", 1), folded=True))  # type: ignore[arg-type]
    assert writer.written == [] and req.ignore_result is True


def test_a_result_not_folded_is_written_by_the_writer_and_celery_writes_nothing() -> None:
    writer, req = Writer(), Request()
    write_result(writer, req, RunOutcome(1, ran=True, write=("w", 1)))  # type: ignore[arg-type]
    assert writer.written == [("w", 1)] and req.ignore_result is True
    # An answer from the record carries no write: the writer builds one
    writer, req = Writer(), Request()
    write_result(writer, req, RunOutcome(2, ran=False))  # type: ignore[arg-type]
    assert writer.written == [("built", 2)] and req.ignore_result is True


def test_a_write_refused_or_not_built_is_left_to_celery() -> None:
    writer, req = Writer(accepts=False), Request()
    write_result(writer, req, RunOutcome(1, ran=True))  # type: ignore[arg-type]
    assert writer.written == [("built", 1)] and req.ignore_result is False
    writer, req = Writer(builds=False), Request()
    write_result(writer, req, RunOutcome(1, ran=True))  # type: ignore[arg-type]
    assert writer.written == [] and req.ignore_result is False
