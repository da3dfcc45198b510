"""celery_idem.intents: the producer writes an intent task's message as Celery sent it, and the
envelope sends it again unchanged (kombu's in-process ``memory://`` broker, ``memory://`` store).

The real broker and worker counterparts are in tests/integration/test_intents.py.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
from celery import Celery
from kombu import Connection
from kombu.utils.json import dumps as kombu_dumps

from celery_idem import IdempotentTask
from celery_idem.contrib.relay import decode_envelope, publish_envelope
from celery_idem.exceptions import ImproperlyConfigured, StoreUnavailable
from celery_idem.intents import IntentTooLarge, encode_envelope, kombu_redis_head
from celery_idem.stores.memory import MemoryStore


@pytest.fixture
def app() -> Celery:
    app = Celery(f"test_intents_{uuid.uuid4().hex[:6]}", set_as_current=False,
                 broker=f"memory://intents-{uuid.uuid4().hex}")
    app.conf.idempotency_store = "memory://"
    app.conf.idempotency_relay_after = 30
    app.conf.idempotency_intent_max_bytes = 4096
    app.conf.task_default_queue = f"q-{uuid.uuid4().hex[:8]}"
    return app


def make(app: Celery, intent: bool = True) -> Any:
    @app.task(base=IdempotentTask, shared=False, idempotency_intent=intent)
    def charge(order_id: str, amount: int) -> str:
        return order_id

    return charge


def drain(app: Celery, queue: str) -> list[Any]:
    """Every message waiting in ``queue`` (as kombu delivers it)."""
    got: list[Any] = []
    with Connection(app.conf.broker_url) as conn:
        simple = conn.SimpleQueue(queue, no_ack=True)
        while True:
            try:
                got.append(simple.get(block=False))
            except simple.Empty:
                break
        simple.close()
    return got


def test_the_message_is_kept_as_sent_and_sent_again_unchanged(app: Celery) -> None:
    charge = make(app)
    result = charge.apply_async(("o-1", 4200), priority=3)
    store = charge.idempotency_gate.store
    (intent,) = list(store.intents())
    assert intent.task_id == result.id and intent.key == result.idempotency_key
    assert intent.queue == app.conf.task_default_queue
    assert intent.deadline == pytest.approx(intent.enqueued + 30)
    env = decode_envelope(intent.message)
    assert decode_envelope(encode_envelope(env)) == env
    (sent,) = drain(app, intent.queue)

    with app.producer_or_acquire() as producer:
        publish_envelope(app, env, producer)
    (again,) = drain(app, intent.queue)
    assert again.body == sent.body and again.content_type == sent.content_type
    assert again.headers["id"] == result.id and again.headers["task"] == charge.name
    assert again.headers["idempotency_key"] == result.idempotency_key
    assert again.properties.get("priority") == 3 == sent.properties.get("priority")
    assert again.decode() == [["o-1", 4200], {}, {"callbacks": None, "errbacks": None,
                                                  "chain": None, "chord": None}]


def test_a_countdown_moves_the_deadline_and_expires_bounds_the_intent(app: Celery) -> None:
    charge = make(app)
    store = charge.idempotency_gate.store
    charge.apply_async(("o-2", 1), countdown=600, expires=900)
    (intent,) = list(store.intents())
    assert intent.deadline == pytest.approx(intent.enqueued + 600 + 30, abs=1)
    assert intent.expires == pytest.approx(intent.enqueued + 900, abs=1)


def test_a_task_without_intents_writes_none(app: Celery) -> None:
    plain = make(app, intent=False)
    plain.delay("o-3", 1)
    assert list(plain.idempotency_gate.store.intents()) == []


def test_an_oversized_message_is_refused_and_nothing_is_sent(app: Celery) -> None:
    charge = make(app)
    with pytest.raises(IntentTooLarge, match=r"over idempotency_intent_max_bytes \(4096\); nothing was sent"):
        charge.delay("x" * 5000, 1)
    assert drain(app, app.conf.task_default_queue) == []
    assert list(charge.idempotency_gate.store.intents()) == []


class NoIntents(MemoryStore):
    keeps_intents = False


class Down(MemoryStore):
    def intend(self, *args: Any, **kwargs: Any) -> Any:
        raise StoreUnavailable("the store is down")


@pytest.mark.parametrize(("store", "error"), [(NoIntents, ImproperlyConfigured),
                                               (Down, StoreUnavailable)])
def test_no_intent_no_message(app: Celery, store: type[MemoryStore], error: type[Exception]) -> None:
    charge = make(app)
    charge.idempotency_gate.store = store()
    with pytest.raises(error):
        charge.delay("o-4", 1)
    assert drain(app, app.conf.task_default_queue) == []


def test_a_retry_replaces_the_intent_with_its_own_message(app: Celery) -> None:
    charge = make(app)
    first = charge.delay("o-5", 1)
    store = charge.idempotency_gate.store
    (before,) = list(store.intents())
    charge.apply_async(("o-5", 1), task_id=first.id, retries=1, countdown=60,
                       headers={"idempotency_key": first.idempotency_key})
    (after,) = list(store.intents())
    assert after.task_id == first.id and after.deadline > before.deadline + 59


def test_an_envelope_that_is_not_one_is_refused() -> None:
    with pytest.raises(ValueError, match="not a celery_idem intent envelope"):
        decode_envelope(b"not json")
    with pytest.raises(ValueError, match="envelope version 9"):
        decode_envelope(b'{"v": 9}')


class InTransaction(MemoryStore):
    """A store whose writes join a caller's open transaction: callbacks wait for the commit."""

    def __init__(self) -> None:
        super().__init__()
        self.on_commit: list[Any] = []

    def deferring(self) -> Any:
        return self.on_commit.append


