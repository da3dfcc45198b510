"""OpenTelemetry: with opentelemetry-instrumentation-celery active, each task span carries the
decision, and a counter of decisions by task and outcome is exported (the SDK's in-memory span
exporter and metric reader, a real worker on a real Redis).

Needs the ``[otel]`` extra plus ``opentelemetry-sdk`` and ``opentelemetry-instrumentation-celery``
(all in the dev set): skipped locally without them, a failure in CI.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

from celery_idem import IdempotentTask
from celery_idem.contrib.ops import shown
from celery_idem.keys import KeyParts, parse_key
from tests.conftest import IN_CI

try:
    from opentelemetry import metrics, trace
    from opentelemetry.instrumentation.celery import CeleryInstrumentor
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
except ImportError as exc:  # pragma: no cover - depends on the environment
    if IN_CI:
        raise
    pytest.skip(f"OpenTelemetry SDK not installed ({exc.name}): pip install -e '.[dev]'",
                allow_module_level=True)

pytestmark = pytest.mark.worker


class Telemetry:
    def __init__(self) -> None:
        self.spans = InMemorySpanExporter()
        self.reader = InMemoryMetricReader()

    def decisions(self) -> dict[tuple[str, str], int]:
        out: dict[tuple[str, str], int] = {}
        data = self.reader.get_metrics_data()
        for rm in data.resource_metrics if data else ():
            for sm in rm.scope_metrics:
                for metric in sm.metrics:
                    if metric.name == "celery_idem.decisions":
                        for point in metric.data.data_points:
                            attrs = dict(point.attributes)
                            out[(attrs["task"], attrs["outcome"])] = point.value
        return out

    def run_span(self, task_id: str) -> Any:
        found = [s for s in self.spans.get_finished_spans()
                 if s.name.startswith("run/") and s.attributes.get("messaging.message.id") == task_id]
        seen = [f"{s.name} {dict(s.attributes)}" for s in self.spans.get_finished_spans()]
        assert len(found) == 1, "\n".join(seen)
        return found[0]


@pytest.fixture(scope="module")
def telemetry() -> Iterator[Telemetry]:
    tel = Telemetry()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(tel.spans))
    # Global providers: the instrumentation and celery_idem find them as an application's would.
    trace.set_tracer_provider(tracer_provider)
    metrics.set_meter_provider(MeterProvider(metric_readers=[tel.reader]))
    instrumentor = CeleryInstrumentor()
    instrumentor.instrument()
    try:
        yield tel
    finally:
        instrumentor.uninstrument()


def test_each_task_span_carries_the_decision_and_a_counter_counts_them(
    telemetry: Telemetry, redis_url: str, prefix: str, redis_cleanup: None,
) -> None:
    from celery.contrib.testing.worker import start_worker

    app = Celery("otel_test", broker=redis_url, backend=redis_url, set_as_current=False)
    app.conf.update(task_default_queue=f"otel-{uuid.uuid4().hex[:10]}", idempotency_key_prefix=prefix,
                    broker_connection_retry_on_startup=False)
    ran: list[str] = []

    @app.task(base=IdempotentTask, bind=True, shared=False, name="otel.charge")
    def charge(self: Any, order_id: str) -> str:
        ran.append(order_id)
        return f"charged {order_id}"

    with start_worker(app, pool="solo", perform_ping_check=False, shutdown_timeout=20):
        first = charge.delay("ord_otel")
        assert first.get(timeout=30) == "charged ord_otel"
        dup = app.send_task("otel.charge", ("ord_otel",))  # by name: the worker's gate answers
        assert dup.get(timeout=30) == "charged ord_otel"
        answered = charge.delay("ord_otel")  # the producer answers from the record
        assert answered.get(timeout=5) == "charged ord_otel"
    assert ran == ["ord_otel"]
    key = charge.idempotency_key_for(("ord_otel",))
    # The first run's span: the latest decision (recorded), key and token, and each decision
    span = telemetry.run_span(first.id)
    assert span.attributes["celery_idem.outcome"] == "recorded"
    assert span.attributes["celery_idem.key"] == key
    record = charge._gate.store.get(key)
    assert record is not None and span.attributes["celery_idem.token"] == record.token
    assert span.attributes["celery_idem.original_task_id"] == first.id
    assert [e.name for e in span.events] == ["celery_idem.claimed", "celery_idem.recorded"]
    # The duplicate's span: duplicate, and whose result it got
    span = telemetry.run_span(dup.id)
    assert span.attributes["celery_idem.outcome"] == "duplicate"
    assert span.attributes["celery_idem.original_task_id"] == first.id
    # The counter, by task and outcome, with the producer's answer
    counts = telemetry.decisions()
    for outcome in ("claimed", "recorded", "duplicate", "answered"):
        assert counts.get(("otel.charge", outcome)) == 1, counts


def test_a_per_call_key_with_a_scope_is_the_span_key_as_the_cli_shows_it(
    telemetry: Telemetry, redis_url: str, prefix: str, redis_cleanup: None,
) -> None:
    from celery.contrib.testing.worker import start_worker

    app = Celery("otel_scope_test", broker=redis_url, backend=redis_url, set_as_current=False)
    app.conf.update(task_default_queue=f"otel-{uuid.uuid4().hex[:10]}", idempotency_key_prefix=prefix,
                    broker_connection_retry_on_startup=False)

    @app.task(base=IdempotentTask, bind=True, shared=False, name="otel.scoped")
    def charge(self: Any, order_id: str) -> str:
        return self.idempotency_key  # type: ignore[no-any-return]

    with start_worker(app, pool="solo", perform_ping_check=False, shutdown_timeout=20):
        r = charge.apply_async(("ord_scoped",), idempotency_key="k", idempotency_scope="t")
        stored = r.get(timeout=30)
    # The stored key: the task's namespace, the scope, the caller's key
    assert stored == "otel.scoped@t:key=k"
    assert parse_key(stored, "otel.scoped") == KeyParts("otel.scoped", "t", "k", per_call=True)
    assert charge._gate.store.get(stored) is not None
    # What `idem key otel.scoped '"ord_scoped"' --key k --scope t` prints (its code path)
    cli = shown(charge.idempotency_key_for(("ord_scoped",), idempotency_key="k",
                                           idempotency_scope="t"))
    assert cli == stored
    # The span carries that key, as the CLI shows it
    span = telemetry.run_span(r.id)
    assert span.attributes["celery_idem.outcome"] == "recorded"
    assert span.attributes["celery_idem.key"] == cli
