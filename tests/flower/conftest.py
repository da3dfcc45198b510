"""A real Flower, with the celery_idem extension, watching a real worker.

One stack per test package (Flower takes a few seconds to start): a Cluster of its own, on a
broker database of its own (Redis db 7) so the events of other people's workers on the shared
server do not reach this Flower, one worker, and one ``celery flower`` subprocess started the
documented way, with ``--conf`` pointing to a ``flowerconfig.py`` that calls
``celery_idem.contrib.flower.install()``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from celery_idem.config import forget_settings
from tests.conftest import REDIS_URL, require
from tests.integration import app as tasks
from tests.integration.conftest import Cluster
from tests.integration.harness import ROOT, Worker, free_port, wait_for

#: What docs/operations.md tells operators to put in flowerconfig.py.
FLOWERCONFIG = """\
import celery_idem.contrib.flower

celery_idem.contrib.flower.install()
"""

#: Broker and result database of the Flower tests (db 0 carries everybody else's events).
BROKER_DB = 7


class FlowerServer:
    """``celery -A tests.integration.app flower`` on a free port, polled until it answers."""

    def __init__(self, env: dict[str, str], workdir: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        conf = workdir / "flowerconfig.py"
        conf.write_text(FLOWERCONFIG)
        self.log = workdir / "flower.log"
        self._fh = self.log.open("w")
        cmd = [
            sys.executable, "-m", "celery", "-A", "tests.integration.app", "flower",
            f"--port={self.port}", "--address=127.0.0.1", f"--conf={conf}",
            # Our worker runs with -E; do not broadcast enable_events to other workers.
            "--enable_events=False", f"--db={workdir / 'flower.db'}",
        ]
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, env={**os.environ, **env, "FLOWER_UNAUTHENTICATED_API": "true"},
            stdout=self._fh, stderr=subprocess.STDOUT, start_new_session=True,
        )
        wait_for(self._up, timeout=60, what="Flower to answer")

    def _up(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"flower exited: {self.log.read_text()[-3000:]}")
        try:
            return self.get("/healthcheck")[0] == 200
        except OSError:
            return False

    def get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=10) as resp:
                return resp.status, resp.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

    def task(self, task_id: str) -> dict[str, Any] | None:
        """``/api/task/info/<id>``, or None while Flower has not seen the task."""
        status, body = self.get(f"/api/task/info/{task_id}")
        if status == 404:
            return None
        assert status == 200, (status, body)
        return json.loads(body)  # type: ignore[no-any-return]

    def wait_task(self, task_id: str, done: Callable[[dict[str, Any]], bool],
                  timeout: float = 30, what: str = "the task") -> dict[str, Any]:
        """Poll the API until ``done(task)``; the assertion shows the last answer."""
        last: list[dict[str, Any] | None] = [None]

        def check() -> dict[str, Any] | None:
            info = last[0] = self.task(task_id)
            return info if info is not None and done(info) else None

        try:
            return wait_for(check, timeout=timeout, interval=0.1, what=what)  # type: ignore[no-any-return]
        except AssertionError as exc:
            raise AssertionError(f"{exc}; Flower shows {last[0]!r}") from None

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """Flower's ``/metrics`` as {(sample name, sorted labels): value}."""
        status, body = self.get("/metrics")
        assert status == 200
        out = {}
        for family in text_string_to_metric_families(body):
            for sample in family.samples:
                out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._fh.close()


def decisions(metrics: dict[tuple[str, tuple[tuple[str, str], ...]], float], task: str,
              outcome: str) -> float:
    """``celery_idem_decisions_total{task=..., outcome=...}`` (0 when absent)."""
    labels = tuple(sorted({"task": task, "outcome": outcome}.items()))
    return metrics.get(("celery_idem_decisions_total", labels), 0.0)


class Stack:
    """The cluster (client app, worker, ledger) and the Flower watching it."""

    def __init__(self, cluster: Cluster, worker: Worker, flower: FlowerServer) -> None:
        self.cluster = cluster
        self.worker = worker
        self.flower = flower


@pytest.fixture(scope="package")
def stack() -> Iterator[Stack]:
    require(REDIS_URL, 6379, "Redis")
    base = REDIS_URL.rstrip("/")
    tag = uuid.uuid4().hex[:10]
    env = {
        "IDEM_BROKER": f"{base}/{BROKER_DB}",
        "IDEM_BACKEND": f"{base}/{BROKER_DB}",
        "IDEM_PREFIX": f"flower-{tag}:",
        "IDEM_QUEUE": f"flower-{tag}",
        "IDEM_LEDGER": f"{base}/0",
        "IDEM_VISIBILITY": "3600",
    }
    workdir = Path(tempfile.mkdtemp(prefix="celery-idem-flower-"))
    cluster = Cluster(env)
    _forget_broker_connections(cluster.app)
    flower: FlowerServer | None = None
    try:
        worker = cluster.worker("flower", concurrency=1)
        flower = FlowerServer(env, workdir)
        _wait_until_flower_receives_events(flower)
        yield Stack(cluster, worker, flower)
    finally:
        if flower is not None:
            flower.stop()
        cluster.close()
        _forget_broker_connections(cluster.app)


@pytest.fixture
def producer_events(stack: Stack) -> Iterator[None]:
    """The test process as a producer that sends events (``idempotency_events = True``), as the
    README's Flower section tells the application that calls ``delay()`` to be."""
    conf = tasks.app.conf
    saved = conf.get("idempotency_events")
    conf.idempotency_events = True
    forget_settings(tasks.app)  # settings are read once per app: read the change
    try:
        yield
    finally:
        conf.idempotency_events = saved
        forget_settings(tasks.app)


def _forget_broker_connections(app: Any) -> None:
    """Drop the app's pooled broker connections, as Celery does after a fork.

    ``Cluster.forget()`` drops the cached store and result backend, but the producer pool keeps
    the broker URL of the first publish: without this, tasks would still go to db 0.
    """
    app._pool = None
    amqp = app.__dict__.get("amqp")
    if amqp is not None:
        amqp._producer_pool = None


def _wait_until_flower_receives_events(flower: FlowerServer) -> None:
    """Flower answers HTTP before its event receiver consumes: wait until it sees a task."""

    def seen() -> bool:
        probe = tasks.plain.delay("probe")
        probe.get(timeout=30)
        try:
            flower.wait_task(probe.id, lambda t: t.get("state") == "SUCCESS", timeout=3)
        except AssertionError:
            return False
        return True

    wait_for(seen, timeout=60, interval=0.1, what="Flower to receive task events")
