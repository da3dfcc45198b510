"""celery_idem.contrib.relay: the decision per due intent (pure), and one pass on an in-process
store and broker (``memory://``): what is re-sent, closed, postponed or left waiting."""

from __future__ import annotations

import json
import logging
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import celery._state
import pytest
from celery import Celery

from celery_idem import IdempotentTask, events
from celery_idem.contrib import relay_worker
from celery_idem.contrib.relay import Action, Kind, Relay, decide, decode_envelope, publish_envelope
from celery_idem.intents import Envelope, encode_envelope
from celery_idem.records import Intent, Record, State
from celery_idem.stores.memory import MemoryStore

NOW = 1_000_000.0
AFTER = 60.0


def _intent(enqueued: float = NOW - 100, deadline: float = NOW - 1, expires: float = NOW + 3600,
            queue: str = "q") -> Intent:
    return Intent("op:k", "tid-1", queue, b"{}", enqueued, deadline, expires)


def _record(state: State, lease_expires: float | None = None) -> Record:
    return Record(key="op:k", state=state, token=7, task_id="tid-1", lease_expires=lease_expires)


# -- decide: every branch -------------------------------------------------------------------------


def test_a_stale_intent_is_closed_unsent_whatever_its_record() -> None:
    for record in (None, _record(State.RELEASED), _record(State.IN_PROGRESS, NOW + 50)):
        assert decide(_intent(expires=NOW), record, NOW, 0, 0.0, AFTER) == Action(Kind.STALE)


@pytest.mark.parametrize("state", [State.DONE, State.FAILED])
def test_a_recorded_outcome_closes_the_intent_and_raises_its_queues_watermark(state: State) -> None:
    intent = _intent()
    assert decide(intent, _record(state), NOW, 5, 0.0, AFTER) == \
        Action(Kind.CLOSE, watermark=intent.enqueued)


def test_a_live_lease_postpones_to_its_end_plus_relay_after() -> None:
    intent = _intent()
    action = decide(intent, _record(State.IN_PROGRESS, NOW + 30), NOW, 0, 0.0, AFTER)
    assert action == Action(Kind.POSTPONE, deadline=NOW + 30 + AFTER, watermark=intent.enqueued)


def test_an_expired_lease_is_re_sent() -> None:
    for lease_end in (NOW, NOW - 5, None):
        action = decide(_intent(), _record(State.IN_PROGRESS, lease_end), NOW, 3, 0.0, AFTER)
        assert action == Action(Kind.RESEND, deadline=NOW + AFTER, reason="lease_expired")


def test_a_released_claim_is_re_sent_even_with_a_backlog() -> None:
    # It was claimed: its message left the queue, whatever the queue holds now.
    assert decide(_intent(), _record(State.RELEASED), NOW, 10, 0.0, AFTER) == \
        Action(Kind.RESEND, deadline=NOW + AFTER, reason="released")


def test_never_claimed_behind_a_backlog_and_above_the_watermark_still_waits() -> None:
    intent = _intent()
    assert decide(intent, None, NOW, 4, intent.enqueued - 1, AFTER) == \
        Action(Kind.WAIT, deadline=NOW + AFTER)


def test_never_claimed_with_an_empty_or_missing_queue_is_re_sent() -> None:
    assert decide(_intent(), None, NOW, 0, 0.0, AFTER) == \
        Action(Kind.RESEND, deadline=NOW + AFTER, reason="queue_empty")


def test_never_claimed_when_a_later_message_of_its_queue_was_claimed_is_re_sent() -> None:
    intent = _intent()
    for mark in (intent.enqueued, intent.enqueued + 1):  # equal: the watermark is this very intent
        # The queue's length is not read for such an intent (the relay passes 0): still overtaken.
        for length in (9, 0):
            assert decide(intent, None, NOW, length, mark, AFTER) == \
                Action(Kind.RESEND, deadline=NOW + AFTER, reason="overtaken")


