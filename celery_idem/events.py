"""What the gate decided, the one place decisions are logged, and their observers (Celery-free:
the gate imports it; ``celery_idem.app`` sends decisions as Celery events)."""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from typing import Any

__all__ = ["ANSWERS", "EVENT_TYPE", "OBSERVERS", "Emit", "Observer", "Outcome", "add_observer",
           "escape_args", "log_outcome", "notify_observers"]

#: The Celery event type sent for every decision.
EVENT_TYPE = "task-idempotency"

logger = logging.getLogger("celery_idem")


def escape_args(record: logging.LogRecord) -> bool:
    """A log filter writing every str argument (a key) with anything but printable ASCII as an
    escape (``\\u043e``, ``\\xa0``), as the CLI's JSON does: a look-alike key reads as one."""
    if isinstance(record.args, tuple):
        record.args = tuple("".join(c if " " <= c <= "~" else ascii(c)[1:-1] for c in a)
                            if type(a) is str and not (a.isascii() and a.isprintable()) else a
                            for a in record.args)
    return True


logger.addFilter(escape_args)


class Outcome(str, enum.Enum):
    """One decision of the gate (the ``outcome`` field of a ``task-idempotency`` event)."""

    CLAIMED = "claimed"  #: the key was free; this attempt runs the body
    TAKEOVER = "takeover"  #: the previous holder's lease expired; this attempt runs with token+1
    DUPLICATE = "duplicate"  #: the key was done or failed; the body did not run
    WAITED = "waited"  #: the key was in progress; this attempt waited and got the outcome
    REQUEUED = "requeued"  #: still in progress after the wait (or store down); message re-queued
    RELEASED = "released"  #: a timeout-class error; the claim was given back for a retry
    RECORDED = "recorded"  #: the result was recorded
    TERMINAL = "terminal"  #: a terminal error was recorded as the outcome
    LEASE_LOST = "lease_lost"  #: another holder took over; this attempt's write was refused
    RECORD_FAILED = "record_failed"  #: the body succeeded but the record could not be written
    HELD = "held"  #: an unclassified error; the claim stays until its lease expires
    MISMATCH = "mismatch"  #: same key, different payload (idempotency_validate)
    #: Producer side: an enqueue of a done or failed key was answered from the record in
    #: ``apply_async``/``delay()``; nothing was published.
    ANSWERED = "answered"
    #: Producer side: an enqueue of a key in progress (or reserved by a queued message)
    #: attached to that action; nothing was published (``celery_idem.attach``).
    ATTACHED = "attached"
    RELAYED = "relayed"  #: a relay re-sent a lost intent's message (``celery_idem.contrib.relay``)


#: Answers given without running the body: INFO (DEBUG with ``idempotency_log_answers = False``),
#: so a log says which ``succeeded`` line of an action ran, and which enqueues published nothing.
ANSWERS = frozenset({Outcome.DUPLICATE, Outcome.WAITED, Outcome.ANSWERED, Outcome.ATTACHED})

#: Outcomes an operator should see at INFO or above; the rest log at DEBUG.
_LOUD = {
    **dict.fromkeys(ANSWERS, logging.INFO),
    Outcome.TAKEOVER: logging.INFO,
    Outcome.REQUEUED: logging.INFO,
    Outcome.HELD: logging.WARNING,
    Outcome.MISMATCH: logging.WARNING,
    Outcome.LEASE_LOST: logging.ERROR,
    Outcome.RECORD_FAILED: logging.ERROR,
}

#: Callback the gate reports decisions to: (outcome, key, token, original_task_id, extra).
Emit = Callable[[Outcome, str, int, str, dict[str, Any]], None]


def log_outcome(outcome: Outcome, key: str, token: int, original_task_id: str, task_id: str,
                extra: dict[str, Any], answers: bool = True) -> None:
    """Log one decision as one line of ``name=value`` pairs (never the task's arguments).

    ``token`` is the record's (0: none), ``original_task_id`` the task that claimed, holds or
    recorded the key; ``answers=False`` logs the :data:`ANSWERS` at DEBUG instead of INFO.
    """
    level = logging.DEBUG if not answers and outcome in ANSWERS else _LOUD.get(outcome, logging.DEBUG)
    if not logger.isEnabledFor(level):
        return
    tail = "".join(f" {name}={value}" for name, value in extra.items())
    logger.log(level, "celery_idem %s key=%s task_id=%s token=%s original_task_id=%s%s",
               outcome.value, key, task_id, token, original_task_id, tail)


#: Called with every decision: ``(task_name, outcome_value, key, token, original_task_id, *,
#: task_span)``; ``task_span``: True in a worker (the span is the task's run), False at enqueue.
Observer = Callable[..., None]

#: The registered observers (``celery_idem.contrib.otel`` adds itself when OpenTelemetry is).
OBSERVERS: list[Observer] = []


def add_observer(observer: Observer) -> None:
    """Register ``observer`` for every decision of this process (once; a repeat is ignored)."""
    if observer not in OBSERVERS:
        OBSERVERS.append(observer)


def notify_observers(task: str, outcome: Outcome, key: str, token: int, original_task_id: str, *,
                     task_span: bool) -> None:
    """Pass one decision to every observer (none registered: one empty loop)."""
    for observer in OBSERVERS:
        observer(task, outcome.value, key, token, original_task_id, task_span=task_span)
