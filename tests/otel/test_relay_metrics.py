"""OpenTelemetry for the relay: a counter of re-sent messages by reason and queue, and a gauge of
the oldest unclaimed due intent's age per queue, fed by real relay passes (a memory store and
broker) and read with the SDK's in-memory metric reader.

Needs the ``[otel]`` extra plus ``opentelemetry-sdk`` (in the dev set): skipped locally without
them, a failure in CI.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

from celery_idem.contrib import otel, relay_observers
from celery_idem.contrib.relay import Relay
from celery_idem.intents import Envelope, encode_envelope
from celery_idem.records import Intent
from celery_idem.stores.memory import MemoryStore
from tests.conftest import IN_CI

try:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
except ImportError as exc:  # pragma: no cover - depends on the environment
    if IN_CI:
        raise
    pytest.skip(f"OpenTelemetry SDK not installed ({exc.name}): pip install -e '.[dev]'",
                allow_module_level=True)

NOW = 1_000_000.0
AFTER = 60.0


class Clock:
    def __init__(self) -> None:
        self.now = NOW

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def reader(monkeypatch: pytest.MonkeyPatch) -> Iterator[InMemoryMetricReader]:
    """The relay's instruments on a provider of this test's own (the global one is set once per
    process), installed where the registered observer feeds them."""
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    monkeypatch.setattr(otel, "_relay", otel.RelayMetrics(provider.get_meter("test")))
    yield reader
    provider.shutdown()


@pytest.fixture
def app() -> Iterator[Celery]:
    app = Celery("test_relay_otel", broker="memory://", set_as_current=False)
    yield app
    app.close()


def _points(reader: InMemoryMetricReader, name: str) -> dict[tuple[tuple[str, Any], ...], float]:
    out: dict[tuple[tuple[str, Any], ...], float] = {}
    data = reader.get_metrics_data()
    for rm in data.resource_metrics if data else ():
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                if metric.name == name:
                    for point in metric.data.data_points:
                        out[tuple(sorted(dict(point.attributes or {}).items()))] = point.value
    return out


def _intend(store: MemoryStore, key: str, queue: str) -> Intent:
    task_id = uuid.uuid4().hex
    body = json.dumps([[1], {}, {"callbacks": None, "errbacks": None, "chain": None,
                                 "chord": None}]).encode()
    message = encode_envelope(Envelope(
        body=body, content_type="application/json", content_encoding="utf-8",
        headers={"id": task_id, "task": "shop.charge", "lang": "py", "retries": 0},
        properties={"correlation_id": task_id}, exchange="", exchange_type="direct",
        routing_key=queue, queue=queue))
    return store.intend(key, task_id, queue, message, relay_after=AFTER, ttl=3600)


def test_the_relay_is_observed_once_opentelemetry_is_importable() -> None:
    assert otel.ENABLED
    assert relay_observers.RELAY_OBSERVERS.count(otel.observe_relay) == 1


def test_re_sends_count_by_reason_and_queue_and_the_gauge_ages_unclaimed_intents(
        reader: InMemoryMetricReader, app: Celery) -> None:
    clock, tag = Clock(), uuid.uuid4().hex[:8]
    lost_q, busy_q, held_q = f"lost-{tag}", f"busy-{tag}", f"held-{tag}"
    store = MemoryStore(prefix="otel:", clock=clock)
    _intend(store, "op:lost-1", lost_q)
    _intend(store, "op:lost-2", lost_q)
    _intend(store, "op:waiting", busy_q)  # never claimed, its queue not empty: it may still wait
    held = _intend(store, "op:held", held_q)
    store.claim(held.key, owner="h:1", task_id=held.task_id, attempt=0, lease=600, ttl=3600)
    with app.producer_or_acquire() as producer:  # the busy queue holds someone else's message
        producer.publish(b"x", routing_key=busy_q, declare=[app.amqp.queues.new_missing(busy_q)])
    relay = Relay(app, store, relay_after=AFTER, interval=0.01)

    clock.now += AFTER + 1
    report = relay.run_once()
    assert (report.relayed, report.waiting, report.postponed) == (2, 1, 1)
    assert _points(reader, otel.RESENT) == {(("queue", lost_q), ("reason", "queue_empty")): 2}
    # The held intent has a live attempt: it is no unclaimed message.
    assert _points(reader, otel.OLDEST_UNCLAIMED) == {
        (("queue", lost_q),): AFTER + 1, (("queue", busy_q),): AFTER + 1}

    clock.now += 1  # nothing due: each queue seen before reads 0, nothing more is counted
    assert relay.run_once().relayed == 0
    assert _points(reader, otel.OLDEST_UNCLAIMED) == {(("queue", lost_q),): 0, (("queue", busy_q),): 0}
    assert _points(reader, otel.RESENT) == {(("queue", lost_q), ("reason", "queue_empty")): 2}


def test_a_dry_run_counts_no_re_send(reader: InMemoryMetricReader, app: Celery) -> None:
    clock, queue = Clock(), f"q-{uuid.uuid4().hex[:8]}"
    store = MemoryStore(prefix="otel:", clock=clock)
    _intend(store, "op:lost", queue)
    clock.now += AFTER + 1
    report = Relay(app, store, relay_after=AFTER, interval=0.01, dry_run=True).run_once()
    assert report.relayed == 1 and report.dry_run
    assert _points(reader, otel.RESENT) == {}
    assert _points(reader, otel.OLDEST_UNCLAIMED) == {(("queue", queue),): AFTER + 1}


def test_a_failing_observer_leaves_the_pass_alone(app: Celery, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(report: Any) -> None:
        raise RuntimeError("exporter down")

    monkeypatch.setattr(relay_observers, "RELAY_OBSERVERS", [broken])
    clock, queue = Clock(), f"q-{uuid.uuid4().hex[:8]}"
    store = MemoryStore(prefix="otel:", clock=clock)
    _intend(store, "op:lost", queue)
    clock.now += AFTER + 1
    assert Relay(app, store, relay_after=AFTER, interval=0.01).run_once().relayed == 1
