"""Intents: the message of an ``idempotency_intent`` task, kept in the store until its outcome.

At the publish (:class:`IntentProducer`: after Celery built the message, before kombu sends it)
the message is written with ``Store.intend`` as an :class:`Envelope` (within the Redis publish,
its script keeps kombu's own payload: ``celery_idem.enqueue_redis``); a store that cannot be
reached, or a message over ``idempotency_intent_max_bytes``, fails the enqueue before anything
is sent. A relay (``celery_idem.contrib.relay``, which reads and sends envelopes) re-sends an
envelope whose action has no outcome and no live attempt, and that is not waiting in its queue.
"""

from __future__ import annotations

import datetime as dt
import functools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kombu.entity import Queue
from kombu.serialization import dumps

from .config import settings
from .exceptions import ImproperlyConfigured
from .identity import HEADER

__all__ = ["Envelope", "IntentProducer", "IntentTooLarge", "encode_envelope", "intent_times",
           "kombu_redis_head", "too_large", "write_intent"]

#: The envelope's format version (a relay refuses one it does not know); KOMBU_REDIS: a head
#: line naming the queue and exchange type, then kombu's Redis payload as the publish pushed it.
VERSION, KOMBU_REDIS = 1, 2


class IntentTooLarge(ValueError):
    """The encoded message of an ``idempotency_intent`` task is over ``idempotency_intent_max_bytes``;
    nothing was sent."""


@dataclass(frozen=True)
class Envelope:
    """One message as Celery sent it, enough to send it again unchanged.

    Attributes:
        body: The encoded body, as kombu sent it (``content_type``, ``content_encoding``).
        headers: The message headers (task id, task name, eta, expires, the key ...).
        properties: The message properties (correlation id, reply-to, priority ...).
        exchange: The exchange name ('' for the default exchange), and ``exchange_type``.
        routing_key: The routing key.
        queue: The queue the message went to.
    """

    body: bytes = field(repr=False)
    content_type: str
    content_encoding: str
    headers: Mapping[str, Any]
    properties: Mapping[str, Any]
    exchange: str
    exchange_type: str
    routing_key: str
    queue: str

    @property
    def task_id(self) -> str:
        return str(self.headers.get("id") or self.properties.get("correlation_id") or "")


def _epoch(value: Any) -> float | None:
    if not value:
        return None
    if isinstance(value, (int, float)):
        return float(value)
    when = dt.datetime.fromisoformat(str(value))
    if when.tzinfo is None:  # Celery's naive times are UTC
        when = when.replace(tzinfo=dt.timezone.utc)
    return when.timestamp()


def _json_default(value: Any) -> Any:
    if isinstance(value, (dt.datetime, dt.date, dt.time)):
        return value.isoformat()
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    return str(value)


def encode_envelope(envelope: Envelope) -> bytes:
    """The bytes a store keeps for ``envelope``: its fields as one line of JSON, then the body
    as kombu encoded it (no base64: the body is most of the bytes)."""
    return json.dumps({
        "v": VERSION, "content_type": envelope.content_type,
        "content_encoding": envelope.content_encoding, "headers": dict(envelope.headers),
        "properties": dict(envelope.properties), "exchange": envelope.exchange,
        "exchange_type": envelope.exchange_type, "routing_key": envelope.routing_key,
        "queue": envelope.queue,
    }, default=_json_default, separators=(",", ":")).encode() + b"\n" + envelope.body


@functools.lru_cache(maxsize=256)
def kombu_redis_head(queue: str, exchange_type: str) -> bytes:
    """The line before kombu's Redis payload in an intent: what the payload does not say, the
    queue it was pushed to and its exchange's type (``contrib.relay.decode_envelope``)."""
    return json.dumps({"v": KOMBU_REDIS, "queue": queue, "exchange_type": exchange_type},
                      separators=(",", ":")).encode() + b"\n"


def too_large(task_name: str, size: int, limit: int) -> IntentTooLarge:
    """The error refusing ``task_name``'s message of ``size`` bytes, over ``limit``."""
    return IntentTooLarge(
        f"{task_name}: the message is {size} bytes, over idempotency_intent_max_bytes "
        f"({limit}); nothing was sent. Pass a reference to the data (a row "
        f"id, an object key) instead of the data, or raise the limit")


#: Keywords of kombu's ``Producer.publish`` that are not message properties.
_NOT_PROPERTIES = frozenset({"exchange", "routing_key", "serializer", "compression", "retry",
                             "retry_policy", "declare", "headers", "timeout", "confirm_timeout",
                             "mandatory", "immediate", "content_type", "content_encoding"})


