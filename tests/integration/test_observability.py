"""Events and loud failures, seen from outside the worker."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from collections.abc import Collection
from typing import Any

import pytest

from tests.integration import app as tasks
from tests.integration.conftest import Cluster
from tests.integration.harness import ROOT, RedisServer, wait_for, wait_subscribed

pytestmark = pytest.mark.worker


class EventTap:
    """Collects ``task-idempotency`` events from the broker in a background thread."""

    def __init__(self, app: Any) -> None:
        self.events: list[dict[str, Any]] = []
        self._ready = threading.Event()
        self._channel: Any = None
        self._thread = threading.Thread(target=self._run, args=(app,), daemon=True)
        self._thread.start()
        assert self._ready.wait(20), "event receiver did not start"
        # Consuming is not yet subscribed: an event sent before the PSUBSCRIBE reaches nobody
        wait_subscribed(lambda: self._channel, app.conf.broker_url)

    def _run(self, app: Any) -> None:
        with app.connection_for_read() as conn:
            recv = app.events.Receiver(conn, handlers={"task-idempotency": self.events.append})
            self._recv = recv
            original = recv.on_consume_ready

            def ready(conn: Any, channel: Any, *args: Any, **kwargs: Any) -> None:
                original(conn, channel, *args, **kwargs)
                self._channel = channel
                self._ready.set()

            recv.on_consume_ready = ready  # type: ignore[method-assign]
            recv.capture(limit=None, timeout=None, wakeup=False)

    def outcomes(self, key: str, ids: Collection[str]) -> list[str]:
        # Of these task ids only: the event stream is the broker's, and every run on that server
        # hears it (make test-compat runs two Celery versions at once, with the same keys).
        return [e["outcome"] for e in self.events
                if e.get("idempotency_key") == key and e.get("uuid") in ids]

    def close(self) -> None:
        self._recv.should_stop = True
        self._thread.join(5)


def test_every_decision_sends_a_task_idempotency_event(cluster: Cluster) -> None:
    tap = EventTap(tasks.app)
    try:
        cluster.worker()
        first = tasks.charge.delay("ev_1", 1)
        first.get(timeout=30)
        dup = tasks.charge.apply_async(("ev_1", 1), link_error=tasks.plain.si("x"))
        dup.get(timeout=30)
        key = tasks.charge.idempotency_key_for(("ev_1", 1))
        ids = {first.id, dup.id}
        wait_for(lambda: len(tap.outcomes(key, ids)) >= 3, timeout=20, what="three events")
        assert tap.outcomes(key, ids) == ["claimed", "recorded", "duplicate"]
        duplicate = next(e for e in tap.events if e["outcome"] == "duplicate" and e["uuid"] in ids)
        assert duplicate["original_task_id"] == first.id and duplicate["uuid"] == dup.id
        assert duplicate["token"] == first.get()["token"]
    finally:
        tap.close()


def test_record_failure_keeps_the_claim_and_is_reported_loudly(make_cluster) -> None:  # type: ignore[no-untyped-def]
    store = RedisServer(appendonly=True)
    try:
        cluster: Cluster = make_cluster(IDEM_STORE=store.url)
        w = cluster.worker(concurrency=1)
        r = tasks.hold_then_charge.delay("rf_1")
        wait_for(lambda: cluster.effects("started:rf_1"), what="the body to start")
        # The store dies while the body runs; the body then succeeds.
        store.stop(signal.SIGTERM)  # AOF is written on shutdown: the claim survives
        cluster.set_flag("release:rf_1")
        assert r.get(timeout=40) == "rf_1"
        assert "celery_idem RECORD FAILED" in w.text()
        store.start()
        cluster.forget()
        rec = cluster.store.get(tasks.hold_then_charge.idempotency_key_for(("rf_1",)))
        assert rec is not None and rec.state.value == "in_progress"
        assert [str(rec.token)] == cluster.effects("started:rf_1")  # the body's own claim
    finally:
        store.cleanup()


def test_a_worker_refuses_to_start_on_a_backend_without_a_store(cluster: Cluster) -> None:
    env = {**cluster.env, "IDEM_BACKEND": "rpc://"}
    proc = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "tests.integration.app", "worker", "-P", "solo",
         "--without-gossip", "--without-mingle", "--without-heartbeat"],
        cwd=ROOT, env={**__import__("os").environ, **env}, capture_output=True, text=True,
        timeout=60,
    )
    assert proc.returncode != 0
    assert "rpc://" in proc.stderr + proc.stdout and "redis://" in proc.stderr + proc.stdout
