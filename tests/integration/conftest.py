"""Fixtures that run real workers: each test gets its own queue, key prefix and ledger."""

from __future__ import annotations

import uuid
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

import celery_idem.app as idem_app
from tests.integration import app as app_module
from tests.integration.harness import Worker, drop_result_backend

ENV_KEYS = ("IDEM_BROKER", "IDEM_BACKEND", "IDEM_STORE", "IDEM_PREFIX", "IDEM_QUEUE",
            "IDEM_LEDGER", "IDEM_VISIBILITY")


class Cluster:
    """The test's view of one configuration: the client app, its workers and the ledger."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self.prefix = env["IDEM_PREFIX"]
        self.app = app_module.app
        self.workers: list[Worker] = []
        self.ledger = redis.Redis.from_url(env["IDEM_LEDGER"])
        conf = self.app.conf
        self._saved = {k: conf.get(k) for k in ("broker_url", "result_backend",
                       "idempotency_store", "idempotency_key_prefix", "task_default_queue")}
        conf.broker_url = env["IDEM_BROKER"]
        conf.result_backend = env["IDEM_BACKEND"]
        conf.idempotency_store = env.get("IDEM_STORE") or None
        conf.idempotency_key_prefix = self.prefix
        conf.task_default_queue = env["IDEM_QUEUE"]
        self.forget()

    def forget(self) -> None:
        """Drop the process's cached store and gates so the new settings take effect."""
        store = idem_app.forget_store(self.app)
        if store is not None:
            # Closed, not just dropped: an SQL store's engine left to the garbage collector
            # closes nothing, and psycopg warns (ResourceWarning, an error under filterwarnings).
            store.close()
        for task in self.app.tasks.values():
            task.__dict__.pop("_gate", None)
        drop_result_backend(self.app)
        # The producer pool is made for the broker of the first publish: drop it, so a test
        # with a broker of its own (IDEM_BROKER) publishes there, and the next one does not.
        self.app._pool = None
        amqp = self.app.__dict__.get("amqp")
        if amqp is not None:
            amqp._producer_pool = None

    def worker(self, name: str = "w1", **kwargs: Any) -> Worker:
        w = Worker({**self.env}, f"{name}-{self.prefix.strip(':')}", **kwargs)
        self.workers.append(w)
        return w

    def effects(self, name: str) -> list[str]:
        return [v.decode() for v in self.ledger.lrange(f"{self.prefix}ledger:{name}", 0, -1)]

    def set_flag(self, name: str) -> None:
        self.ledger.set(f"{self.prefix}flag:{name}", 1, ex=600)

    @property
    def store(self) -> Any:
        return idem_app.get_store(self.app)

    def close(self) -> None:
        for w in self.workers:
            w.stop()
        if self.env["IDEM_BROKER"].startswith("amqp"):
            # A RabbitMQ queue outlives its consumers: delete this test's own.
            from kombu import Connection

            with Connection(self.env["IDEM_BROKER"]) as conn:
                conn.default_channel.queue_delete(self.env["IDEM_QUEUE"])
        for name in self.ledger.scan_iter(match=self.prefix + "*", count=1000):
            self.ledger.delete(name)
        if (self.env.get("IDEM_STORE") or "").startswith("db+"):
            # The SQL store's table is shared by every test: delete this test's rows (its prefix).
            import sqlalchemy as sa

            store = self.store
            table = store._table
            try:  # best effort: the rest of close() must run even if the database is gone
                with store._engine.begin() as conn:
                    conn.execute(sa.delete(table).where(table.c.key.startswith(self.prefix,
                                                                               autoescape=True)))
            except sa.exc.SQLAlchemyError as exc:
                warnings.warn(f"could not delete {self.prefix}* rows: {exc}", stacklevel=1)
        conf = self.app.conf
        for k, v in self._saved.items():
            conf[k] = v
        self.forget()
        self.ledger.close()


@pytest.fixture
def make_cluster(redis_url: str) -> Iterator[Callable[..., Cluster]]:
    made: list[Cluster] = []

    def make(**overrides: str) -> Cluster:
        tag = uuid.uuid4().hex[:10]
        env = {
            "IDEM_BROKER": redis_url,
            "IDEM_BACKEND": redis_url,
            "IDEM_PREFIX": f"itest-{tag}:",
            "IDEM_QUEUE": f"itest-{tag}",
            "IDEM_LEDGER": redis_url,
            **overrides,
        }
        c = Cluster(env)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


@pytest.fixture
def cluster(make_cluster: Callable[..., Cluster]) -> Cluster:
    return make_cluster()