class IntentProducer:
    """A producer that writes the intent of ``task``'s message, then sends it with ``producer``:
    Celery's ``send_task_message`` calls ``publish`` with the message as kombu is about to encode
    it; an error writing the intent propagates out of ``apply_async`` and nothing is sent (a
    ``before_task_publish`` receiver cannot stop a publish: Celery logs its errors)."""

    def __init__(self, producer: Any, task: Any) -> None:
        self._producer, self._task = producer, task

    def __getattr__(self, name: str) -> Any:
        return getattr(self._producer, name)

    def publish(self, body: Any, **kwargs: Any) -> Any:
        headers = kwargs.get("headers") or {}
        if HEADER not in headers:
            return self._producer.publish(body, **kwargs)
        defer = self._task.idempotency_gate.store.deferring()
        # Encoded once, here: the intent keeps these bytes and kombu sends them as they are.
        encoded = dumps(body, serializer=kwargs.pop("serializer", None) or self._task.serializer)  # type: ignore[no-untyped-call]
        kwargs["content_type"], kwargs["content_encoding"], body = encoded
        write_intent(self._task, encoded, kwargs.get("exchange"), kwargs.get("routing_key"),
                     headers, kwargs, kwargs.get("declare"))
        if defer is None:
            return self._producer.publish(body, **kwargs)
        # In the caller's transaction: sent once it commits (a rollback sends nothing; a crash
        # after the commit leaves the committed intent to the relay).
        app = self._task.app
        defer(lambda: _publish_later(app, body, kwargs))
        return None


def _publish_later(app: Any, body: Any, kwargs: Mapping[str, Any]) -> None:
    with app.producer_or_acquire() as producer:
        producer.publish(body, **kwargs)


def write_intent(task: Any, encoded: tuple[str, str, bytes | str], exchange: Any, routing_key: Any,
                 headers: Mapping[str, Any], properties: Mapping[str, Any],
                 declare: Sequence[Any] | None) -> None:
    """Write the message ``task`` is about to send (its body ``encoded`` by kombu's ``dumps``:
    content type, content encoding, data) as its key's intent, an :class:`Envelope` written with
    ``Store.intend``; ``properties``: the keywords of its ``Producer.publish`` (those that are
    not its arguments are the message's properties). (Within the Redis publish the publish's
    script writes it instead, with kombu's own payload: ``celery_idem.enqueue_redis``.)

    Raises:
        ImproperlyConfigured: The task's store keeps no intents.
        IntentTooLarge: The message is over ``idempotency_intent_max_bytes``.
        StoreUnavailable: The store could not be reached.
    """
    store = task.idempotency_gate.store
    if not store.keeps_intents:
        raise ImproperlyConfigured(
            f"{task.name} keeps intents (idempotency_intent=True) but its store, "
            f"{type(store).__name__}, keeps none; nothing was sent")
    name = getattr(exchange, "name", exchange) or ""
    exchange_type = str(getattr(exchange, "type", None) or "direct")
    routing = str(routing_key or "")
    queue = next((str(q.name) for q in declare or () if isinstance(q, Queue) and q.name), routing)
    task_id = str(headers.get("id") or properties.get("correlation_id") or "")
    conf = settings(task.app)
    ttl, eta = intent_times(task, store, headers)
    content_type, encoding, data = encoded
    message = encode_envelope(Envelope(
        body=data if isinstance(data, bytes) else str(data).encode(encoding),
        content_type=content_type, content_encoding=encoding, headers=dict(headers),
        properties={k: v for k, v in properties.items() if k not in _NOT_PROPERTIES and v is not None},
        exchange=str(name), exchange_type=exchange_type,
        routing_key=routing, queue=queue))
    if len(message) > conf.intent_max_bytes:
        raise too_large(task.name, len(message), conf.intent_max_bytes)
    store.intend(str(headers[HEADER]), task_id, queue, message, relay_after=conf.relay_after,
                 ttl=ttl, eta=eta)


def intent_times(task: Any, store: Any, headers: Mapping[str, Any]) -> tuple[float, float | None]:
    """How long the intent of ``task``'s message with ``headers`` is kept (seconds: the task's
    record TTL, or less when the message expires sooner: an expired message is discarded by
    the worker, never re-sent), and its eta (epoch seconds, or None)."""
    ttl = task.idempotency_config.ttl
    expires = _epoch(headers.get("expires"))
    if expires is not None:
        ttl = max(0.001, min(ttl, expires - store.now()))
    return ttl, _epoch(headers.get("eta"))