# -- one pass: memory store, memory broker --------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = NOW

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def app() -> Iterator[Celery]:
    app = Celery("test_relay", broker="memory://", set_as_current=False)
    yield app
    app.close()


@pytest.fixture
def observed() -> Iterator[list[tuple[Any, ...]]]:
    seen: list[tuple[Any, ...]] = []
    saved = list(events.OBSERVERS)

    def observer(*args: Any, **kwargs: Any) -> None:
        seen.append(args)

    events.OBSERVERS[:] = [observer]
    yield seen
    events.OBSERVERS[:] = saved


def _message(task_id: str, queue: str) -> bytes:
    body = json.dumps([[1], {}, {"callbacks": None, "errbacks": None, "chain": None,
                                 "chord": None}]).encode()
    return encode_envelope(Envelope(
        body=body, content_type="application/json", content_encoding="utf-8",
        headers={"id": task_id, "task": "shop.charge", "lang": "py", "retries": 0},
        properties={"correlation_id": task_id}, exchange="", exchange_type="direct",
        routing_key=queue, queue=queue))


def _intend(store: MemoryStore, key: str, queue: str) -> Intent:
    task_id = uuid.uuid4().hex
    return store.intend(key, task_id, queue, _message(task_id, queue), relay_after=AFTER, ttl=3600)


def _queued(app: Celery, queue: str) -> list[str]:
    """The task ids waiting in ``queue`` (taken off it)."""
    ids = []
    with app.connection_for_read() as conn:
        channel = conn.default_channel
        while (message := channel.basic_get(queue, no_ack=True)) is not None:
            ids.append(message.headers["id"])
    return ids


def test_a_pass_re_sends_a_lost_message_once_with_its_task_id(
        app: Celery, observed: list[tuple[Any, ...]], caplog: pytest.LogCaptureFixture) -> None:
    clock, queue = Clock(), f"q-{uuid.uuid4().hex[:8]}"
    store = MemoryStore(prefix="unit:", clock=clock)
    lost = _intend(store, "op:lost\x1b[31m", queue)
    relay = Relay(app, store, relay_after=AFTER, interval=0.01)
    assert relay.run_once().relayed == 0  # not due yet
    clock.now += AFTER + 1
    with caplog.at_level(logging.WARNING, logger="celery_idem"):
        report = relay.run_once()
    assert (report.relayed, report.waiting, report.closed) == (1, 0, 0)
    assert [(r.key, r.task_id, r.reason) for r in report.resends] == \
        [(lost.key, lost.task_id, "queue_empty")]
    assert _queued(app, queue) == [lost.task_id]
    assert [r.getMessage() for r in caplog.records if r.name == "celery_idem"] == [
        f"celery_idem relayed key=op:lost\\x1b[31m task_id={lost.task_id} reason=queue_empty"]
    assert observed == [("shop.charge", "relayed", lost.key, 0, lost.task_id)]
    # The CAS moved it a relay_after on: the next pass has nothing due, nothing is sent twice.
    assert relay.run_once().relayed == 0 and _queued(app, queue) == []
    (moved,) = store.intents()
    assert (moved.enqueued, moved.sent, moved.deadline) == (lost.enqueued, clock.now, clock.now + AFTER)


def test_a_dry_run_decides_and_changes_nothing(app: Celery) -> None:
    clock, queue = Clock(), f"q-{uuid.uuid4().hex[:8]}"
    store = MemoryStore(prefix="unit:", clock=clock)
    lost = _intend(store, "op:lost", queue)
    done = _intend(store, "op:done", queue)
    token = store.claim(done.key, owner="h:1", task_id=done.task_id, attempt=0, lease=10, ttl=3600)
    store.record(done.key, token.token, state=State.DONE, content_type="application/json",
                 data=b"1", ttl=3600)
    clock.now += AFTER + 1
    report = Relay(app, store, relay_after=AFTER, interval=0.01, dry_run=True).run_once()
    assert (report.relayed, report.closed) == (1, 1)
    assert [r.key for r in report.resends] == [lost.key]
    assert _queued(app, queue) == []
    assert sorted(store.intents(), key=lambda i: i.key) == sorted([done, lost], key=lambda i: i.key)
    assert store.watermarks() == {}


