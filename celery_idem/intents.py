"""Intents: the message of an ``idempotency_intent`` task, kept in the store until its outcome.

At the publish (:class:`IntentProducer`: after Celery built the message, before kombu sends it)
the message is encoded as an :class:`Envelope` and written with
``Store.intend``; a store that cannot be reached, or a message over ``idempotency_intent_max_bytes``,
fails the enqueue before anything is sent. A relay (``celery_idem.contrib.relay``) re-sends an
envelope whose action has no outcome and no live attempt, and that is not waiting in its queue.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Callable, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from kombu.entity import Exchange, Queue
from kombu.serialization import dumps

from .config import settings
from .exceptions import ImproperlyConfigured
from .identity import HEADER

__all__ = ["FUSED", "Envelope", "IntentProducer", "IntentTooLarge", "decode_envelope", "encode_envelope",
           "publish_envelope", "write_intent"]

#: The envelope's format version (a relay refuses one it does not know).
VERSION = 1


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

    def eta(self) -> float | None:
        """The message's eta (epoch seconds), or None."""
        return _epoch(self.headers.get("eta"))

    def expires(self) -> float | None:
        """The message's ``expires`` (epoch seconds), or None."""
        return _epoch(self.headers.get("expires"))


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


def decode_envelope(data: bytes) -> Envelope:
    """The envelope :func:`encode_envelope` wrote.

    Raises:
        ValueError: ``data`` is not an envelope this version reads.
    """
    head, newline, body = bytes(data).partition(b"\n")  # JSON's text has no raw newline
    try:
        raw = json.loads(head)
        if raw.get("v") != VERSION:
            raise ValueError(f"envelope version {raw.get('v')!r} (this celery_idem reads {VERSION})")
        if not newline:
            raise KeyError("body")
        return Envelope(
            body=body, content_type=raw["content_type"],
            content_encoding=raw["content_encoding"], headers=raw["headers"],
            properties=raw["properties"], exchange=raw["exchange"],
            exchange_type=raw["exchange_type"], routing_key=raw["routing_key"], queue=raw["queue"])
    except (KeyError, TypeError, AttributeError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"not a celery_idem intent envelope: {exc}") from exc


def publish_envelope(app: Any, envelope: Envelope, producer: Any, *, declare: bool = True) -> None:
    """Send ``envelope`` again with ``producer``, declaring its queue (a broker that restarted
    empty, or was flushed, has lost it and its binding: kombu's Redis transport would drop the
    message); ``declare=False`` when the caller declared it on this channel already."""
    queue = app.amqp.queues.get(envelope.queue) if envelope.queue and declare else None
    if queue is None and envelope.queue and declare:
        exchange = Exchange(envelope.exchange, type=envelope.exchange_type)  # type: ignore[no-untyped-call]
        queue = Queue(envelope.queue, exchange=exchange,  # type: ignore[no-untyped-call]
                      routing_key=envelope.routing_key)
    properties = dict(envelope.properties)
    properties.setdefault("delivery_mode", 2)
    producer.publish(
        envelope.body, exchange=envelope.exchange, routing_key=envelope.routing_key,
        headers=dict(envelope.headers), content_type=envelope.content_type,
        content_encoding=envelope.content_encoding, declare=[queue] if queue is not None else [],
        # Bounded as Celery's own publish is: a broker that stays down fails this send.
        retry=True, retry_policy=app.conf.task_publish_retry_policy, **properties)


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
        properties = {k: v for k, v in kwargs.items() if k not in _NOT_PROPERTIES and v is not None}
        # Encoded once, here: the intent keeps these bytes and kombu sends them as they are.
        encoded = dumps(body, serializer=kwargs.pop("serializer", None) or self._task.serializer)  # type: ignore[no-untyped-call]
        kwargs["content_type"], kwargs["content_encoding"], body = encoded
        write_intent(self._task, encoded, kwargs.get("exchange"), kwargs.get("routing_key"),
                     headers, properties, kwargs.get("declare"), fused=defer is None)
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
                 declare: Sequence[Any] | None, *, fused: bool = True) -> None:
    """Write the message ``task`` is about to send (its body ``encoded`` by kombu's ``dumps``:
    content type, content encoding, data) as its key's intent.

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
    content_type, encoding, data = encoded
    name = getattr(exchange, "name", exchange) or ""
    routing = str(routing_key or "")
    queue = next((str(q.name) for q in declare or () if isinstance(q, Queue) and q.name), routing)
    envelope = Envelope(
        body=data if isinstance(data, bytes) else str(data).encode(encoding),
        content_type=content_type, content_encoding=encoding, headers=dict(headers),
        properties=dict(properties), exchange=str(name),
        exchange_type=str(getattr(exchange, "type", None) or "direct"),
        routing_key=routing, queue=queue)
    message = encode_envelope(envelope)
    conf = settings(task.app)
    if len(message) > conf.intent_max_bytes:
        raise IntentTooLarge(
            f"{task.name}: the message is {len(message)} bytes, over idempotency_intent_max_bytes "
            f"({conf.intent_max_bytes}); nothing was sent. Pass a reference to the data (a row "
            f"id, an object key) instead of the data, or raise the limit")
    ttl = task.idempotency_config.ttl
    expires = envelope.expires()
    if expires is not None:  # an expired message is discarded by the worker: never re-sent
        ttl = max(0.001, min(ttl, expires - store.now()))
    key = str(headers[HEADER])
    take = FUSED.get() if fused else None
    if take is not None and take(store, key, envelope.task_id, envelope.queue, message,
                                   conf.relay_after, ttl, envelope.eta()):
        return  # written by the publish's own script
    store.intend(key, envelope.task_id, envelope.queue, message, relay_after=conf.relay_after,
                 ttl=ttl, eta=envelope.eta())


#: Set by a publish that can write the intent in its own round trip (the enqueue check within
#: the Redis publish): ``(store, key, task_id, queue, message, relay_after, ttl, eta) -> bool``,
#: True when it took the intent to write with the message.
FUSED: ContextVar[Callable[..., bool] | None] = ContextVar("celery_idem_fused_intent", default=None)
