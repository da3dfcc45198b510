"""``celery -A app idem relay`` and ``idem intents``, run as subprocesses on a real Redis store
(the test's own prefix) and a real Redis broker (the test's own queue)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator

import pytest
import redis

from celery_idem.contrib.cli_output import EXIT_REFUSED, EXIT_UNAVAILABLE
from celery_idem.intents import Envelope, encode_envelope
from celery_idem.records import Intent
from tests.cli.conftest import Idem, _idem
from tests.integration.harness import ROOT, free_port, wait_for

# Every command runs as a `celery` subprocess (about 2 s of imports each): the slow group.
pytestmark = pytest.mark.slow

TASK = "tests.integration.app.charge"


@pytest.fixture
def broker(idem_redis: Idem) -> Iterator[redis.Redis]:
    """The broker's Redis, the test's queue (and kombu's binding of it) deleted after the test."""
    client = redis.Redis.from_url(idem_redis.env["IDEM_BROKER"])
    queue = idem_redis.env["IDEM_QUEUE"]
    try:
        yield client
    finally:
        client.delete(queue, f"_kombu.binding.{queue}")
        client.close()


def _queued_ids(client: redis.Redis, queue: str) -> list[str]:
    """The task ids of the messages in ``queue`` (kombu's Redis transport: a list of JSON)."""
    return [json.loads(raw)["headers"]["id"] for raw in client.lrange(queue, 0, -1)]


def _intend(idem: Idem, name: str, *, relay_after: float = 0.001, ttl: float = 600,
            queue: str | None = None) -> Intent:
    """An intent of a message the broker never got (a charge of order ``name``)."""
    queue, task_id = queue or idem.env["IDEM_QUEUE"], uuid.uuid4().hex
    body = json.dumps([[name, 100], {}, {"callbacks": None, "errbacks": None, "chain": None,
                                         "chord": None}]).encode()
    message = encode_envelope(Envelope(
        body=body, content_type="application/json", content_encoding="utf-8",
        headers={"lang": "py", "task": TASK, "id": task_id, "root_id": task_id,
                 "parent_id": None, "group": None, "retries": 0, "eta": None, "expires": None,
                 "argsrepr": repr([name, 100]), "kwargsrepr": "{}", "origin": "test"},
        properties={"correlation_id": task_id, "reply_to": "", "priority": 0},
        exchange=queue, exchange_type="direct", routing_key=queue, queue=queue))
    return idem.store.intend(f"{TASK}:{name}", task_id, queue, message, relay_after=relay_after,
                             ttl=ttl)


def _due(idem: Idem, *intents: Intent) -> None:
    wait_for(lambda: idem.store.now() > max(i.deadline for i in intents), timeout=10,
             what="the intents' deadlines")


def test_relay_once_re_sends_a_lost_message_with_its_task_id(idem_redis: Idem,
                                                             broker: redis.Redis) -> None:
    queue = idem_redis.env["IDEM_QUEUE"]
    lost = _intend(idem_redis, "o-1")
    _due(idem_redis, lost)
    out = idem_redis.run("relay", "--once")
    assert out.returncode == 0, out.stderr
    assert f"relayed key={lost.key} task_id={lost.task_id} queue={queue} reason=queue_empty" \
        in out.stdout
    assert "relayed 1, waiting 0, closed 0, stale 0, postponed 0" in out.stdout
    assert _queued_ids(broker, queue) == [lost.task_id]
    # Moved a relay_after (60 s) on: a second pass sends nothing.
    doc = idem_redis.json("relay", "--once")
    assert (doc["relayed"], doc["resends"]) == (0, [])
    assert _queued_ids(broker, queue) == [lost.task_id]
    (moved,) = idem_redis.store.intents()
    assert moved.deadline > lost.deadline + 50 and moved.sent > lost.sent


def test_relay_dry_run_sends_and_moves_nothing(idem_redis: Idem, broker: redis.Redis) -> None:
    queue = idem_redis.env["IDEM_QUEUE"]
    lost = _intend(idem_redis, "o-2")
    _due(idem_redis, lost)
    out = idem_redis.run("relay", "--once", "--dry-run")
    assert out.returncode == 0, out.stderr
    assert f"would relay key={lost.key} task_id={lost.task_id}" in out.stdout
    assert "would relay 1," in out.stdout and "dry run" in out.stdout
    assert _queued_ids(broker, queue) == []
    assert list(idem_redis.store.intents()) == [lost]


def test_relay_leaves_a_message_still_in_its_queue(idem_redis: Idem, broker: redis.Redis) -> None:
    queue = idem_redis.env["IDEM_QUEUE"]
    waiting = _intend(idem_redis, "o-3")
    broker.lpush(queue, json.dumps({"body": "", "headers": {"id": "someone-else"}}))
    _due(idem_redis, waiting)
    doc = idem_redis.json("relay", "--once")
    assert (doc["relayed"], doc["waiting"]) == (0, 1)
    assert list(doc["oldest"]) == [queue]
    assert _queued_ids(broker, queue) == ["someone-else"]


def test_intents_counts_pending_overdue_stale_and_the_oldest_per_queue(
        idem_redis: Idem, broker: redis.Redis) -> None:
    queue = idem_redis.env["IDEM_QUEUE"]
    overdue = _intend(idem_redis, "o-4")
    _intend(idem_redis, "o-5", relay_after=600)
    stale = _intend(idem_redis, "o-6", ttl=0.05)
    wait_for(lambda: idem_redis.store.now() > max(stale.expires, overdue.deadline), timeout=10,
             what="one intent stale, one overdue")
    doc = idem_redis.json("intents")
    assert (doc["pending"], doc["overdue"], doc["stale"]) == (3, 1, 1)
    assert list(doc["oldest"]) == [queue] and doc["oldest"][queue] >= 0
    text = idem_redis.run("intents").stdout
    assert "pending       3" in text and "overdue       1" in text and "stale         1" in text
    assert f"oldest on {queue}: " in text
    # The relay closes the stale one unsent and re-sends the overdue one.
    doc = idem_redis.json("relay", "--once")
    assert (doc["stale"], doc["relayed"]) == (1, 1)
    assert _queued_ids(broker, queue) == [overdue.task_id]
    assert idem_redis.json("intents")["pending"] == 2


@pytest.fixture
def idem_amqp(amqp_url: str, redis_url: str) -> Iterator[Idem]:
    """The command on a fresh Redis prefix with RabbitMQ as the broker (the test's queues
    deleted after it)."""
    from kombu import Connection

    for idem in _idem(redis_url, redis_url):
        idem.env["IDEM_BROKER"] = amqp_url
        yield idem
        with Connection(amqp_url) as conn:
            for queue in (idem.env["IDEM_QUEUE"], idem.env["IDEM_QUEUE"] + "-busy"):
                conn.default_channel.queue_delete(queue)


def test_relay_on_rabbitmq_reads_a_missing_queue_as_empty_and_goes_on(idem_amqp: Idem) -> None:
    from kombu import Connection, Queue

    queue, busy = idem_amqp.env["IDEM_QUEUE"], idem_amqp.env["IDEM_QUEUE"] + "-busy"
    lost = _intend(idem_amqp, "o-7")  # its queue does not exist: RabbitMQ's 404 closes the channel
    waiting = _intend(idem_amqp, "o-8", queue=busy)  # read next, on a fresh channel
    with Connection(idem_amqp.env["IDEM_BROKER"]) as conn, conn.Producer() as producer:
        producer.publish(b"x", routing_key=busy, declare=[Queue(busy)])
    _due(idem_amqp, lost, waiting)
    doc = idem_amqp.json("relay", "--once")
    assert (doc["relayed"], doc["waiting"]) == (1, 1)
    assert [r["task_id"] for r in doc["resends"]] == [lost.task_id]
    with Connection(idem_amqp.env["IDEM_BROKER"]) as conn:
        channel = conn.default_channel
        message = channel.basic_get(queue, no_ack=True)
        assert message is not None and message.headers["id"] == lost.task_id
        assert channel.basic_get(queue, no_ack=True) is None


def test_relay_exits_4_when_the_broker_cannot_be_reached(idem_redis: Idem) -> None:
    lost = _intend(idem_redis, "o-9")
    _due(idem_redis, lost)
    out = idem_redis.run("relay", "--once", env={"IDEM_BROKER": f"redis://127.0.0.1:{free_port()}/0"})
    assert out.returncode == EXIT_UNAVAILABLE, out.stderr
    assert "the broker cannot be reached" in out.stderr and out.stdout == ""
    assert list(idem_redis.store.intents()) == [lost]  # nothing moved: the next pass sends it


def test_relay_without_once_runs_until_interrupted(idem_redis: Idem, broker: redis.Redis) -> None:
    queue = idem_redis.env["IDEM_QUEUE"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "tests.integration.app", "idem", "relay", "--json"],
        cwd=ROOT, env={**os.environ, **idem_redis.env}, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    try:
        lost = _intend(idem_redis, "o-10")  # written while the relay runs: a later pass sends it
        wait_for(lambda: _queued_ids(broker, queue) == [lost.task_id], timeout=60,
                 what="the running relay to re-send the lost message")
    finally:
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    doc = json.loads(out)  # one document: the one pass that did something
    assert [r["task_id"] for r in doc["resends"]] == [lost.task_id]


@pytest.mark.parametrize("command", ["relay", "intents"])
def test_a_store_without_intents_is_refused(idem_redis: Idem, command: str) -> None:
    out = idem_redis.run(command, "--json", env={"IDEM_NO_INTENTS": "1"}, app="tests.cli.cli_app")
    assert out.returncode == EXIT_REFUSED, out.stderr
    assert "keeps no intents" in json.loads(out.stderr)["message"]