def test_a_claim_seen_anywhere_in_the_batch_tells_which_never_claimed_ones_are_lost(
        app: Celery) -> None:
    clock, queue = Clock(), f"q-{uuid.uuid4().hex[:8]}"
    store = MemoryStore(prefix="unit:", clock=clock)
    older = _intend(store, "op:older", queue)  # due first: its deadline is the earliest
    clock.now += 1
    waiting = _intend(store, "op:waiting", queue)
    clock.now += 1
    newer = _intend(store, "op:newer", queue)
    store.claim(newer.key, owner="h:1", task_id=newer.task_id, attempt=0, lease=600, ttl=3600)
    with app.producer_or_acquire() as producer:  # the queue holds someone else's message
        producer.publish(b"x", routing_key=queue, declare=[app.amqp.queues.new_missing(queue)])
    clock.now += AFTER + 1
    report = Relay(app, store, relay_after=AFTER, interval=0.01).run_once()
    # Sent after both, newer was claimed: older and waiting left the queue and are lost.
    assert (report.relayed, report.postponed, report.waiting) == (2, 1, 0)
    assert {r.key for r in report.resends} == {older.key, waiting.key}
    assert store.watermarks() == {queue: newer.enqueued}


def test_a_never_claimed_message_behind_a_backlog_waits(app: Celery) -> None:
    clock, queue = Clock(), f"q-{uuid.uuid4().hex[:8]}"
    store = MemoryStore(prefix="unit:", clock=clock)
    intent = _intend(store, "op:queued", queue)
    with app.producer_or_acquire() as producer:
        producer.publish(b"x", routing_key=queue, declare=[app.amqp.queues.new_missing(queue)])
    clock.now += AFTER + 1
    report = Relay(app, store, relay_after=AFTER, interval=0.01).run_once()
    assert (report.relayed, report.waiting) == (0, 1)
    assert report.oldest == {queue: clock.now - intent.enqueued}
    (moved,) = store.intents()
    assert moved.deadline == clock.now + AFTER


def test_a_relay_that_loses_the_race_sends_nothing(app: Celery) -> None:
    clock, queue = Clock(), f"q-{uuid.uuid4().hex[:8]}"
    store = MemoryStore(prefix="unit:", clock=clock)
    intent = _intend(store, "op:lost", queue)
    clock.now += AFTER + 1
    due = store.due_intents()
    assert store.reschedule_intent(intent, clock.now + AFTER, resent=True)  # the other relay
    store.due_intents = lambda limit=500: due  # type: ignore[method-assign]  # read before it won
    report = Relay(app, store, relay_after=AFTER, interval=0.01).run_once()
    assert report.relayed == 0 and _queued(app, queue) == []


def test_a_pass_wins_its_re_sends_in_one_store_call_and_sends_only_those_it_won(app: Celery) -> None:
    clock, queue = Clock(), f"q-{uuid.uuid4().hex[:8]}"
    store = MemoryStore(prefix="unit:", clock=clock)
    lost = [_intend(store, f"op:lost-{n}", queue) for n in range(4)]
    clock.now += AFTER + 1
    due = store.due_intents()
    assert store.reschedule_intent(lost[1], clock.now + AFTER, resent=True)  # another relay's
    store.due_intents = lambda limit=500: due  # type: ignore[method-assign]  # read before it won
    batches: list[int] = []
    single = store.reschedule_intents

    def counted(moves: Any, *, resent: bool = False) -> list[bool]:
        batches.append(len(moves))
        return single(moves, resent=resent)

    store.reschedule_intents = counted  # type: ignore[method-assign]
    report = Relay(app, store, relay_after=AFTER, interval=0.01).run_once()
    assert batches == [4]
    assert report.relayed == 3
    assert sorted(_queued(app, queue)) == sorted(i.task_id for n, i in enumerate(lost) if n != 1)
    assert set(report.unclaimed) == {queue}


