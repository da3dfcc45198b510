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

Nothing here configures OpenTelemetry: without an SDK the API's no-op tracer and meter answer.
The core loads this module (``celery_idem.app.BUNDLED_OBSERVERS``); with the API installed it
registers :func:`observe` as an observer of decisions (``celery_idem.events.add_observer``).
Without it :data:`ENABLED` is False and nothing is registered, so an absent OpenTelemetry costs
nothing per decision.
"""

from __future__ import annotations

from typing import Any

from ..events import add_observer

__all__ = ["ATTRIBUTES", "COUNTER", "ENABLED", "observe"]

#: Span attributes set for each decision.
ATTRIBUTES = ("celery_idem.outcome", "celery_idem.key", "celery_idem.token",
              "celery_idem.original_task_id")
#: Name of the decision counter.
COUNTER = "celery_idem.decisions"

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


if ENABLED:
    add_observer(observe)
