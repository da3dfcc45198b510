"""celery_idem.events: the decision values, the one log line per decision, and its observers."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest

from celery_idem import events
from celery_idem.events import ANSWERS, Outcome, add_observer, log_outcome, notify_observers


@pytest.fixture
def observers() -> Iterator[list[Any]]:
    """The registry emptied for the test and restored after it (other tests may have added)."""
    saved = list(events.OBSERVERS)
    events.OBSERVERS.clear()
    yield events.OBSERVERS
    events.OBSERVERS[:] = saved


def _logged(caplog: pytest.LogCaptureFixture) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "celery_idem"]


def test_outcome_values_are_the_event_fields_consumers_match_on() -> None:
    # The values travel in `task-idempotency` events and log lines: renaming one breaks readers
    assert {o.value for o in Outcome} == {
        "claimed", "takeover", "duplicate", "waited", "requeued", "released", "recorded",
        "terminal", "lease_lost", "record_failed", "held", "mismatch", "answered", "attached",
        "relayed",
    }
    assert Outcome("held") is Outcome.HELD and Outcome.HELD == "held"
    assert events.EVENT_TYPE == "task-idempotency"
    # The answers are exactly the decisions that did not run the body
    assert {Outcome.DUPLICATE, Outcome.WAITED, Outcome.ANSWERED, Outcome.ATTACHED} == ANSWERS


@pytest.mark.parametrize(("outcome", "level"), [
    (Outcome.CLAIMED, logging.DEBUG),
    (Outcome.RECORDED, logging.DEBUG),
    (Outcome.RELEASED, logging.DEBUG),
    (Outcome.TERMINAL, logging.DEBUG),
    (Outcome.DUPLICATE, logging.INFO),
    (Outcome.WAITED, logging.INFO),
    (Outcome.ANSWERED, logging.INFO),
    (Outcome.ATTACHED, logging.INFO),
    (Outcome.TAKEOVER, logging.INFO),
    (Outcome.REQUEUED, logging.INFO),
    (Outcome.HELD, logging.WARNING),
    (Outcome.MISMATCH, logging.WARNING),
    (Outcome.LEASE_LOST, logging.ERROR),
    (Outcome.RECORD_FAILED, logging.ERROR),
])
def test_each_decision_logs_one_line_at_its_level(
    caplog: pytest.LogCaptureFixture, outcome: Outcome, level: int,
) -> None:
    caplog.set_level(logging.DEBUG, logger="celery_idem")
    log_outcome(outcome, "k1", 7, "orig-1", "task-2", {"reason": "x", "wait": 1.5})
    assert _logged(caplog) == [(level, (
        f"celery_idem {outcome.value} key=k1 task_id=task-2 token=7 original_task_id=orig-1"
        " reason=x wait=1.5"
    ))]


def test_answers_false_moves_only_the_answers_to_debug(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="celery_idem")
    for outcome in (Outcome.DUPLICATE, Outcome.ATTACHED, Outcome.HELD, Outcome.TAKEOVER):
        log_outcome(outcome, "k", 1, "o", "t", {}, answers=False)
    assert [level for level, _ in _logged(caplog)] == [
        logging.DEBUG, logging.DEBUG, logging.WARNING, logging.INFO,
    ]


def test_a_level_the_logger_drops_formats_nothing(caplog: pytest.LogCaptureFixture) -> None:
    class Exploding:
        def __str__(self) -> str:
            raise AssertionError("formatted although the level is off")

    caplog.set_level(logging.INFO, logger="celery_idem")
    log_outcome(Outcome.CLAIMED, "k", 1, "o", "t", {"value": Exploding()})
    assert _logged(caplog) == []


def test_observers_are_registered_once_and_called_with_every_decision(
    observers: list[Any],
) -> None:
    calls: list[tuple[Any, ...]] = []

    def observer(*args: Any, **kwargs: Any) -> None:
        calls.append((*args, kwargs))

    add_observer(observer)
    add_observer(observer)  # a repeat is ignored: one call per decision, not two
    assert observers == [observer]
    notify_observers("shop.charge", Outcome.DUPLICATE, "k9", 3, "orig-9", task_span=False)
    notify_observers("shop.charge", Outcome.CLAIMED, "k9", 4, "t-2", task_span=True)
    assert calls == [
        ("shop.charge", "duplicate", "k9", 3, "orig-9", {"task_span": False}),
        ("shop.charge", "claimed", "k9", 4, "t-2", {"task_span": True}),
    ]


def test_no_observer_means_no_call(observers: list[Any]) -> None:
    notify_observers("t", Outcome.CLAIMED, "k", 1, "o", task_span=True)
    assert observers == []
