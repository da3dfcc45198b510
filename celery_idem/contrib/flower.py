"""Show celery_idem's decisions in Flower (docs/operations.md, "Flower").

Flower shows only the fields ``celery.events.state.Task._fields`` lists, and an event a producer
sends under a run's id (``delay()`` answered from the record) makes the producer its worker.
:func:`install`, called from Flower's ``--conf`` file, gives Flower's state
:class:`IdempotencyTaskState`: each decision's fields (:data:`FIELDS`), the answers given from a
run's record on its page, the Celery state and the run's worker left alone, a count per decision
in ``celery_idem_decisions_total{task,outcome}``, and an *Idempotency outcome* column. Answers
at enqueue come from producers with ``idempotency_events = True``; workers need ``-E``.
"""

from __future__ import annotations

from typing import Any

from celery.events.state import Task as _CeleryTaskState

__all__ = ["FIELDS", "IdempotencyTaskState", "install"]

#: The fields added, in the order Flower shows them. Flower labels a field by its name, upper-
#: casing "eta", "uri", "url", "ssl" and "uuid" wherever they occur: no name here contains one.
FIELDS: tuple[str, ...] = (
    "idempotency_outcome",  # the latest decision for this task id
    "idempotency_key",
    "original_task_id",  # the task that claimed, holds or recorded the key
    "idempotency_duplicates",  # the answers given from this run's record
    "idempotency_token",
    "idempotency_outcomes",  # every decision for this task id, in the order they arrived
    "idempotency_record_state",  # the record's state, for duplicate / waited / record_failed
    "previous_task_id",  # takeover: the holder whose lease had expired
    "previous_owner",
    "idempotency_context",  # the latest other fields: error, reason, verb, held_for, at
)

#: Outcomes answered from another run's record (or claim) without running the body.
_ANSWERS = frozenset({"duplicate", "waited", "answered", "attached"})

#: The task list's column (Flower's ``tasks_columns``).
COLUMN = "idempotency_outcome"

#: Event field -> task field, for the fields copied as they are.
_COPIED = {"idempotency_key": "idempotency_key", "original_task_id": "original_task_id",
           "token": "idempotency_token", "record_state": "idempotency_record_state",
           "previous_task_id": "previous_task_id", "previous_owner": "previous_owner"}
#: Event fields that are not shown as context (Celery's standard ones, and the decision's own).
_STANDARD = frozenset({"type", "uuid", "hostname", "timestamp", "local_received", "clock", "pid",
                       "utcoffset", "outcome", "name", *_COPIED})

_decisions: Any = None  # the Prometheus counter, created by install()


class IdempotencyTaskState(_CeleryTaskState):  # type: ignore[misc, unused-ignore]
    """Flower's view of one task, with the ``task-idempotency`` decisions made for it."""

    # Celery's own fields first (name, uuid, state), then ours, then the rest: Flower's task
    # page lists them in this order, so the decisions are visible without scrolling.
    _fields = _CeleryTaskState._fields[:3] + FIELDS + _CeleryTaskState._fields[3:]
    _ran_on: Any = None  # the worker of this task's own events

    def event(
        self, type_: str, timestamp: float | None = None, local_received: float | None = None,
        fields: dict[str, Any] | None = None, *args: Any, **kwargs: Any,
    ) -> None:
        if type_ != "idempotency":  # Celery's state dispatches "task-" + subject
            super().event(type_, timestamp, local_received, fields, *args, **kwargs)
            if type_ != "sent":  # task-sent comes from the client, the rest from the worker
                self._ran_on = getattr(self, "worker", None)
            return
        fields = fields or {}
        outcome = str(fields.get("outcome") or "")
        original = fields.get("original_task_id")
        if not getattr(self, "name", None) and fields.get("name"):  # an answer at enqueue
            self.name = fields["name"]
        if _decisions is not None:
            _decisions.labels(task=self.name or fields.get("name") or "", outcome=outcome).inc()
        if outcome in _ANSWERS and original:
            if original == self.uuid:
                # An answer under the run's own id (delay(), a redelivery): the run keeps its
                # outcome, and its worker, which Celery's state just set to the event's sender.
                if self._ran_on is not None:
                    self.worker = self._ran_on
                where = "at enqueue" if fields.get("at") == "enqueue" else "redelivered"
                self._add_duplicate(f"{outcome} {where} on {fields.get('hostname')}")
                return
            ran = self.cluster_state.tasks.get(original) if self.cluster_state else None
            if isinstance(ran, IdempotencyTaskState):
                ran._add_duplicate(f"{self.uuid} ({outcome})")
        # A new list each time: Flower's task page works on shallow copies of this object.
        self.idempotency_outcomes = [*(getattr(self, "idempotency_outcomes", None) or []), outcome]
        self.idempotency_outcome = outcome
        for name, attribute in _COPIED.items():
            if fields.get(name) not in (None, ""):
                setattr(self, attribute, fields[name])
        context = " ".join(f"{k}={v}" for k, v in sorted(fields.items()) if k not in _STANDARD)
        if context:
            self.idempotency_context = context

    def _add_duplicate(self, answer: str) -> None:
        before = getattr(self, "idempotency_duplicates", None)
        self.idempotency_duplicates = f"{before}, {answer}" if before else answer


for _name in FIELDS:  # absent (None) until an event sets them: Flower skips None fields
    setattr(IdempotencyTaskState, _name, None)


def install() -> None:
    """Make Flower show ``task-idempotency`` decisions; call it from Flower's ``--conf`` file
    (read before Flower builds its event state). Idempotent.

    Raises:
        ImportError: Flower is not installed in this environment.
    """
    global _decisions
    import flower.events  # type: ignore[import-untyped, unused-ignore]

    if _decisions is None:
        from prometheus_client import Counter

        _decisions = Counter("celery_idem_decisions",
                             "celery_idem decisions reported by task-idempotency events",
                             ["task", "outcome"])
    # Celery's event state builds every task object from its ``Task`` class attribute.
    flower.events.EventsState.Task = IdempotencyTaskState
    _add_column()


def _add_column() -> None:
    """Show :data:`COLUMN` in Flower's task list, after the state. A ``tasks_columns`` set in the
    configuration file or on the command line is applied after this runs, and wins."""
    import flower.views.tasks  # type: ignore[import-untyped, unused-ignore]
    from tornado.options import options

    columns = getattr(flower.views.tasks, "TASK_COLUMNS", None)
    current = getattr(options, "tasks_columns", None)
    if columns is None or not isinstance(current, str):
        return
    columns.setdefault(COLUMN, "Idempotency outcome")
    names = [name.strip() for name in current.split(",")]
    if COLUMN not in names:
        names.insert(names.index("state") + 1 if "state" in names else len(names), COLUMN)
        options.tasks_columns = ",".join(names)
