"""The log lines of answers given without running the body (eager mode, ``memory://`` store).

A worker's duplicate and waited answers, and a producer's enqueue answered from the record, log
one INFO line naming the original task id, never the arguments; ``idempotency_log_answers =
False`` moves them to DEBUG. The real-worker line is checked in tests/flower/test_logs.py.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
from celery import Celery

from celery_idem import IdempotencyKeyMismatch, IdempotentTask
from celery_idem.keys import payload_hash

SECRET = "SECRET-NOTE-7f3a"


@pytest.fixture
def app() -> Celery:
    app = Celery("test_answer_logs", set_as_current=False)
    app.conf.task_always_eager = True
    app.conf.idempotency_store = "memory://"
    return app


def make_task(app: Celery) -> Any:
    @app.task(base=IdempotentTask, bind=True, shared=False, idempotency_fields=("order_id",),
              idempotency_validate=True)
    def charge(self: Any, order_id: str, note: str = "") -> str:
        return f"charged {order_id}"

    return charge


def _lines(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "celery_idem" and r.levelno == level]


def test_an_enqueue_answered_from_the_record_logs_one_info_line_naming_the_original(
    app: Celery, caplog: pytest.LogCaptureFixture,
) -> None:
    charge = make_task(app)
    caplog.set_level(logging.DEBUG, "celery_idem")
    first = charge.delay("ord_1", note=SECRET)
    key = charge.idempotency_key_for(("ord_1",), {"note": SECRET})
    token = charge._gate.store.get(key).token
    caplog.clear()
    # When the same action is enqueued again: answered from the record, nothing published
    again = charge.apply_async(("ord_1",), {"note": SECRET}, task_id="chosen-id")
    assert again.get() == "charged ord_1"
    info = _lines(caplog, logging.INFO)
    assert info == [f"celery_idem answered key={key} task_id=chosen-id token={token} "
                    f"original_task_id={first.id} record_state=done at=enqueue"]
    assert not any(SECRET in r.getMessage() or "ord_1" in r.getMessage() for r in caplog.records)


def test_a_worker_side_duplicate_logs_one_info_line_naming_the_original(
    app: Celery, caplog: pytest.LogCaptureFixture,
) -> None:
    charge = make_task(app)
    caplog.set_level(logging.DEBUG, "celery_idem")
    first = charge.delay("ord_2")
    caplog.clear()
    dup = charge.apply(("ord_2",))  # apply() skips the enqueue check: the gate answers
    assert dup.get() == "charged ord_2"
    key = charge.idempotency_key_for(("ord_2",))
    token = charge._gate.store.get(key).token
    assert _lines(caplog, logging.INFO) == [
        f"celery_idem duplicate key={key} task_id={dup.id} token={token} original_task_id={first.id} "
        f"record_state=done"]


def test_a_key_mismatch_at_enqueue_is_logged_at_warning(
    app: Celery, caplog: pytest.LogCaptureFixture,
) -> None:
    charge = make_task(app)
    caplog.set_level(logging.DEBUG, "celery_idem")
    charge.delay("ord_3", note="a")
    with pytest.raises(IdempotencyKeyMismatch):
        charge.delay("ord_3", note="b")
    assert any(line.startswith("celery_idem mismatch ") and "at=enqueue" in line
               for line in _lines(caplog, logging.WARNING))


def test_idempotency_log_answers_false_moves_the_answers_to_debug(
    app: Celery, caplog: pytest.LogCaptureFixture,
) -> None:
    app.conf.idempotency_log_answers = False
    charge = make_task(app)
    caplog.set_level(logging.DEBUG, "celery_idem")
    charge.delay("ord_4")
    charge.delay("ord_4")
    charge.apply(("ord_4",))
    assert _lines(caplog, logging.INFO) == []
    debug = _lines(caplog, logging.DEBUG)
    assert any(" answered " in f" {line} " for line in debug)
    assert any(line.startswith("celery_idem duplicate ") for line in debug)


class _Dispatcher:
    """Stands in for ``app.events.default_dispatcher()``: records what would be sent."""

    def __init__(self, sent: list[tuple[str, dict[str, Any]]]) -> None:
        self.sent = sent

    def __enter__(self) -> _Dispatcher:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def send(self, type_: str, **fields: Any) -> None:
        self.sent.append((type_, fields))


@pytest.mark.parametrize("events", [False, True])
def test_an_answered_enqueue_sends_an_event_only_when_the_producer_sends_events(
    events: bool, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A producer that publishes for real (not eager), with a done record for the key
    app = Celery("test_producer_events", broker="memory://", set_as_current=False)
    app.conf.idempotency_store = "memory://"
    app.conf.idempotency_events = events
    charge = make_task(app)
    store = charge._gate.store
    key = charge.idempotency_key_for(("ord_5",))
    # (the task validates: its record keeps the whole call's hash, as a worker's claim would)
    digest = payload_hash({"order_id": "ord_5", "note": ""})
    token = store.claim(key, owner="w:1", task_id="t-orig", attempt=0, lease=60, ttl=60,
                        payload_hash=digest).token
    ctype, data = charge._gate.codec.encode_result("charged ord_5")
    from celery_idem.records import State

    store.record(key, token, state=State.DONE, content_type=ctype, data=data, ttl=60)
    opened: list[tuple[str, dict[str, Any]]] = []
    monkeypatch.setattr(type(app.events), "default_dispatcher",
                        lambda self, *a, **k: _Dispatcher(opened))
    # When the action is enqueued again
    result = charge.delay("ord_5")
    # Then it is answered from the record, and an event goes out only with events on
    assert result.get() == "charged ord_5" and result.id == "t-orig"
    if not events:
        assert opened == []  # no broker round trip: the dispatcher was never opened
        return
    assert opened == [("task-idempotency", {
        "uuid": "t-orig", "name": charge.name, "idempotency_key": key, "outcome": "answered",
        "original_task_id": "t-orig", "token": token, "record_state": "done", "at": "enqueue"})]
