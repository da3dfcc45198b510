"""Intents: the message of an ``idempotency_intent`` task, kept in the store until its outcome.

At the publish (Celery's ``before_task_publish``, after Celery built the message and before
kombu sends it) the message is encoded as an :class:`Envelope` and written with
``Store.intend``; a store that cannot be reached, or a message over ``idempotency_intent_max_bytes``,
fails the enqueue before anything is sent. A relay (``celery_idem.contrib.relay``) re-sends an
envelope whose action has no outcome and no live attempt, and that is not waiting in its queue.
"""

from __future__ import annotations

import base64
import datetime as dt
import json
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from celery.signals import before_task_publish
from kombu import Exchange, Queue
from kombu.serialization import dumps

from .config import settings
from .exceptions import ImproperlyConfigured
from .identity import HEADER

__all__ = ["Envelope", "IntentTooLarge", "connect", "decode_envelope", "encode_envelope",
           "publish_envelope", "publishing", "write_intent"]

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
    """The bytes a store keeps for ``envelope`` (JSON; the body in base64)."""
    return json.dumps({
        "v": VERSION, "body": base64.b64encode(envelope.body).decode(),
        "content_type": envelope.content_type, "content_encoding": envelope.content_encoding,
        "headers": dict(envelope.headers), "properties": dict(envelope.properties),
        "exchange": envelope.exchange, "exchange_type": envelope.exchange_type,
        "routing_key": envelope.routing_key, "queue": envelope.queue,
    }, default=_json_default, separators=(",", ":")).encode()


def decode_envelope(data: bytes) -> Envelope:
    """The envelope :func:`encode_envelope` wrote.

    Raises:
        ValueError: ``data`` is not an envelope this version reads.
    """
    try:
        raw = json.loads(data)
        if raw.get("v") != VERSION:
            raise ValueError(f"envelope version {raw.get('v')!r} (this celery_idem reads {VERSION})")
        return Envelope(
            body=base64.b64decode(raw["body"]), content_type=raw["content_type"],
            content_encoding=raw["content_encoding"], headers=raw["headers"],
            properties=raw["properties"], exchange=raw["exchange"],
            exchange_type=raw["exchange_type"], routing_key=raw["routing_key"], queue=raw["queue"])
    except (KeyError, TypeError, AttributeError, json.JSONDecodeError) as exc:
        raise ValueError(f"not a celery_idem intent envelope: {exc}") from exc


def publish_envelope(app: Any, envelope: Envelope, producer: Any) -> None:
    """Send ``envelope`` again with ``producer``, declaring its queue (a broker that restarted
    empty, or was flushed, has lost it and its binding: kombu's Redis transport would drop the
    message)."""
    queue = app.amqp.queues.get(envelope.queue) if envelope.queue else None
    if queue is None and envelope.queue:
        exchange = Exchange(envelope.exchange, type=envelope.exchange_type) if envelope.exchange \
            else Exchange("", type="direct")
        queue = Queue(envelope.queue, exchange=exchange, routing_key=envelope.routing_key)
    properties = dict(envelope.properties)
    properties.setdefault("delivery_mode", 2)
    producer.publish(
        envelope.body, exchange=envelope.exchange, routing_key=envelope.routing_key,
        headers=dict(envelope.headers), content_type=envelope.content_type,
        content_encoding=envelope.content_encoding, declare=[queue] if queue is not None else [],
        retry=True, **properties)


def _queue_name(routing_key: str, declare: Sequence[Any] | None) -> str:
    for entity in declare or ():
        if isinstance(entity, Queue) and entity.name:
            return str(entity.name)
    return routing_key


_publishing = threading.local()


class publishing:
    """Marks the thread's publish as ``task``'s for the hook (connected at the first use): the
    signal names the task, not its app."""

    __slots__ = ("task",)

    def __init__(self, task: Any) -> None:
        self.task = task
        connect()

    def __enter__(self) -> None:
        stack = getattr(_publishing, "stack", None)
        if stack is None:
            stack = _publishing.stack = []
        stack.append(self.task)

    def __exit__(self, *exc: object) -> None:
        _publishing.stack.pop()


def _on_publish(sender: str | None = None, body: Any = None, exchange: Any = None,
                routing_key: Any = None, headers: Mapping[str, Any] | None = None,
                properties: Mapping[str, Any] | None = None, declare: Sequence[Any] | None = None,
                **_: Any) -> None:
    """Write the intent of an ``idempotency_intent`` task's message before kombu sends it."""
    stack = getattr(_publishing, "stack", None)
    if not stack or not headers or HEADER not in headers or stack[-1].name != sender:
        return
    task = stack[-1]
    write_intent(task, body, exchange, routing_key, headers, properties or {}, declare)


def write_intent(task: Any, body: Any, exchange: Any, routing_key: Any, headers: Mapping[str, Any],
                 properties: Mapping[str, Any], declare: Sequence[Any] | None) -> None:
    """Encode the message ``task`` is about to send and write it as its key's intent.

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
    content_type, encoding, data = dumps(body, serializer=task.serializer)  # type: ignore[no-untyped-call]
    name = getattr(exchange, "name", exchange) or ""
    envelope = Envelope(
        body=data if isinstance(data, bytes) else str(data).encode(encoding),
        content_type=content_type, content_encoding=encoding, headers=dict(headers),
        properties=dict(properties), exchange=str(name),
        exchange_type=str(getattr(exchange, "type", None) or "direct"),
        routing_key=str(routing_key or ""), queue=_queue_name(str(routing_key or ""), declare))
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
    store.intend(str(headers[HEADER]), envelope.task_id, envelope.queue, message,
                 relay_after=conf.relay_after, ttl=ttl, eta=envelope.eta())


_connected = threading.Lock()
_done: list[bool] = []


def connect() -> None:
    """Connect the publish hook once per process (at the first enqueue of a task with intents,
    so a process without such tasks pays nothing per publish)."""
    if _done:
        return
    with _connected:
        if not _done:
            before_task_publish.connect(_on_publish, weak=False, dispatch_uid="celery_idem.intents")
            _done.append(True)
