"""Decisions made at enqueue, in Flower: ``delay()`` of a done key publishes nothing, but its
``answered`` event reaches Flower's task page, its API and ``celery_idem_decisions_total``."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from celery_idem import CachedResult
from celery_idem.config import forget_settings
from tests.flower.conftest import Stack, decisions
from tests.integration import app as tasks

pytestmark = pytest.mark.worker

CHARGE = "tests.integration.app.charge"


@pytest.fixture
def producer_events(stack: Stack) -> Iterator[None]:
    """The test process as a producer that sends events (``idempotency_events = True``)."""
    conf = tasks.app.conf
    saved = conf.get("idempotency_events")
    conf.idempotency_events = True
    forget_settings(tasks.app)  # settings are read once per app: read the change
    try:
        yield
    finally:
        conf.idempotency_events = saved
        forget_settings(tasks.app)


def test_an_enqueue_answered_from_the_record_is_shown_and_counted_in_flower(
    stack: Stack, producer_events: None,
) -> None:
    before = stack.flower.metrics()
    first = tasks.charge.delay("fl_enqueue", 500)
    first.get(timeout=30)
    # When the same action is enqueued again, under an id the caller chose
    chosen = f"chosen-{uuid.uuid4().hex}"
    again = tasks.charge.apply_async(("fl_enqueue", 500), task_id=chosen)
    # Then nothing was published (the answer came from the record) ...
    assert isinstance(again, CachedResult) and again.get(timeout=5) == first.get()
    # ... and Flower shows the decision on that id: answered, from which task, at enqueue
    info = stack.flower.wait_task(
        chosen, lambda t: t.get("idempotency_outcomes") == ["answered"], what="the answered enqueue")
    assert info["name"] == CHARGE
    assert info["idempotency_key"] == tasks.charge.idempotency_key_for(("fl_enqueue", 500))
    assert info["original_task_id"] == first.id
    assert info["idempotency_record_state"] == "done"
    assert info["idempotency_detail"] == "at=enqueue"
    # And counts it by task and outcome, next to the worker's decisions
    stack.flower.wait_task(first.id, lambda t: "recorded" in (t.get("idempotency_outcomes") or []))
    after = stack.flower.metrics()
    assert decisions(after, CHARGE, "answered") - decisions(before, CHARGE, "answered") == 1