def test_in_a_transaction_the_intent_is_written_and_the_message_waits_for_the_commit(
        app: Celery) -> None:
    charge = make(app)
    store = charge.idempotency_gate.store = InTransaction()
    result = charge.delay("o-6", 1)
    (intent,) = list(store.intents())
    assert intent.task_id == result.id
    assert drain(app, app.conf.task_default_queue) == []  # not before the commit
    (commit,) = store.on_commit
    commit()
    (sent,) = drain(app, app.conf.task_default_queue)
    assert sent.headers["id"] == result.id


def _pushed(app: Celery, monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, dict[str, Any]]]:
    """The messages kombu's virtual channel puts on its queues (the payload kombu's Redis
    transport pushes: ``memory://`` builds it the same way), as they are put."""
    from kombu.transport import memory

    put = memory.Channel._put
    seen: list[tuple[str, dict[str, Any]]] = []

    def spy(self: Any, queue: str, message: dict[str, Any], **kwargs: Any) -> Any:
        seen.append((queue, json.loads(kombu_dumps(message))))
        return put(self, queue, message, **kwargs)

    monkeypatch.setattr(memory.Channel, "_put", spy)
    return seen


def test_kombus_redis_payload_reads_as_the_envelope_of_the_same_message(
        app: Celery, monkeypatch: pytest.MonkeyPatch) -> None:
    # Given one message kept as an envelope (the intent's own write) and as kombu pushed it
    charge = make(app)
    pushed = _pushed(app, monkeypatch)
    result = charge.apply_async(("o-7", 700), priority=5, expires=600, headers={"tenant": "t1"})
    (intent,) = list(charge.idempotency_gate.store.intents())
    ((queue, message),) = pushed
    kept = kombu_redis_head(queue, "direct") + kombu_dumps(message).encode()
    # When both are read
    envelope, from_payload = decode_envelope(intent.message), decode_envelope(kept)
    # Then they are the same message: body, headers, properties, exchange, routing key, queue
    assert from_payload.body == envelope.body
    assert from_payload.headers == envelope.headers and from_payload.headers["id"] == result.id
    assert from_payload.headers["tenant"] == "t1"
    assert (from_payload.exchange, from_payload.exchange_type, from_payload.routing_key,
            from_payload.queue) == (envelope.exchange, envelope.exchange_type,
                                    envelope.routing_key, envelope.queue)
    assert (from_payload.content_type, from_payload.content_encoding) == (
        envelope.content_type, envelope.content_encoding)
    assert from_payload.properties == envelope.properties
    assert from_payload.properties["priority"] == 5
    assert from_payload.properties["expiration"] == pytest.approx(600, abs=1)  # seconds again
    assert not {"delivery_tag", "delivery_info", "body_encoding"} & from_payload.properties.keys()
    # And sent again, it is the message first sent, under a new delivery tag
    drain(app, queue)
    with app.producer_or_acquire() as producer:
        publish_envelope(app, from_payload, producer)
    ((_, again),) = pushed[1:]
    first = dict(message, properties=dict(message["properties"]))
    tag = first["properties"].pop("delivery_tag")
    assert again["properties"].pop("delivery_tag") != tag
    again["properties"]["expiration"] = first["properties"]["expiration"]  # re-rounded to ms
    assert again == first
    (sent,) = drain(app, queue)
    assert sent.decode() == [["o-7", 700], {}, {"callbacks": None, "errbacks": None,
                                                "chain": None, "chord": None}]


@pytest.mark.parametrize(("encoding", "body"), [
    ("base64", "WzFdCg=="), (None, "[1]\n"), ("utf-8", "[1]\n")])
def test_a_payloads_body_is_read_in_its_transport_encoding(encoding: str | None, body: str) -> None:
    payload = {"body": body, "content-encoding": "utf-8", "content-type": "application/json",
               "headers": {"id": "t"}, "properties": {
                   "body_encoding": encoding, "delivery_tag": "d", "priority": 0,
                   "delivery_info": {"exchange": "ex", "routing_key": "rk"}}}
    env = decode_envelope(kombu_redis_head("q", "topic") + kombu_dumps(payload).encode())
    assert env.body == b"[1]\n"
    assert (env.exchange, env.exchange_type, env.routing_key, env.queue) == ("ex", "topic", "rk", "q")
    assert env.properties == {"priority": 0} and env.task_id == "t"


def test_a_payload_in_an_unknown_body_encoding_is_refused() -> None:
    payload = {"body": "x", "content-encoding": "utf-8", "content-type": "application/json",
               "headers": {}, "properties": {"body_encoding": "rot13", "delivery_info": {}}}
    with pytest.raises(ValueError, match="body encoding 'rot13'"):
        decode_envelope(kombu_redis_head("q", "direct") + kombu_dumps(payload).encode())
    with pytest.raises(ValueError, match="not a celery_idem intent envelope"):
        decode_envelope(kombu_redis_head("q", "direct") + b"{}")