def test_stale_and_closed_intents_go(app: Celery, caplog: pytest.LogCaptureFixture) -> None:
    clock, queue = Clock(), f"q-{uuid.uuid4().hex[:8]}"
    store = MemoryStore(prefix="unit:", clock=clock)
    task_id = uuid.uuid4().hex
    store.intend("op:stale", task_id, queue, _message(task_id, queue), relay_after=AFTER, ttl=10)
    clock.now += AFTER + 1
    with caplog.at_level(logging.WARNING, logger="celery_idem"):
        report = Relay(app, store, relay_after=AFTER, interval=0.01).run_once()
    assert (report.stale, report.relayed) == (1, 0)
    assert list(store.intents()) == [] and _queued(app, queue) == []
    assert "celery_idem intent stale key=op:stale" in caplog.text


def test_run_forever_passes_until_stopped(app: Celery) -> None:
    clock, queue = Clock(), f"q-{uuid.uuid4().hex[:8]}"
    store = MemoryStore(prefix="unit:", clock=clock)
    reports: list[Any] = []
    stop = threading.Event()
    relay = Relay(app, store, relay_after=AFTER, interval=0.01)
    thread = threading.Thread(target=relay.run_forever, args=(stop, reports.append))
    thread.start()
    lost = _intend(store, "op:lost", queue)
    clock.now += AFTER + 1
    try:
        deadline = threading.Event()
        for _ in range(500):
            if any(r.relayed for r in reports):
                break
            deadline.wait(0.01)
    finally:
        stop.set()
        thread.join(5)
    assert not thread.is_alive()
    assert _queued(app, queue) == [lost.task_id]


# -- worker start (celery_idem.contrib.relay_worker) ----------------------------------------------


def _worker_app(intent: bool, **conf: Any) -> Celery:
    app = Celery(f"relay_worker_{uuid.uuid4().hex[:6]}", broker="memory://", set_as_current=False)
    app.conf.update(idempotency_store="memory://", idempotency_relay_interval=0.01, **conf)

    @app.task(base=IdempotentTask, shared=False, name="w.ship", idempotency_fields=("order",),
              idempotency_intent=intent)
    def ship(order: str) -> str:
        return order

    return app


