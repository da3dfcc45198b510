"""celery_idem.attach: when an enqueue may attach, what it attaches to, and the AttachedResult.

In process: an app on kombu's ``memory://`` broker and the ``cache+memory://`` result backend
(not eager: an eager app never attaches), its store in memory. No worker runs; the holder's
outcome is written to the backend or the record by hand.
"""

from __future__ import annotations

import time
from typing import Any
from uuid import uuid4

import pytest
from celery import Celery
from celery.states import FAILURE, PENDING, SUCCESS

from celery_idem import IdempotentTask, TerminalError
from celery_idem import attach as attach_module
from celery_idem.attach import AttachedResult, attach, may_attach
from celery_idem.exceptions import IdempotencyKeyMismatch
from celery_idem.records import Record, Reservation, State


@pytest.fixture
def app() -> Celery:
    app = Celery("test_attach", broker="memory://", backend="cache+memory://",
                 set_as_current=False)
    app.conf.idempotency_store = "memory://"
    return app


def define(app: Celery) -> Any:
    @app.task(base=IdempotentTask, shared=False)
    def charge(order_id: str) -> str:
        return f"charged {order_id}"

    return charge


def running(key: str, *, lease_left: float = 60.0, payload_hash: str | None = None) -> Record:
    # The cache+memory:// backend is one per process: each holder gets an id of its own.
    return Record(key=key, state=State.IN_PROGRESS, token=2, task_id=f"holder-{uuid4()}",
                  lease_expires=time.time() + lease_left, payload_hash=payload_hash)


def test_may_attach_only_a_sent_call_with_a_backend_and_no_delay(app: Celery) -> None:
    charge = define(app)
    assert may_attach(charge, {})
    assert not may_attach(charge, {"countdown": 5})
    assert not may_attach(charge, {"eta": "2027-01-01T00:00:00"})
    eager = Celery("test_attach_eager", backend="cache+memory://", set_as_current=False)
    eager.conf.task_always_eager = True
    assert not may_attach(define(eager), {})
    no_backend = Celery("test_attach_no_backend", broker="memory://", set_as_current=False)
    assert not may_attach(define(no_backend), {})


def test_an_enqueue_attaches_to_a_live_claim(app: Celery) -> None:
    charge = define(app)
    holder = running("k-live")
    result = attach(charge, charge.idempotency_gate, "k-live", holder, ("o-1",), {}, {},
                    lambda: None)
    assert isinstance(result, AttachedResult)
    assert (result.id, result.original_task_id, result.idempotency_key) == \
        (holder.task_id, holder.task_id, "k-live")
    assert result.attached is True and result.followed is None
    assert result.state == PENDING


def test_an_enqueue_attaches_to_a_queued_messages_reservation(app: Celery) -> None:
    charge = define(app)
    result = attach(charge, charge.idempotency_gate, "k-res",
                    Reservation(task_id="queued-id", fingerprint="fp"), ("o-1",), {}, {},
                    lambda: "fp")
    assert result is not None and result.id == "queued-id"


@pytest.mark.parametrize("found", [
    Record(key="k", state=State.RELEASED, token=2, task_id="gone-id"),
    Record(key="k", state=State.DONE, token=2, task_id="done-id"),
])
def test_nothing_under_way_means_publish(app: Celery, found: Record) -> None:
    charge = define(app)
    assert attach(charge, charge.idempotency_gate, "k", found, (), {}, {}, lambda: None) is None


def test_an_expired_lease_is_not_attached_to(app: Celery) -> None:
    charge = define(app)
    assert attach(charge, charge.idempotency_gate, "k", running("k", lease_left=-1.0), (), {}, {},
                  lambda: None) is None


def test_other_arguments_under_a_busy_key_are_refused(app: Celery) -> None:
    charge = define(app)
    with pytest.raises(IdempotencyKeyMismatch, match="different arguments") as info:
        attach(charge, charge.idempotency_gate, "k-fp", running("k-fp", payload_hash="first"),
               (), {}, {}, lambda: "second")
    assert info.value.key == "k-fp"
    with pytest.raises(IdempotencyKeyMismatch):
        attach(charge, charge.idempotency_gate, "k-fp",
               Reservation(task_id="queued-id", fingerprint=None), (), {}, {}, lambda: "second")


def test_the_result_is_the_holders_in_the_backend(app: Celery) -> None:
    charge = define(app)
    result = attach(charge, charge.idempotency_gate, "k-b", running("k-b"), (), {}, {},
                    lambda: None)
    assert result is not None
    app.backend.store_result(result.id, "charged o-1", SUCCESS)
    assert result.state == SUCCESS
    assert result.get(timeout=5) == "charged o-1"


def test_an_outcome_only_in_the_record_resolves_the_handle(app: Celery,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(attach_module, "FOLLOW_STEP", 0.05)
    charge = define(app)
    gate = charge.idempotency_gate
    store = gate.store
    config = gate.config
    claim = store.claim("k-rec", owner="here", task_id="taker-id", attempt=0, lease=config.lease,
                        ttl=config.ttl)
    content_type, data = gate.codec.encode_result("charged by the taker")
    store.record("k-rec", claim.token, state=State.DONE, content_type=content_type, data=data,
                 ttl=config.ttl, claim_id=claim.claim_id)
    result = attach(charge, gate, "k-rec", running("k-rec"), (), {}, {}, lambda: None)
    assert result is not None
    # The holder (another task id) failed in the backend; the record has the action's outcome
    app.backend.store_result(result.id, RuntimeError("lost"), FAILURE)
    assert result.get(timeout=5) == "charged by the taker"
    assert (result.state, result.result) == (SUCCESS, "charged by the taker")
    assert result.followed is None


def test_a_recorded_failure_is_raised_by_get(app: Celery, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(attach_module, "FOLLOW_STEP", 0.05)
    charge = define(app)
    gate = charge.idempotency_gate
    config = gate.config
    claim = gate.store.claim("k-f", owner="here", task_id="taker-id", attempt=0,
                             lease=config.lease, ttl=config.ttl)
    content_type, data = gate.codec.encode_error(TerminalError("declined"))
    gate.store.record("k-f", claim.token, state=State.FAILED, content_type=content_type, data=data,
                      ttl=config.ttl, claim_id=claim.claim_id)
    result = attach(charge, gate, "k-f", running("k-f"), (), {}, {}, lambda: None)
    assert result is not None
    with pytest.raises(TerminalError, match="declined"):
        result.get(timeout=5)
    assert result.state == FAILURE
    assert isinstance(result.get(timeout=5, propagate=False), TerminalError)
