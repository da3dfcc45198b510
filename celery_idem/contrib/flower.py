"""Show celery_idem's decisions in Flower: a small, opt-in Flower extension.

Why it is needed: Flower keeps one ``celery.events.state.Task`` per task id and shows only the
fields that class lists in ``_fields``, on the task page and in ``/api/task/info`` and
``/api/tasks``. The fields of a custom event such as ``task-idempotency`` are merged into the
object but never shown, its type only becomes a transient task state ``IDEMPOTENCY``, and its
``state`` field (the record's state, ``done``) can even overwrite the task's Celery state when
the event arrives after ``task-succeeded``. Prometheus gets one ``flower_events_total`` count
for all outcomes together.

What it does: :func:`install` gives Flower's monitor state (``flower.events.EventsState``) the
task class :class:`IdempotencyTaskState`. For every ``task-idempotency`` event that class

* stores the event's fields under the names in :data:`FIELDS` (``idempotency_key``,
  ``original_task_id``, ``idempotency_outcomes`` in the order they arrived, ...), which Flower
  then shows on the task page and returns from its API;
* leaves the task's Celery state alone (no ``IDEMPOTENCY`` state, no ``done``);
* counts the decision in the Prometheus counter ``celery_idem_decisions_total{task,outcome}``,
  which Flower's ``/metrics`` exposes next to its own metrics.

Decisions made at enqueue (``outcome="answered"``: ``delay()`` found the key done and
published nothing; ``mismatch`` with ``at=enqueue``) arrive from the producer, when it sends
events (``idempotency_events = True`` or ``task_send_sent_event = True``), under the id of the
result ``delay()`` returned; they are shown and counted the same way.

Every other event is handled exactly as before. Load it from Flower's own configuration file,
read with ``--conf`` (a Python file; ``flowerconfig.py`` in the working directory by default)::

    # flowerconfig.py
    import celery_idem.contrib.flower

    celery_idem.contrib.flower.install()

and start Flower as usual: ``celery -A proj flower --conf=flowerconfig.py``. Workers must send
task events (``celery worker -E``, ``worker_send_task_events = True``, or
``idempotency_events = True``).
"""

from __future__ import annotations

from typing import Any

from celery.events.state import Task as _CeleryTaskState

__all__ = ["FIELDS", "IdempotencyTaskState", "install"]

#: The event type's subject, as Celery's event state dispatches it (``task-`` + subject).
_SUBJECT = "idempotency"

#: The task fields the extension adds, in the order Flower shows them (after the result).
FIELDS: tuple[str, ...] = (
    "idempotency_outcome",  # the latest decision
    "idempotency_key",
    "original_task_id",  # the task that claimed, holds or recorded the key
    "idempotency_token",
    "idempotency_outcomes",  # every decision for this task id, in the order they arrived
    "idempotency_record_state",  # the record's state, for duplicate / waited / record_failed
    "previous_task_id",  # takeover: the holder whose lease had expired
    "previous_owner",
    "idempotency_detail",  # the latest other fields: error, reason, verb, held_for
)

# Event fields that are not the decision's own (standard Celery event fields).
_STANDARD = frozenset({
    "type", "uuid", "hostname", "timestamp", "local_received", "clock", "pid", "utcoffset",
    "idempotency_key", "outcome", "original_task_id", "token", "record_state", "previous_task_id",
    "previous_owner", "name",
})

_decisions: Any = None  # the Prometheus counter, created by install()


class IdempotencyTaskState(_CeleryTaskState):  # type: ignore[misc, unused-ignore]
    """Flower's view of one task, with the ``task-idempotency`` decisions made for it."""

    # Celery's own fields first (name, uuid, state), then ours, then the rest: Flower's task
    # page lists them in this order, so the decisions are visible without scrolling.
    _fields = _CeleryTaskState._fields[:3] + FIELDS + _CeleryTaskState._fields[3:]

    # Absent (None) until an event sets them: Flower skips None fields on the task page.
    idempotency_outcome: str | None = None
    idempotency_key: str | None = None
    original_task_id: str | None = None
    idempotency_token: int | None = None
    idempotency_outcomes: list[str] | None = None
    idempotency_record_state: str | None = None
    previous_task_id: str | None = None
    previous_owner: str | None = None
    idempotency_detail: str | None = None

    def event(
        self, type_: str, timestamp: float | None = None, local_received: float | None = None,
        fields: dict[str, Any] | None = None, *args: Any, **kwargs: Any,
    ) -> None:
        if type_ != _SUBJECT:
            super().event(type_, timestamp, local_received, fields, *args, **kwargs)
            return
        fields = fields or {}
        outcome = str(fields.get("outcome") or "")
        if not getattr(self, "name", None) and fields.get("name"):
            # An enqueue answered from the record (outcome ``answered``) publishes nothing, so
            # no task-sent/received event names the task: the decision's own event does.
            self.name = fields["name"]
        # A new list each time: Flower's task page works on shallow copies of this object.
        self.idempotency_outcomes = [*(self.idempotency_outcomes or ()), outcome]
        self.idempotency_outcome = outcome
        for name, attribute in (("idempotency_key", "idempotency_key"),
                                ("original_task_id", "original_task_id"),
                                ("token", "idempotency_token"),
                                ("record_state", "idempotency_record_state"),
                                ("previous_task_id", "previous_task_id"),
                                ("previous_owner", "previous_owner")):
            if fields.get(name) not in (None, ""):
                setattr(self, attribute, fields[name])
        detail = " ".join(f"{k}={v}" for k, v in sorted(fields.items()) if k not in _STANDARD)
        if detail:
            self.idempotency_detail = detail
        if _decisions is not None:
            _decisions.labels(task=self.name or fields.get("name") or "", outcome=outcome).inc()


def install() -> None:
    """Make Flower show ``task-idempotency`` decisions; call it from Flower's ``--conf`` file.

    Idempotent. Must run before Flower builds its event state, which a configuration file
    does (Flower reads it first).

    Raises:
        ImportError: Flower is not installed in this environment.
    """
    global _decisions
    import flower.events  # type: ignore[import-untyped, unused-ignore]

    if _decisions is None:
        from prometheus_client import Counter

        _decisions = Counter(
            "celery_idem_decisions",
            "celery_idem decisions reported by task-idempotency events",
            ["task", "outcome"],
        )
    # Celery's event state builds every task object from its ``Task`` class attribute.
    flower.events.EventsState.Task = IdempotencyTaskState
