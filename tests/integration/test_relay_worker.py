"""A worker's relay (celery_idem.contrib.relay_worker): a message the broker lost after the
enqueue is re-sent with its task id, runs once, and its intent is closed. Real Redis broker,
backend and store; real ``celery worker`` processes (prefork and gevent)."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator

import pytest

from tests.integration.conftest import Cluster
from tests.integration.harness import wait_for

pytestmark = pytest.mark.worker

RELAY_AFTER = 1.0


@pytest.fixture
def relay_cluster(cluster: Cluster) -> Iterator[Cluster]:
    """The cluster with a 1 s relay_after, in the workers and in this process (the producer
    writes the intent's first deadline)."""
    from tests.integration import relay_app  # noqa: F401 (registers ship on the app)

    conf = cluster.app.conf
    saved = conf.get("idempotency_relay_after", 60.0)
    conf.idempotency_relay_after = RELAY_AFTER
    cluster.env["IDEM_RELAY_AFTER"] = str(RELAY_AFTER)
    cluster.forget()
    try:
        yield cluster
    finally:
        conf.idempotency_relay_after = saved
        cluster.forget()


@pytest.mark.parametrize("pool", [
    "prefork",
    pytest.param("gevent", marks=pytest.mark.skipif(importlib.util.find_spec("gevent") is None,
                                                    reason="gevent not installed")),
])
def test_a_worker_re_sends_a_message_the_broker_lost(relay_cluster: Cluster, pool: str) -> None:
    from tests.integration.relay_app import ship

    cluster = relay_cluster
    queue = cluster.env["IDEM_QUEUE"]
    # Given an enqueue whose message the broker then loses (deleted before any worker ran)
    result = ship.delay(f"o-{pool}")
    assert cluster.ledger.llen(queue) == 1
    cluster.ledger.delete(queue)
    (intent,) = cluster.store.intents()
    assert intent.task_id == result.id
    # When a worker starts: its relay re-sends it once it is due
    worker = cluster.worker(f"relay-{pool}", pool=pool, app="tests.integration.relay_app")
    # Then it runs once, under the task id the caller holds, and its intent is closed
    assert result.get(timeout=60) == f"o-{pool}"
    assert cluster.effects(f"ship:o-{pool}") == [result.id]
    wait_for(lambda: list(cluster.store.intents()) == [], timeout=30,
             what="the relay to close the intent")
    log = worker.text()
    assert "celery_idem relay started" in log
    assert (", gevent pool" in log) is (pool == "gevent")  # a greenlet, not a thread
    assert f"celery_idem relayed key={intent.key} task_id={result.id} reason=queue_empty" in log
    # At least once: a worker slower than the 1 s relay_after to claim the re-sent message (a
    # loaded machine) may get it again, which costs a message, never an effect (checked above).
    assert log.count("celery_idem relayed") >= 1


def test_idempotency_relay_false_starts_no_relay(relay_cluster: Cluster) -> None:
    # worker_ready (which starts the relay) is sent before the worker logs " ready."
    relay_cluster.env["IDEM_RELAY"] = "0"
    off = relay_cluster.worker("relay-off", app="tests.integration.relay_app")
    relay_cluster.env.pop("IDEM_RELAY")
    on = relay_cluster.worker("relay-on", app="tests.integration.relay_app")
    assert "celery_idem relay started" not in off.text()
    assert "celery_idem relay started" in on.text()
