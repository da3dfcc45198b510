"""No action lost, and none sent twice: the relay leaves alone what still waits in its queue.

Real ``celery worker`` processes on a private ``redis-server`` broker; the store, the result
backend and the ledger are the shared Redis under the test's own prefix. The task keeps an intent
at enqueue (``idempotency_intent=True``; ``idempotency_relay_after`` 2 s, interval 0.2 s). The
relays are ``celery -A tests.integration.intent_app idem relay`` processes, beside no worker or
beside workers whose own relay is off.

``IDEM_INTENTS=0`` runs the same tests with a task that keeps no intent: each fails (the
control). ``IDEM_BACKLOG`` sets the backlog's size (default 2,000: ``IDEM_BACKLOG=10000`` for the
10,000 of docs/reliability.md, about a minute on an idle machine and a heavy load beside the
suite's timing-sensitive tests).
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import datetime

import pytest

from tests.integration import intent_app as tasks
from tests.integration.conftest import Cluster
from tests.integration.harness import RedisServer, wait_for
from tests.integration.intent_support import (
    APP,
    RELAY_AFTER,
    RELAY_INTERVAL,
    Relay,
    effects,
    flush,
    kept,
    make_intent_cluster,
    queued,
    relayed_lines,
    wait_effects,
)

pytestmark = [pytest.mark.worker, pytest.mark.crash]

BACKLOG = int(os.environ.get("IDEM_BACKLOG", "2000"))


@pytest.fixture
def broker() -> Iterator[RedisServer]:
    server = RedisServer()
    yield server
    server.cleanup()


@pytest.fixture
def cluster(make_cluster: Callable[..., Cluster], broker: RedisServer) -> Cluster:
    return make_intent_cluster(make_cluster, broker)


@pytest.fixture
def relay(cluster: Cluster) -> Iterator[Callable[[str], Relay]]:
    """Starts ``celery -A tests.integration.intent_app idem relay`` processes (stopped after)."""
    started: list[Relay] = []

    def start(name: str) -> Relay:
        started.append(Relay(cluster.env, f"{name}-{cluster.prefix.strip(':')}"))
        return started[-1]

    yield start
    for r in started:
        r.stop()


def _queue(cluster: Cluster) -> str:
    return cluster.env["IDEM_QUEUE"]


def _hold_steady(broker: RedisServer, cluster: Cluster, n: int, seconds: float,
                 relays: list[Relay]) -> None:
    """For ``seconds``: exactly ``n`` messages in the queue, and no relay re-sent one."""
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        assert queued(broker, _queue(cluster)) == n
        for one in relays:
            assert one.alive(), one.text()[-2000:]
            assert not one.relayed(), one.relayed()[:3]
        time.sleep(0.2)


@pytest.mark.timeout(900)  # with IDEM_BACKLOG=10000: about 1 min on an idle machine
def test_a_backlog_waiting_in_its_queue_is_not_re_sent(
    cluster: Cluster, broker: RedisServer, relay: Callable[[str], Relay],
) -> None:
    # Given a relay (``idem relay``), and no worker on the queue
    relayer = relay("relay")
    # When a backlog of actions is enqueued
    started = time.monotonic()
    results = [tasks.intended.delay(f"b-{i}") for i in range(BACKLOG)]
    enqueued = time.monotonic() - started
    assert queued(broker, _queue(cluster)) == BACKLOG
    assert len(kept(cluster)) == BACKLOG, "an enqueue kept no intent"
    # Then for three relay periods after the last enqueue nothing is re-sent: the queue holds
    # exactly the backlog, and the relay logs no re-send
    _hold_steady(broker, cluster, BACKLOG, 3 * RELAY_AFTER, [relayer])
    # And the relay did look at every intent: each was due, found waiting, and put off
    intents = kept(cluster)
    assert len(intents) == BACKLOG
    assert min(i.deadline - i.enqueued for i in intents) > 1.5 * RELAY_AFTER
    # When workers start on the queue
    started = time.monotonic()
    workers = [cluster.worker(f"w{n}", app=APP, pool="prefork", concurrency=2) for n in (1, 2)]
    # Then every action runs, exactly once
    actions = [f"b-{i}" for i in range(BACKLOG)]
    wait_effects(cluster, actions, timeout=60 + BACKLOG / 20, what="the backlog to run")
    drained = time.monotonic() - started
    assert results[-1].get(timeout=10)["action"] == actions[-1]
    wait_for(lambda: not kept(cluster), timeout=RELAY_AFTER + 30, what="the intents to close")
    counts = Counter(a for a, _, _ in effects(cluster))
    assert counts == dict.fromkeys(actions, 1), [a for a, n in counts.items() if n != 1][:5]
    resent = len(relayer.relayed()) + sum(len(relayed_lines(w.text())) for w in workers)
    print(f"\n{BACKLOG} enqueued in {enqueued:.1f} s, ran in {drained:.1f} s; {resent} re-sent "
          f"while the queue drained (each ran once)")


def test_a_draining_backlog_is_not_re_sent(cluster: Cluster, broker: RedisServer,
                                           relay: Callable[[str], Relay]) -> None:
    n = 1000
    # Given a backlog waiting in its queue, its intents due and put off by a relay
    relayer = relay("relay")
    [tasks.intended.delay(f"d-{i}") for i in range(n)]
    _hold_steady(broker, cluster, n, 2 * RELAY_AFTER, [relayer])
    # When workers drain it
    workers = [cluster.worker(f"w{k}", app=APP, pool="prefork", concurrency=2) for k in (1, 2)]
    actions = [f"d-{i}" for i in range(n)]
    wait_effects(cluster, actions, timeout=60 + n / 20, what="the backlog to run")
    wait_for(lambda: not kept(cluster), timeout=RELAY_AFTER + 30, what="the intents to close")
    # Then each ran once, and few messages were re-sent: only ones a worker had taken and not
    # yet claimed when a later one was (a relay cannot tell them from lost ones)
    counts = Counter(a for a, _, _ in effects(cluster))
    assert counts == dict.fromkeys(actions, 1)
    resent = len(relayer.relayed()) + sum(len(relayed_lines(w.text())) for w in workers)
    assert resent <= n // 20, f"{resent} re-sent while {n} drained"


def test_a_countdown_is_not_re_sent_before_it_is_due(cluster: Cluster) -> None:
    worker = cluster.worker("w1", app=APP)
    # Given an action with a countdown of 600 s, and one with a countdown of 5 s
    sent = time.time()
    late = tasks.intended.apply_async(("cd600",), countdown=600)
    soon = tasks.intended.apply_async(("cd5",), countdown=5)
    # Then both intents are kept, each due only a relay period after its eta
    due = {i.key: i.deadline for i in kept(cluster)}
    late_key = tasks.intended.idempotency_key_for(("cd600",))
    soon_key = tasks.intended.idempotency_key_for(("cd5",))
    assert due.keys() == {late_key, soon_key}
    assert due[late_key] >= sent + 600 + RELAY_AFTER - 1
    assert due[soon_key] >= sent + 5 + RELAY_AFTER - 1
    # And the 5 s one runs once, not before its eta
    [(action, task_id, at)] = wait_for(lambda: effects(cluster), timeout=5 + RELAY_AFTER + 15,
                                       what="the 5 s countdown to run")
    assert (action, task_id) == ("cd5", soon.id)
    assert at >= sent + 5 - 0.1, f"ran {at - sent:.2f} s after the send"
    assert soon.get(timeout=10)["action"] == "cd5"
    wait_for(lambda: [i.key for i in kept(cluster)] == [late_key], timeout=RELAY_AFTER + 10,
             what="the 5 s countdown's intent to close")
    # And, over three relay periods, the 600 s one is not run, nor re-sent; the 5 s one not again.
    # A re-send of the 5 s one at or after its due time is the relay's contract (the worker holds
    # an eta message unclaimed until it runs; a loaded machine can run it after the due time):
    # harmless (it ran once), and never before it is due.
    until = time.monotonic() + 3 * RELAY_AFTER
    while time.monotonic() < until:
        assert [e[0] for e in effects(cluster)] == ["cd5"]
        for line in relayed_lines(worker.text()):
            assert soon_key in line, line
            logged = datetime.strptime(line[1:24], "%Y-%m-%d %H:%M:%S,%f").timestamp()
            assert logged >= due[soon_key] - 0.5, f"re-sent {due[soon_key] - logged:.2f} s before due: {line}"
        time.sleep(0.2)
    assert late.state == "PENDING"


def _relayed_keys(relays: list[Relay]) -> list[str]:
    return [line.split("key=")[1].split()[0] for r in relays for line in r.relayed()]


def _all_due(cluster: Cluster, n: int) -> None:
    """Wait until the store has ``n`` due intents: a relay starting now sees them all at once."""
    wait_for(lambda: len(cluster.store.due_intents(n + 1)) == n, timeout=RELAY_AFTER + 10,
             what=f"{n} intents to be due")


def test_two_relays_over_a_flushed_broker_re_send_each_action_once(
    cluster: Cluster, broker: RedisServer, relay: Callable[[str], Relay],
) -> None:
    n = 200
    # Given n actions enqueued while no worker runs, then lost: the broker is flushed
    results = [tasks.intended.delay(f"two-{i}") for i in range(n)]
    flush(broker)
    _all_due(cluster, n)
    # When two relays (``idem relay``) start at once
    relays = [relay("ra"), relay("rb")]
    # Then they re-send, and no action twice: for two relay periods with no worker on the
    # queue, each key is in one re-send at most, and the queue holds no more than n messages.
    # (Once the queue holds re-sent messages, the intents not yet re-sent may be still waiting
    # in it, as far as a relay can tell: they go once a worker claims the re-sent ones.)
    wait_for(lambda: queued(broker, _queue(cluster)) > 0, timeout=RELAY_AFTER + 15,
             what="the relays to re-send")
    until = time.monotonic() + 2 * RELAY_AFTER
    while time.monotonic() < until:
        keys = _relayed_keys(relays)
        assert len(keys) == len(set(keys)), "an action was re-sent twice"
        assert queued(broker, _queue(cluster)) <= n
        time.sleep(0.2)
    # And the queue holds one message per re-send logged (a re-send is logged after its publish)
    wait_for(lambda: queued(broker, _queue(cluster)) == len(_relayed_keys(relays)), timeout=5,
             what="one message per re-send")
    by_relay = [len(r.relayed()) for r in relays]
    # When a worker starts on the queue (its relay off: the two relays re-send the rest), every
    # action runs once and its caller's handle answers
    cluster.env["IDEM_RELAY"] = "0"  # read by the workers started from here on
    cluster.worker("w1", app=APP)
    actions = [f"two-{i}" for i in range(n)]
    wait_effects(cluster, actions, timeout=60)
    assert [r.get(timeout=10)["task_id"] for r in results] == [r.id for r in results]
    counts = Counter(a for a, _, _ in effects(cluster))
    assert counts == dict.fromkeys(actions, 1)
    print(f"\nre-sent by each relay: {by_relay}")


def test_a_relay_killed_mid_batch_leaves_nothing_lost(
    cluster: Cluster, broker: RedisServer, relay: Callable[[str], Relay],
) -> None:
    n = 1000
    # Given n actions enqueued while no worker runs, then lost in a broker flush
    results = [tasks.intended.delay(f"kill-{i}") for i in range(n)]
    flush(broker)
    _all_due(cluster, n)
    # When a relay starts, and is SIGKILLed right after its first re-send
    first = relay("ra")
    wait_for(first.relayed, timeout=RELAY_AFTER + 15, interval=0.005, what="the first re-send")
    first.kill()
    resent = len(first.relayed())
    in_queue = queued(broker, _queue(cluster))
    assert in_queue < n, "the relay re-sent every action before it was killed"
    # Then, with another relay and a worker on the queue (its own relay off), every action runs
    # exactly once
    relay("rb")
    cluster.env["IDEM_RELAY"] = "0"  # read by the workers started from here on
    cluster.worker("w1", app=APP, concurrency=4)
    actions = [f"kill-{i}" for i in range(n)]
    wait_effects(cluster, actions, timeout=90)
    assert results[0].get(timeout=10)["action"] == actions[0]
    wait_for(lambda: not kept(cluster), timeout=RELAY_AFTER + 30, what="the intents to close")
    counts = Counter(a for a, _, _ in effects(cluster))
    assert counts == dict.fromkeys(actions, 1), [a for a, c in counts.items() if c != 1][:5]
    print(f"\nthe killed relay had re-sent {resent} ({in_queue} in the queue) of {n}; "
          f"relay_interval {RELAY_INTERVAL:g} s")
