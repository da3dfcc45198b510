"""Decisions made at enqueue, in Flower: ``delay()`` of a done key publishes nothing, but its
``answered`` event reaches Flower's task page, its API and ``celery_idem_decisions_total``."""

from __future__ import annotations

import uuid

import pytest

from celery_idem import CachedResult
from tests.flower.conftest import Stack, decisions
from tests.integration import app as tasks

pytestmark = pytest.mark.worker

CHARGE = "tests.integration.app.charge"


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
    assert info["idempotency_context"] == "at=enqueue"
    # And counts it by task and outcome, next to the worker's decisions
    stack.flower.wait_task(first.id, lambda t: "recorded" in (t.get("idempotency_outcomes") or []))
    after = stack.flower.metrics()
    assert decisions(after, CHARGE, "answered") - decisions(before, CHARGE, "answered") == 1