@pytest.mark.parametrize(("intent", "conf", "wanted"), [
    (True, {}, True),
    (False, {}, False),  # no task keeps intents
    (True, {"idempotency_relay": False}, False),
])
def test_a_worker_wants_a_relay_when_a_task_keeps_intents_unless_turned_off(
        intent: bool, conf: dict[str, Any], wanted: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    # Only this app's own task: shared tasks other test modules defined join every new app.
    monkeypatch.setattr(celery._state, "_on_app_finalizers", set())
    app = _worker_app(intent, **conf)
    assert relay_worker.wants_relay(app) is wanted
    assert (relay_worker.start_relay(app) is not None) is wanted
    relay_worker.stop_relay(app)
    app.close()


def test_a_store_without_intents_gets_no_relay(monkeypatch: pytest.MonkeyPatch) -> None:
    app = _worker_app(True)
    monkeypatch.setattr(MemoryStore, "keeps_intents", False)
    assert not relay_worker.wants_relay(app)
    app.close()


def test_the_worker_relay_runs_in_a_daemon_thread_once_per_app_until_stopped() -> None:
    app = _worker_app(True)
    before = set(threading.enumerate())  # a relay another test stopped may still be finishing
    stop = relay_worker.start_relay(app)
    assert stop is not None and relay_worker.start_relay(app) is stop
    (thread,) = [t for t in threading.enumerate()
                 if t.name == "celery_idem-relay" and t not in before]
    assert thread.daemon
    relay_worker._on_shutdown(sender=type("Worker", (), {"app": app})())
    assert stop.is_set()
    thread.join(5)
    assert not thread.is_alive()
    app.close()


@pytest.mark.parametrize(("pool", "green"), [
    ("prefork", ""), ("threads", ""), ("gevent", "gevent"), ("eventlet", "eventlet"),
    ("celery.concurrency.gevent:TaskPool", "gevent"),
])
def test_the_relay_is_a_greenlet_under_a_green_pool(pool: str, green: str) -> None:
    app = Celery("relay_pool", broker="memory://", set_as_current=False)
    assert relay_worker._green(type("Worker", (), {"pool_cls": pool})(), app) == green
    from celery.concurrency import get_implementation

    if green != "eventlet":  # the class a worker holds once it set up its pool
        cls = get_implementation(pool.rpartition(":")[0].rpartition(".")[2] or pool)
        assert relay_worker._green(type("Worker", (), {"pool_cls": cls})(), app) == green
    app.close()


@pytest.mark.parametrize("state", ["REVOKED", "FAILURE"])
def test_an_intent_whose_task_celery_holds_as_revoked_or_failed_is_closed_not_re_sent(
        state: str) -> None:
    app = Celery("test_relay_ended", broker="memory://", backend="cache+memory://",
                 set_as_current=False)
    clock, queue = Clock(), f"q-{uuid.uuid4().hex[:8]}"
    store = MemoryStore(prefix="unit:", clock=clock)
    ended, lost = _intend(store, "op:ended", queue), _intend(store, "op:lost", queue)
    app.backend.store_result(ended.task_id, None, state)
    clock.now += AFTER + 1
    report = Relay(app, store, relay_after=AFTER, interval=0.01).run_once()
    assert (report.relayed, report.closed) == (1, 1)
    assert _queued(app, queue) == [lost.task_id]
    assert [i.key for i in store.intents()] == ["op:lost"]
    app.close()


def test_a_re_sent_intent_raises_the_watermark_to_its_first_send_only(app: Celery) -> None:
    clock, queue = Clock(), f"q-{uuid.uuid4().hex[:8]}"
    store = MemoryStore(prefix="unit:", clock=clock)
    relay = Relay(app, store, relay_after=AFTER, interval=0.01)

    def done(intent: Intent) -> None:
        claim = store.claim(intent.key, owner="w", task_id=intent.task_id, attempt=0, lease=30,
                            ttl=600)
        store.record(intent.key, claim.token, state=State.DONE, content_type="application/json",
                     data=b"1", ttl=600, claim_id=claim.claim_id)

    # Given a message taken by a worker and not yet claimed, when a later one is claimed and done
    first = _intend(store, "op:first", queue)
    clock.now += 1
    done(_intend(store, "op:later", queue))
    clock.now += 1
    backlog = [_intend(store, f"op:b{n}", queue) for n in range(3)]  # waiting in the queue
    with app.producer_or_acquire() as producer:
        for intent in backlog:
            publish_envelope(app, decode_envelope(intent.message), producer)
    clock.now += AFTER + 1
    report = relay.run_once()
    assert (report.relayed, report.waiting) == (1, 3)  # the first looks overtaken: re-sent
    # When the first message's own copy is claimed and done after all
    done(first)
    clock.now += AFTER + 1
    report = relay.run_once()
    # Then the watermark rises to its first send, not its re-send: the backlog still waits
    assert (report.closed, report.relayed, report.waiting) == (1, 0, 3)
    assert store.watermarks() == {queue: first.enqueued + 1}  # op:later's
    assert sorted(_queued(app, queue)) == sorted([first.task_id, *(b.task_id for b in backlog)])
