"""Show celery_idem's decisions in Flower: a small, opt-in Flower extension.

Why it is needed: Flower keeps one ``celery.events.state.Task`` per task id and shows only the
fields that class lists in ``_fields``. The fields of a custom event such as ``task-idempotency``
are merged into the object but never shown, its ``state`` field (the record's ``done``) can
overwrite the task's Celery state, and an event a producer sends under a task's id (``delay()``
answered from the record returns the original's id) makes the producer that task's worker.

What it does: :func:`install` gives Flower's monitor state (``flower.events.EventsState``) the
task class :class:`IdempotencyTaskState`, and the task list a column ``Idempotency outcome``.
For every ``task-idempotency`` event that class

* stores the event's fields under the names in :data:`FIELDS` (``idempotency_outcome``,
  ``idempotency_key``, ``original_task_id``, ...), which Flower shows on the task page and
  returns from its API;
* lists, on the page of the run that recorded the action, the answers given from its record
  (``idempotency_duplicates``): copies delivered under their own ids, and enqueues answered
  under the run's own id, which leave the run's outcome (``recorded``) and worker as they are;
* leaves the task's Celery state alone, and counts the decision in the Prometheus counter
  ``celery_idem_decisions_total{task,outcome}``, which Flower's ``/metrics`` exposes.

Decisions made at enqueue (``answered``, ``attached``, ``mismatch``) come from the producer,
and only when it sends events: ``app.conf.idempotency_events = True`` (or
``task_send_sent_event``) in the application that calls ``delay()``. Load the extension from
Flower's configuration file, read with ``--conf``::

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
#: Flower's page labels a field by its name ("idempotency_record_state": "Idempotency record
#: state"), upper-casing "eta", "uri", "url", "ssl" and "uuid" wherever they occur: no name here
#: contains one.
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

#: Outcomes that answer from another run's record (or its claim) without running the body.
_ANSWERS = frozenset({"duplicate", "waited", "answered", "attached"})

#: The task list's column (Flower's ``tasks_columns``), after the state.
COLUMN = "idempotency_outcome"

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
    idempotency_duplicates: str | None = None
    idempotency_token: int | None = None
    idempotency_outcomes: list[str] | None = None
    idempotency_record_state: str | None = None
    previous_task_id: str | None = None
    previous_owner: str | None = None
    idempotency_context: str | None = None
    _ran_on: Any = None  # the worker of this task's own events

    def event(
        self, type_: str, timestamp: float | None = None, local_received: float | None = None,
        fields: dict[str, Any] | None = None, *args: Any, **kwargs: Any,
    ) -> None:
        if type_ != _SUBJECT:
            super().event(type_, timestamp, local_received, fields, *args, **kwargs)
            if type_ != "sent":  # task-sent comes from the client, the rest from the worker
                self._ran_on = getattr(self, "worker", None)
            return
        fields = fields or {}
        outcome = str(fields.get("outcome") or "")
        original = fields.get("original_task_id")
        if not getattr(self, "name", None) and fields.get("name"):
            # An enqueue answered from the record publishes nothing, so no task-sent/received
            # event names the task: the decision's own event does.
            self.name = fields["name"]
        if _decisions is not None:
            _decisions.labels(task=self.name or fields.get("name") or "", outcome=outcome).inc()
        if outcome in _ANSWERS and original:
            if original == self.uuid:
                # delay() answered under the run's own id (or a redelivery of the run's message):
                # the run's page keeps its outcome and its worker, which Celery's state just
                # replaced with the event's sender.
                if self._ran_on is not None:
                    self.worker = self._ran_on
                where = "at enqueue" if fields.get("at") == "enqueue" else "redelivered"
                self._add_duplicate(f"{outcome} {where} on {fields.get('hostname')}")
                return
            ran = self.cluster_state.tasks.get(original) if self.cluster_state else None
            if isinstance(ran, IdempotencyTaskState):
                ran._add_duplicate(f"{self.uuid} ({outcome})")
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
        context = " ".join(f"{k}={v}" for k, v in sorted(fields.items()) if k not in _STANDARD)
        if context:
            self.idempotency_context = context

    def _add_duplicate(self, answer: str) -> None:
        self.idempotency_duplicates = ", ".join(filter(None, (self.idempotency_duplicates, answer)))


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
    _add_column()


def _add_column() -> None:
    """Show :data:`COLUMN` in Flower's task list (its ``tasks_columns`` option, after the state).

    A ``tasks_columns`` set in the configuration file or on the command line is applied after
    this runs, and wins. A Flower without configurable columns is left as it is.
    """
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
