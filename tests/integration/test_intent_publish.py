"""An intent written with its message: with the enqueue check within the Redis publish, the
message's intent rides in the same script (no round trip of its own); else it is written first.

Real Redis (broker, backend and store on one server and database), no worker: the queue lists
and the store are read directly.
"""

from __future__ import annotations

from typing import Any

import pytest
import redis
from celery import Celery

from celery_idem import CachedResult, IdempotentTask
from celery_idem.config import accelerate_switch
from celery_idem.contrib.relay import decode_envelope
from celery_idem.intents import IntentTooLarge, kombu_redis_head
from tests.unit.test_enqueue_redis import DB, REDIS_URL, finish, make_app, prefix, queue_length

__all__ = ["prefix"]  # the fixture, shared with tests/unit/test_enqueue_redis.py


def make_task(app: Celery) -> Any:
    @app.task(base=IdempotentTask, shared=False, name="intent.charge",
              idempotency_fields=("order",), idempotency_intent=True)
    def charge(order: str, cents: int) -> dict[str, Any]:
        return {"order": order, "cents": cents}

    return charge


class Intends:
    """Counts the store's own ``intend`` round trips."""

    def __init__(self, store: Any, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[str] = []
        intend = store.intend

        def counted(key: str, *args: Any, **kwargs: Any) -> Any:
            self.calls.append(key)
            return intend(key, *args, **kwargs)

        monkeypatch.setattr(store, "intend", counted)


@pytest.mark.parametrize("accelerate", [True, False])
def test_the_intent_is_written_with_the_message(prefix: str, accelerate: bool,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    app = make_app(prefix, idempotency_accelerate=accelerate, idempotency_relay_after=30)
    charge = make_task(app)
    store = charge.idempotency_gate.store
    intends = Intends(store, monkeypatch)
    result = charge.delay("o1", 100)
    assert queue_length(prefix) == 1
    (intent,) = list(store.intents())
    assert intent.key == result.idempotency_key and intent.task_id == result.id
    assert intent.queue == "q" and intent.deadline == pytest.approx(intent.enqueued + 30, abs=0.01)
    envelope = decode_envelope(intent.message)
    assert envelope.headers["id"] == result.id and envelope.routing_key == "q"
    fused = accelerate and accelerate_switch()
    assert intends.calls == ([] if fused else [result.idempotency_key])
    if fused:  # the script keeps the payload it pushed, after a head naming the queue
        assert intent.message == kombu_redis_head("q", "direct") + pushed(prefix)
    else:
        assert intent.message.startswith(b'{"v":1,')
    app.close()


def pushed(prefix: str, queue: str = "q") -> bytes:
    """The one message in ``queue``, as kombu's Redis transport pushed it."""
    client = redis.Redis.from_url(f"{REDIS_URL}/{DB}")
    try:
        (message,) = client.lrange(prefix + queue, 0, -1)
        return bytes(message)
    finally:
        client.close()


@pytest.mark.parametrize("accelerate", [True, False])
def test_an_oversized_message_is_refused_and_nothing_is_written(prefix: str, accelerate: bool) -> None:
    app = make_app(prefix, idempotency_accelerate=accelerate, idempotency_intent_max_bytes=2048)
    charge = make_task(app)
    with pytest.raises(IntentTooLarge, match=r"over idempotency_intent_max_bytes \(2048\); nothing was sent"):
        charge.delay("o4", "x" * 3000)
    assert queue_length(prefix) == 0
    assert list(charge.idempotency_gate.store.intents()) == []
    # A message under the limit goes, and keeps its intent
    result = charge.delay("o4", 1)
    assert [i.task_id for i in charge.idempotency_gate.store.intents()] == [result.id]
    app.close()


def test_a_done_key_writes_no_intent(prefix: str) -> None:
    app = make_app(prefix)
    charge = make_task(app)
    finish(charge, charge.idempotency_key_for(("o2", 1), {}), {"order": "o2", "cents": 1})
    assert isinstance(charge.delay("o2", 1), CachedResult)
    assert list(charge.idempotency_gate.store.intents()) == []
    assert queue_length(prefix) == 0
    app.close()


def test_an_expiring_queue_still_gets_the_intent(prefix: str) -> None:
    app = make_app(prefix, task_queues=None)
    charge = make_task(app)
    from kombu import Queue

    app.conf.task_queues = [Queue("q", expires=600)]
    result = charge.delay("o3", 1)
    (intent,) = list(charge.idempotency_gate.store.intents())
    assert intent.task_id == result.id
    if accelerate_switch():  # written beside kombu's own push (its own round trip), as kombu pushed it
        assert intent.message == kombu_redis_head("q", "direct") + pushed(prefix)
    assert decode_envelope(intent.message).headers["id"] == result.id
    app.close()
