"""No action lost: a message the broker loses is re-sent from its intent, and runs once.

Real ``celery worker`` processes on a private ``redis-server`` broker that the tests restart
empty, flush, or leave holding a dead gevent worker's message. The store, the result backend and
the ledger are the shared Redis under the test's own prefix: they outlive the broker. The task
keeps an intent at enqueue (``idempotency_intent=True``); the relays run in the workers
(``idempotency_relay_after`` 2 s, ``idempotency_relay_interval`` 0.2 s).

``IDEM_INTENTS=0`` runs the same tests with a task that keeps no intent: each of them fails, the
lost actions never run (the control).
"""

from __future__ import annotations

import importlib.util
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.integration import intent_app as tasks
from tests.integration.conftest import Cluster
from tests.integration.harness import RedisServer, wait_for
from tests.integration.intent_support import (
    APP,
    INTENTS,
    RELAY_AFTER,
    RELAY_INTERVAL,
    drop_sql_intents,
    effects,
    flush,
    kept,
    make_intent_cluster,
    queued,
    relayed_lines,
    restart_empty,
    wait_effects,
)

pytestmark = [pytest.mark.worker, pytest.mark.crash]

N = 20
#: How long after a worker is ready every lost action has run: the intents are due already (they
#: were enqueued more than relay_after earlier), so one relay pass, the runs, and some slack.
SOON = RELAY_AFTER + RELAY_INTERVAL + 8


@pytest.fixture
def broker() -> Iterator[RedisServer]:
    server = RedisServer()
    yield server
    server.cleanup()


@pytest.fixture(params=["redis", "postgresql"])
def cluster(request: pytest.FixtureRequest, make_cluster: Callable[..., Cluster],
            broker: RedisServer) -> Iterator[Cluster]:
    """The store on the shared Redis (results too), or on PostgreSQL (results in Celery's
    database backend there): never on the broker."""
    if request.param == "redis":
        yield make_intent_cluster(make_cluster, broker)
        return
    url = "db+" + request.getfixturevalue("pg_url")
    cluster = make_intent_cluster(make_cluster, broker, IDEM_STORE=url, IDEM_BACKEND=url)
    yield cluster
    drop_sql_intents(cluster)


def _enqueue_while_no_worker(cluster: Cluster, broker: RedisServer, name: str) -> list[object]:
    """N actions enqueued with no worker running: each is a message in the queue and, with the
    option on, an intent in the store."""
    results = [tasks.intended.delay(f"{name}-{i}") for i in range(N)]
    assert queued(broker, cluster.env["IDEM_QUEUE"]) == N
    if INTENTS:  # the control keeps none: it goes on to show the loss
        assert len(kept(cluster)) == N, "an enqueue kept no intent"
    return results


def _every_action_runs_once(cluster: Cluster, results: list[object], name: str,
                            log: Callable[[], str]) -> None:
    actions = [f"{name}-{i}" for i in range(N)]
    started = time.monotonic()
    counts = wait_effects(cluster, actions, timeout=SOON, what="the lost actions to run")
    took = time.monotonic() - started
    # The callers' handles answer: the re-sent message keeps the task id, the result backend
    # (the shared Redis) outlived the broker
    outs = [r.get(timeout=10) for r in results]  # type: ignore[attr-defined]
    assert [o["task_id"] for o in outs] == [r.id for r in results]  # type: ignore[attr-defined]
    assert [o["action"] for o in outs] == actions
    # Once each: a relay pass later, no second run, and every intent closed
    wait_for(lambda: not kept(cluster), timeout=RELAY_AFTER + 10, what="the intents to close")
    counts = Counter(a for a, _, _ in effects(cluster))
    assert counts == dict.fromkeys(actions, 1), counts
    assert len(relayed_lines(log())) >= N
    print(f"\n{N} lost actions ran {took:.2f} s after the worker was ready")


def test_a_broker_restarted_empty_loses_no_action(cluster: Cluster, broker: RedisServer) -> None:
    # Given N actions enqueued while no worker runs
    results = _enqueue_while_no_worker(cluster, broker, "restart")
    # When the broker restarts without persistence: every message is gone
    restart_empty(broker)
    assert queued(broker, cluster.env["IDEM_QUEUE"]) == 0
    # Then a worker started afterwards runs every action exactly once, soon, and the callers'
    # handles answer
    worker = cluster.worker("w1", app=APP)
    _every_action_runs_once(cluster, results, "restart", worker.text)


def test_a_flushed_broker_loses_no_action(cluster: Cluster, broker: RedisServer) -> None:
    # Given N actions enqueued while no worker runs
    results = _enqueue_while_no_worker(cluster, broker, "flush")
    # When the broker is flushed (FLUSHALL): the queue is gone
    flush(broker)
    assert queued(broker, cluster.env["IDEM_QUEUE"]) == 0
    # Then a worker started afterwards runs every action exactly once, soon
    worker = cluster.worker("w1", app=APP)
    _every_action_runs_once(cluster, results, "flush", worker.text)


GEVENT = importlib.util.find_spec("gevent") is not None


def _pids(marker: Path) -> list[int]:
    return [int(p) for p in marker.read_text().split()] if marker.exists() else []


