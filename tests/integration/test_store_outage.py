"""A store that goes away under a running worker reaches the caller as ``StoreUnavailable``.

A real ``celery worker`` (prefork), its broker and result backend on one private ``redis-server``,
its store on another, which is stopped after the worker started. The message is re-queued
``idempotency_store_requeues`` times (default 3: 1 + 2 + 4 s), then the caller's result is a
failure naming the store: ``get()`` raises it, not a bare timeout. The message stays queued: once
the store answers again, the task runs once and its result replaces the failure.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pytest
from celery import Celery

from celery_idem import StoreUnavailable
from tests.integration.harness import ROOT, RedisServer, Worker, wait_for

pytestmark = pytest.mark.worker

APP = "tests.integration.start_app"


@pytest.fixture
def servers() -> Iterator[tuple[RedisServer, RedisServer]]:
    broker, store = RedisServer(), RedisServer()
    yield broker, store
    broker.cleanup()
    store.cleanup()


def test_a_store_down_after_worker_start_tells_the_caller_and_keeps_the_message(
    servers: tuple[RedisServer, RedisServer],
) -> None:
    broker, store = servers
    queue = f"idem-outage-{uuid.uuid4().hex[:8]}"
    env = {"IDEM_BROKER": broker.url, "IDEM_BACKEND": broker.url, "IDEM_STORE": store.url,
           "IDEM_QUEUE": queue, "IDEM_PREFIX": f"outage-{uuid.uuid4().hex[:8]}:",
           "PYTHONPATH": str(ROOT)}
    worker = Worker(env, "outage", pool="prefork", concurrency=1, app=APP)
    client = Celery("outage-client", broker=broker.url, backend=broker.url, set_as_current=False)
    try:
        # Given a worker that started with its store up, and the store then gone
        assert client.send_task("tests.integration.start_app.noop", (1,), queue=queue).get(
            timeout=30) == 1
        store.stop()
        # When a task is sent
        started = time.monotonic()
        result = client.send_task("tests.integration.start_app.noop", (2,), queue=queue)
        # Then get() raises StoreUnavailable naming the store, after the bounded re-queues
        with pytest.raises(StoreUnavailable) as raised:
            result.get(timeout=30)
        elapsed = time.monotonic() - started
        message = str(raised.value)
        assert f"127.0.0.1:{store.port}/0" in message, message
        assert "3 re-queues" in message and "stays queued" in message, message
        assert ".." not in message, message  # the store's own error ends with a period too
        assert 6 < elapsed < 25, elapsed  # 1 + 2 + 4 s of countdowns, then the failure
        assert result.state == "FAILURE"
        # and each re-queue before it was logged, so the message was kept until the bound
        # (the worker writes its last line just after the failure the caller already saw)
        wait_for(lambda: "failed for its caller" in worker.text(), timeout=10,
                 what="the worker's line for the caller's failure")
        log = worker.text()
        assert log.count("celery_idem store unavailable") == 4, log[-3000:]
        assert "failed for its caller after 3 re-queues; its message stays queued" in log
        assert "re-queue 3 of 3" in log
        # When the store answers again, the kept message runs once and replaces the failure
        store.start()
        deadline = time.monotonic() + 60
        while client.AsyncResult(result.id).state != "SUCCESS" and time.monotonic() < deadline:
            time.sleep(0.2)
        assert client.AsyncResult(result.id).get(timeout=5) == 2
    finally:
        client.close()
        worker.stop()
