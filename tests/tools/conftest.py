"""Fixtures for the tool adapter's tests: one real worker per module, its own queue and prefix."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import redis

import celery_idem.app as idem_app
from tests.conftest import REDIS_URL, require
from tests.integration.harness import Worker
from tests.tools import app as app_module


@dataclass
class Env:
    """What a test needs: the prefix, the queue, a Redis client, and the worker (if any)."""

    prefix: str
    queue: str
    client: redis.Redis
    worker: Worker | None = None

    def effects(self, name: str) -> list[str]:
        return [v.decode() for v in self.client.lrange(f"{self.prefix}ledger:{name}", 0, -1)]

    def release(self, order_id: str) -> None:
        self.client.set(f"{self.prefix}flag:{order_id}", 1, ex=600)

    def queued(self) -> int:
        """Messages waiting in the queue (Redis broker: a list named after the queue)."""
        return int(self.client.llen(self.queue))


def _configure(url: str, prefix: str, queue: str) -> None:
    conf = app_module.app.conf
    conf.broker_url = conf.result_backend = url
    conf.idempotency_key_prefix = prefix
    conf.task_default_queue = queue
    # Drop what was built with the previous settings (the store, the gates, the backend).
    idem_app.forget_store(app_module.app)
    for task in app_module.app.tasks.values():
        task.__dict__.pop("_gate", None)
    app_module.app.__dict__.pop("backend", None)
    app_module.app._local.__dict__.pop("backend", None)


def _env(worker: bool) -> Iterator[Env]:
    require(REDIS_URL, 6379, "Redis")
    url = REDIS_URL.rstrip("/") + "/0"
    tag = uuid.uuid4().hex[:10]
    prefix, queue = f"tools-{tag}:", f"tools-{tag}"
    _configure(url, prefix, queue)
    client = redis.Redis.from_url(url)
    env = Env(prefix, queue, client)
    if worker:
        env.worker = Worker({"TOOLS_REDIS": url, "TOOLS_PREFIX": prefix, "TOOLS_QUEUE": queue},
                            f"tools-{tag}", pool="threads", concurrency=4,
                            app="tests.tools.app")
    try:
        yield env
    finally:
        if env.worker is not None:
            env.worker.stop()
        for name in client.scan_iter(match=prefix + "*", count=1000):
            client.delete(name)
        client.delete(queue)
        client.close()


@pytest.fixture(scope="module")
def live() -> Iterator[Env]:
    """A real ``celery worker`` (threads pool) consuming this module's queue."""
    yield from _env(worker=True)


@pytest.fixture
def idle() -> Iterator[Env]:
    """The same app with nobody consuming its queue (what was enqueued stays there)."""
    yield from _env(worker=False)