@pytest.mark.skipif(not GEVENT, reason="gevent not installed")
def test_a_gevent_worker_killed_mid_body_loses_no_action(
    cluster: Cluster, broker: RedisServer, tmp_path: Path,
) -> None:
    # Given two gevent workers on the Redis broker (a surviving gevent worker never restores a
    # dead worker's unacknowledged message: tests/integration/test_gevent_recovery.py)
    first = cluster.worker("ga", pool="gevent", concurrency=2, app=APP)
    second = cluster.worker("gb", pool="gevent", concurrency=2, app=APP)
    marker = tmp_path / "pids"
    # And an action (lease 3 s) whose body is running on one of them
    r = tasks.intended.delay("gevent", hold=600, marker=str(marker))
    [pid] = wait_for(lambda: _pids(marker), timeout=30, what="the body to start")
    holder = next(w for w in (first, second) if w.proc.pid == pid)  # gevent: no child process
    survivor = second if holder is first else first
    # When that whole worker is SIGKILLed mid-body
    holder.kill()
    killed = time.time()
    key = tasks.intended.idempotency_key_for(("gevent",))
    rec = cluster.store.get(key)
    assert rec is not None and rec.lease_expires is not None
    lease_expires = rec.lease_expires  # the dead holder renews it no more
    cluster.set_flag("release:gevent")  # a re-run finishes at once
    # Then the action runs once more, by the survivor, soon after the lease runs out: the
    # relay re-sends the message from its intent
    [(action, task_id, at)] = wait_for(
        lambda: effects(cluster), timeout=lease_expires - killed + RELAY_AFTER + 12,
        what="the killed worker's action to run")
    assert (action, task_id) == ("gevent", r.id)
    assert at >= lease_expires - 0.5, "ran before the dead holder's lease ran out"
    assert at <= lease_expires + RELAY_AFTER + RELAY_INTERVAL + 6
    out = r.get(timeout=10)
    assert out["task_id"] == r.id and out["pid"] == survivor.proc.pid
    assert len(relayed_lines(survivor.text())) >= 1
    wait_for(lambda: not kept(cluster), timeout=RELAY_AFTER + 10, what="the intent to close")
    assert len(effects(cluster)) == 1
    print(f"\nre-run {at - killed:.2f} s after the kill, {at - lease_expires:.2f} s after the "
          f"lease ran out")


@pytest.mark.parametrize("store_db", [0, 1], ids=["same-db", "other-db"])
def test_an_intent_written_within_the_publish_re_sends_the_message_as_sent(
        make_cluster: Callable[..., Cluster], redis_url: str, store_db: int) -> None:
    """The store on the broker's server, on its database or another (Celery's "broker on /0,
    backend on /1"): the publish's script writes the intent, and it keeps kombu's own payload
    (no second encoding of the message). A message lost from the queue is re-sent from it
    unchanged but for its delivery tag, and runs once."""
    import redis
    from kombu.utils.json import loads

    from celery_idem.contrib.relay import Relay
    from celery_idem.intents import kombu_redis_head

    backend = redis_url.rsplit("/", 1)[0] + f"/{store_db}"
    cluster = make_cluster(IDEM_RELAY_AFTER=str(RELAY_AFTER), IDEM_BACKEND=backend,
                           IDEM_RELAY_INTERVAL=str(RELAY_INTERVAL), IDEM_INTENTS="1")
    queue = cluster.env["IDEM_QUEUE"]
    # The task's enqueue check as for a fresh process: one built for an earlier test's store (a
    # broker of its own) has found the publish cannot take the check, and reads first.
    tasks.intended.__dict__.pop("_enqueue_check", None)
    broker = redis.Redis.from_url(redis_url)
    try:
        # Given N actions enqueued while no worker runs, each intent written in the publish
        results = [tasks.intended.apply_async((f"fused-{i}",), {"hold": 0.01 * i})
                   for i in range(N)]
        assert tasks.intended._enqueue_check.possible, "the check did not ride on the publish"
        sent = {loads(m)["headers"]["id"]: m for m in broker.lrange(queue, 0, -1)}
        assert len(sent) == N
        intents = {i.task_id: i for i in kept(cluster)}
        assert intents.keys() == sent.keys()
        head = kombu_redis_head(queue, "direct")
        for task_id, intent in intents.items():
            assert intent.message == head + sent[task_id], "not the bytes the publish pushed"
        # When the messages are lost (the queue's list deleted) and the intents are due
        broker.delete(queue)
        wait_for(lambda: len(cluster.store.due_intents(N + 1)) == N, timeout=RELAY_AFTER + 10,
                 what=f"{N} intents to be due")
        report = Relay(cluster.app, cluster.store, relay_after=RELAY_AFTER).run_once()
        assert report.relayed == N
        # Then each is re-sent as it was first sent: body, headers and properties; a new
        # delivery tag
        again = {loads(m)["headers"]["id"]: loads(m) for m in broker.lrange(queue, 0, -1)}
        assert again.keys() == sent.keys()
        for task_id, raw in sent.items():
            first, resent = loads(raw), again[task_id]
            tag = first["properties"].pop("delivery_tag")
            assert resent["properties"].pop("delivery_tag") != tag
            assert resent == first
        # And a worker runs each action once, with its arguments; the callers' handles answer
        worker = cluster.worker("w1", app=APP)
        actions = [f"fused-{i}" for i in range(N)]
        wait_effects(cluster, actions, timeout=SOON + 20, what="the re-sent actions to run")
        outs = [r.get(timeout=10) for r in results]
        assert [o["task_id"] for o in outs] == [r.id for r in results]
        assert [o["action"] for o in outs] == actions
        wait_for(lambda: not kept(cluster), timeout=RELAY_AFTER + 10, what="the intents to close")
        assert Counter(a for a, _, _ in effects(cluster)) == dict.fromkeys(actions, 1), worker.text()
    finally:
        broker.close()
        if store_db:  # the cluster cleans the ledger's database; the store's is another
            store = redis.Redis.from_url(backend)
            for name in store.scan_iter(match=cluster.prefix + "*", count=1000):
                store.delete(name)
            store.close()
