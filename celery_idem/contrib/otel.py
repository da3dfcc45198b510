"""Idempotency decisions in OpenTelemetry: span attributes and a decision counter.

Optional (``pip install 'celery-idem[otel]'``, which brings ``opentelemetry-api``). When the API
is importable, every decision

* is set on the current span, the task's own span when ``opentelemetry-instrumentation-celery``
  is active (``CeleryInstrumentor().instrument()``): the attributes in :data:`ATTRIBUTES`, the
  latest decision winning (a first run ends with ``recorded``), plus one span event per decision
  (``celery_idem.claimed``, ``celery_idem.recorded``, ...), so the sequence stays visible;
* counts in the counter ``celery_idem.decisions`` (attributes ``task`` and ``outcome``), the
  producer's ``answered`` decisions included, exported by whatever meter provider the process
  configured (a Prometheus exporter scrapes it as ``celery_idem_decisions_total``).

The relay (:mod:`celery_idem.contrib.relay`) reports each pass here too
(``celery_idem.contrib.relay_observers``):

* the counter ``celery_idem.relay.resent`` counts each message it re-sent (attributes
  ``reason``: ``queue_empty``, ``overtaken``, ``released`` or ``lease_expired``; and ``queue``);
* the observable gauge ``celery_idem.intents.oldest_unclaimed_age`` (seconds, attribute
  ``queue``) is, per queue, the age of the oldest due intent no live attempt held at the last
  pass (left waiting in its queue, or re-sent): 0 for a queue that had one before and has none.

Nothing here configures OpenTelemetry: without an SDK the API's no-op tracer and meter answer.
The app loads this module (the ``celery_idem.observers`` entry point); with the API installed it
registers :func:`observe` as an observer of decisions (``celery_idem.events.add_observer``).
Without it :data:`ENABLED` is False and nothing is registered, so an absent OpenTelemetry costs
nothing per decision.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ..events import add_observer
from .relay_observers import add_relay_observer

__all__ = ["ATTRIBUTES", "COUNTER", "ENABLED", "OLDEST_UNCLAIMED", "RESENT", "RelayMetrics", "observe",
           "observe_relay"]

#: Span attributes set for each decision.
ATTRIBUTES = ("celery_idem.outcome", "celery_idem.key", "celery_idem.token",
              "celery_idem.original_task_id")
#: Name of the decision counter.
COUNTER = "celery_idem.decisions"
#: Name of the relay's counter of re-sent messages.
RESENT = "celery_idem.relay.resent"
#: Name of the gauge of the oldest unclaimed due intent's age per queue.
OLDEST_UNCLAIMED = "celery_idem.intents.oldest_unclaimed_age"

try:
    from opentelemetry import metrics as _metrics
    from opentelemetry import trace as _trace
except ImportError:  # the optional extra is not installed
    ENABLED = False
else:
    ENABLED = True

_counter: Any = None


def _decisions() -> Any:
    """The counter, created on first use: the API's proxy meter forwards to a provider set later."""
    global _counter
    if _counter is None:
        from ..version import __version__

        meter = _metrics.get_meter("celery_idem", __version__)
        _counter = meter.create_counter(
            COUNTER, unit="{decision}",
            description="celery_idem decisions by task and outcome (producer side included)",
        )
    return _counter


def observe(task: str, outcome: str, key: str, token: int, original_task_id: str, *,
            task_span: bool) -> None:
    """Count one decision, and describe it on the current span.

    Args:
        task: The task's name.
        outcome: The decision (:class:`celery_idem.events.Outcome` value).
        key: The idempotency key.
        token: The record's fencing token (0: none).
        original_task_id: The task that claimed, holds or recorded the key.
        task_span: True in a worker, where the current span is the task's run: set the
            attributes. False at enqueue, where the current span is the caller's own: add an
            event only, and leave the caller's attributes alone.
    """
    _decisions().add(1, {"task": task, "outcome": outcome})
    span = _trace.get_current_span()
    if not span.is_recording():
        return
    values: dict[str, str | int] = {
        "celery_idem.outcome": outcome, "celery_idem.key": key, "celery_idem.token": token,
        "celery_idem.original_task_id": original_task_id,
    }
    if task_span:
        span.set_attributes(values)
    span.add_event(f"celery_idem.{outcome}", values)


class RelayMetrics:
    """The relay's instruments on ``meter``, fed by :meth:`report` with each pass's report.

    Args:
        meter: An OpenTelemetry meter (the API's, or a provider's own in a test).
    """

    def __init__(self, meter: Any) -> None:
        self._ages: dict[str, float] = {}
        self.resent = meter.create_counter(
            RESENT, unit="{message}",
            description="messages of idempotency_intent tasks the relay re-sent, by reason and queue")
        meter.create_observable_gauge(
            OLDEST_UNCLAIMED, callbacks=[self._observe], unit="s",
            description="per queue, the age of the oldest due intent no live attempt held at the "
                        "relay's last pass")

    def report(self, report: Any) -> None:
        """Count a pass's re-sends (none in a dry run) and keep its per-queue unclaimed ages.

        Args:
            report: The pass's :class:`~celery_idem.contrib.relay.RelayReport`.
        """
        if not report.dry_run:
            for resend in report.resends:
                self.resent.add(1, {"reason": resend.reason, "queue": resend.queue})
        # A queue seen before and clear now reads 0 rather than vanishing from the series.
        ages = dict.fromkeys(self._ages, 0.0)
        ages.update(report.unclaimed)
        self._ages = ages  # one assignment: the reader's thread sees the old map or the new

    def _observe(self, options: Any) -> Iterable[Any]:
        return [_metrics.Observation(age, {"queue": queue}) for queue, age in self._ages.items()]


_relay: RelayMetrics | None = None


def observe_relay(report: Any) -> None:
    """Feed one relay pass's report to the relay's instruments (created on first use).

    Args:
        report: The pass's :class:`~celery_idem.contrib.relay.RelayReport`.
    """
    global _relay
    if _relay is None:
        from ..version import __version__

        _relay = RelayMetrics(_metrics.get_meter("celery_idem", __version__))
    _relay.report(report)


if ENABLED:
    add_observer(observe)
    add_relay_observer(observe_relay)
