"""The relay: re-sends an intent's message when it is due and lost (``idempotency_intent``).

A task enqueued with ``idempotency_intent=True`` leaves its encoded message in the store until
an attempt records the key's outcome. A relay decides what to do with each intent whose deadline
has passed with :func:`decide` (pure: no store, no broker). A re-send first wins the store's
compare-and-set (:meth:`Store.reschedule_intent` with ``resent=True``), so of several relays
(one per worker) one sends; then it publishes the message as it was first sent, task id
included, and logs ``celery_idem relayed key=... task_id=... reason=...`` at WARNING.

Workers start a relay (:mod:`celery_idem.contrib.relay_worker`); ``celery -A proj idem relay``
runs one outside them.
"""

from __future__ import annotations

import base64
import contextlib
import enum
import json
import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from celery import Celery, states
from kombu import entity
from kombu.exceptions import ChannelError
from kombu.utils.json import loads as kombu_loads

from ..app import events_enabled
from ..config import settings
from ..events import EVENT_TYPE, Outcome, notify_observers
from ..intents import KOMBU_REDIS, VERSION, Envelope
from ..records import Intent, Record, State
from ..stores.base import Store
from .relay_observers import notify_relay_observers

__all__ = ["BATCH", "ENDED", "Action", "Kind", "Relay", "RelayReport", "Resend", "celery_ended", "decide",
           "decode_envelope", "publish_envelope"]

logger = logging.getLogger("celery_idem")

#: Intents read per store round trip; a full batch makes the next pass start at once.
BATCH = 500


class Kind(str, enum.Enum):
    """What the relay does with one due intent (the value is the report's counter)."""

    STALE = "stale"  #: expired: close it, never re-send
    CLOSE = "closed"  #: the key's outcome is recorded: close it
    POSTPONE = "postponed"  #: an attempt holds a live lease: look again after it
    WAIT = "waiting"  #: it may still wait in its queue: look again later
    RESEND = "relayed"  #: lost: re-send it


@dataclass(frozen=True, slots=True)
class Action:
    """The decision for one intent.

    Attributes:
        kind: What to do.
        deadline: The new deadline (store clock) for POSTPONE, WAIT and RESEND.
        watermark: The ``enqueued`` its queue's watermark rises to (the key was seen claimed).
        reason: Why a RESEND: ``queue_empty``, ``overtaken`` (never claimed, and a message sent
            after it on its queue was), ``released`` or ``lease_expired``.
    """

    kind: Kind
    deadline: float | None = None
    watermark: float | None = None
    reason: str = ""


def _claimed(record: Record | None, now: float) -> float | None:
    """The lease end of a live claim (IN_PROGRESS, lease not run out), else None."""
    if record is None or record.state is not State.IN_PROGRESS or record.lease_expires is None:
        return None
    return record.lease_expires if record.lease_expires > now else None


def decide(intent: Intent, record: Record | None, now: float, queue_length: int,
           watermark: float, relay_after: float = 60.0) -> Action:
    """Decide what to do with one due intent (pure: the caller reads and writes).

    1. stale (its record's ttl has passed): close it, never re-send;
    2. the key is done or failed: close it (its queue's watermark rises to its ``enqueued``);
    3. an attempt holds a live lease: look again when the lease ends plus ``relay_after``;
    4. otherwise (never claimed, released, lease expired) re-send it, unless it was never
       claimed and may still wait in its queue: the queue is not empty and no message enqueued
       after its latest send on that queue was seen claimed (``sent`` above the queue's
       watermark). The watermark rises with ``enqueued``, the first send, never a re-send: a
       claim of an intent that was re-sent may be its first copy's, which says nothing of the
       messages queued after it.

    Args:
        intent: The intent, as :meth:`Store.due_intents` returned it.
        record: Its key's record (None: absent or only reserved).
        now: The store's clock.
        queue_length: Messages in the intent's queue (0 for a missing queue; the relay reads
            it only for a fresh, never claimed intent above the watermark).
        watermark: The queue's watermark: the newest ``enqueued`` of an intent seen claimed.
        relay_after: Seconds to the next look after a postponement, a wait or a re-send.
    """
    if intent.expires <= now:
        return Action(Kind.STALE)
    if record is not None and record.state in (State.DONE, State.FAILED):
        return Action(Kind.CLOSE, watermark=intent.enqueued)
    lease_end = _claimed(record, now)
    if lease_end is not None:
        return Action(Kind.POSTPONE, deadline=lease_end + relay_after, watermark=intent.enqueued)
    if record is None:
        if queue_length > 0 and max(intent.sent, intent.enqueued) > watermark:
            return Action(Kind.WAIT, deadline=now + relay_after)
        # Not waiting: overtaken (a later send was claimed), else its queue is empty.
        reason = "overtaken" if max(intent.sent, intent.enqueued) <= watermark else "queue_empty"
    else:
        reason = "released" if record.state is State.RELEASED else "lease_expired"
    return Action(Kind.RESEND, deadline=now + relay_after, reason=reason)


@dataclass(frozen=True, slots=True)
class Resend:
    """One message re-sent (or, in a dry run, that would be)."""

    key: str
    task_id: str
    queue: str
    reason: str


@dataclass(frozen=True)
class RelayReport:
    """What one pass of the relay did.

    Attributes:
        relayed: Messages re-sent (a dry run: that would be).
        waiting: Intents that may still wait in their queue.
        closed: Intents closed: their key's outcome is recorded.
        stale: Intents closed unsent: their record's ttl had passed.
        postponed: Intents an attempt holds a live lease on.
        oldest: Per queue, the age (seconds) of the oldest due intent left open.
        unclaimed: Per queue, the age (seconds) of the oldest due intent no live attempt holds
            (left waiting, or re-sent): the age of a message not yet taken.
        resends: The re-sends themselves.
        full: The batch was full: more may be due.
        dry_run: The pass decided only (a dry run): nothing was sent, closed or moved.
    """

    relayed: int = 0
    waiting: int = 0
    closed: int = 0
    stale: int = 0
    postponed: int = 0
    oldest: Mapping[str, float] = field(default_factory=dict)
    unclaimed: Mapping[str, float] = field(default_factory=dict)
    resends: tuple[Resend, ...] = ()
    full: bool = False
    dry_run: bool = False


class Relay:
    """Re-sends lost intents of one app's store (see the module's docstring).

    Args:
        app: The Celery app (its producer pool publishes).
        store: The app's store; it keeps intents.
        relay_after: Seconds before a re-sent, postponed or waiting intent is looked at again.
        interval: Seconds between passes when idle (:meth:`run_forever`).
        dry_run: Decide only: send, close and move nothing.
        batch: Intents read per pass.
    """

    def __init__(self, app: Celery, store: Store, *, relay_after: float, interval: float = 1.0,
                 dry_run: bool = False, batch: int = BATCH) -> None:
        self.app, self.store = app, store
        self.relay_after, self.interval = float(relay_after), float(interval)
        self.dry_run, self.batch = dry_run, batch

    def run_once(self) -> RelayReport:
        """One pass over the due intents.

        Raises:
            StoreUnavailable: The store could not be reached.
            ImproperlyConfigured: The store keeps no intents.
        """
        store = self.store
        due = store.due_intents(self.batch)
        if not due:
            return self._reported(RelayReport(dry_run=self.dry_run))
        now = store.now()
        marks = dict(store.watermarks())
        # Claims anywhere in the batch show what their queue has delivered: learn them first.
        seen: dict[str, float] = {}
        for intent, record in due:
            if decide(intent, record, now, 0, 0.0).watermark is not None:
                seen[intent.queue] = max(seen.get(intent.queue, 0.0), intent.enqueued)
        raised = {q: m for q, m in seen.items() if m > marks.get(q, 0.0)}
        marks.update(raised)
        if raised and not self.dry_run:
            store.raise_watermarks(raised)
        counts = dict.fromkeys(Kind, 0)
        oldest: dict[str, float] = {}
        unclaimed: dict[str, float] = {}
        resends: list[Resend] = []
        moves: list[tuple[Intent, float]] = []
        lost: list[tuple[Intent, Action]] = []
        with contextlib.closing(_Broker(self.app)) as broker:
            decided = []
            for intent, record in due:
                mark = marks.get(intent.queue, 0.0)
                may_wait = record is None and intent.expires > now \
                    and max(intent.sent, intent.enqueued) > mark
                length = broker.length(intent.queue) if may_wait else 0
                decided.append((intent, decide(intent, record, now, length, mark, self.relay_after)))
            ended = celery_ended(self.app, [i.task_id for i, a in decided if a.kind is Kind.RESEND])
            for intent, action in decided:
                if intent.task_id in ended:  # revoked, or Celery's retries gave up: not lost
                    action = Action(Kind.CLOSE, reason=ended[intent.task_id])
                    logger.info("celery_idem intent closed key=%s task_id=%s: the task ended %s "
                                "in Celery's result backend", intent.key, intent.task_id,
                                action.reason)
                if action.kind is Kind.RESEND:
                    lost.append((intent, action))
                    continue
                counts[action.kind] += 1
                if action.kind in (Kind.STALE, Kind.CLOSE):
                    self._close(intent, action)
                    continue
                moves.append((intent, action.deadline or now))
                _oldest(oldest, intent, now)
                if action.kind is Kind.WAIT:
                    _oldest(unclaimed, intent, now)
            if moves and not self.dry_run:
                store.reschedule_intents(moves)
            for intent, action in self._won(lost):
                if not self._resend(intent, action, broker):
                    continue
                counts[Kind.RESEND] += 1
                resends.append(Resend(intent.key, intent.task_id, intent.queue, action.reason))
                _oldest(oldest, intent, now)
                _oldest(unclaimed, intent, now)
        return self._reported(RelayReport(
            **{kind.value: n for kind, n in counts.items()}, oldest=oldest, unclaimed=unclaimed,
            resends=tuple(resends), full=len(due) >= self.batch, dry_run=self.dry_run))

    def _reported(self, report: RelayReport) -> RelayReport:
        notify_relay_observers(report)
        return report

    def _won(self, lost: list[tuple[Intent, Action]]) -> list[tuple[Intent, Action]]:
        """The lost intents this relay re-sends: those whose compare-and-set it wins (one store
        round trip for the batch where the store pipelines it); all of them in a dry run."""
        if self.dry_run or not lost:
            return lost
        won = self.store.reschedule_intents(
            [(intent, action.deadline or 0.0) for intent, action in lost], resent=True)
        return [pair for pair, ok in zip(lost, won, strict=True) if ok]

    def run_forever(self, stop: threading.Event,
                    on_report: Callable[[RelayReport], None] | None = None) -> None:
        """Pass after pass until ``stop`` is set: at once after a full batch, else at most once
        per ``interval``; each pass's report goes to ``on_report``. An error of one pass is
        logged; the next pass tries again."""
        while not stop.is_set():
            full = False
            try:
                report = self.run_once()
                full = report.full and not self.dry_run  # a dry run moves nothing: same batch
                if on_report is not None:
                    on_report(report)
            except Exception as exc:  # the store or the broker is down: the next pass retries
                logger.warning("celery_idem relay pass failed: %s: %s", type(exc).__name__, exc,
                               exc_info=logger.isEnabledFor(logging.DEBUG))
            if not full:
                stop.wait(self.interval)

    # -- one intent -------------------------------------------------------------------------

    def _close(self, intent: Intent, action: Action) -> None:
        if action.kind is Kind.STALE:
            logger.warning("celery_idem intent stale key=%s task_id=%s queue=%s: its record's ttl "
                           "has passed, it is closed and never re-sent", intent.key, intent.task_id,
                           intent.queue)
        if not self.dry_run:
            self.store.close_intent(intent.key, intent.task_id)

    def _resend(self, intent: Intent, action: Action, broker: _Broker) -> bool:
        """Publish a lost intent whose compare-and-set this relay won; False if unreadable."""
        if not self.dry_run:
            try:
                task_name = broker.publish(intent)
            except ValueError as exc:  # not an envelope this version reads: a later one may
                logger.error("celery_idem intent unreadable key=%s task_id=%s: %s", intent.key,
                             intent.task_id, exc)
                return False
            logger.warning("celery_idem relayed key=%s task_id=%s reason=%s", intent.key,
                           intent.task_id, action.reason)
            self._notify(intent, action.reason, task_name)
        return True

    def _notify(self, intent: Intent, reason: str, task_name: str) -> None:
        notify_observers(task_name, Outcome.RELAYED, intent.key, 0, intent.task_id, task_span=False)
        app = self.app
        if not (settings(app).events or events_enabled(app)):
            return
        try:
            with app.events.default_dispatcher() as dispatcher:
                dispatcher.send(EVENT_TYPE, uuid=intent.task_id, name=task_name,
                                idempotency_key=intent.key, outcome=Outcome.RELAYED.value,
                                original_task_id=intent.task_id, token=0, reason=reason,
                                at="relay")
        except Exception as exc:  # monitoring must never change what the relay did
            logger.debug("celery_idem event not sent key=%s: %s", intent.key, exc)


def _oldest(ages: dict[str, float], intent: Intent, now: float) -> None:
    ages[intent.queue] = max(ages.get(intent.queue, 0.0), now - intent.enqueued)


#: Celery's final states that end an action without an outcome: not lost, never re-sent.
ENDED = frozenset({states.REVOKED, states.FAILURE})


def celery_ended(app: Celery, task_ids: list[str]) -> dict[str, str]:
    """The task ids among ``task_ids`` whose result Celery's backend holds as revoked or failed
    (one ``MGET`` on a key-value backend); unknown, or no backend: none."""
    if not task_ids:
        return {}
    backend = app.backend
    try:
        if hasattr(backend, "mget") and hasattr(backend, "get_key_for_task"):
            keys = [backend.get_key_for_task(t) for t in task_ids]
            values = backend.mget(keys)
            if isinstance(values, Mapping):  # the cache backend's get_multi
                values = [values.get(k) for k in keys]
            metas = [backend.decode_result(v) if v else None for v in values]
        else:
            metas = [backend.get_task_meta(t) for t in task_ids]
    except Exception as exc:  # no backend, or it is down: re-send (the gate answers a done one)
        logger.debug("celery_idem relay could not read task states: %s", exc)
        return {}
    return {t: str(m["status"]) for t, m in zip(task_ids, metas, strict=True)
            if m and m.get("status") in ENDED}


class _Broker:
    """One pass's broker side: queue lengths (read once per queue) and publishes (each queue
    declared at its first publish: after a broker flush kombu's Redis transport has lost its
    bindings, and a declaration cached by kombu would not be made again)."""

    def __init__(self, app: Celery) -> None:
        self.app = app
        self.lengths: dict[str, int] = {}
        self.declared: set[str] = set()
        self._producer: Any = None
        self._channel: Any = None
        self.held = contextlib.ExitStack()

    @property
    def producer(self) -> Any:
        if self._producer is None:
            self._producer = self.held.enter_context(self.app.producer_pool.acquire(block=True))
        return self._producer

    def length(self, queue: str) -> int:
        """Messages in ``queue``, read once per pass (a missing queue has none)."""
        if queue in self.lengths:
            return self.lengths[queue]
        conn = self.producer.connection
        self._channel = self._channel or conn.channel()
        try:
            found = int(self._channel.queue_declare(queue=queue, passive=True).message_count)
        except (ChannelError, *conn.channel_errors) as exc:
            # A missing queue: RabbitMQ answers 404 and closes the channel; take a fresh one.
            with contextlib.suppress(Exception):
                self._channel.close()
            self._channel, found = None, 0
            if str(getattr(exc, "reply_code", None) or 404) != "404":  # kombu's virtual: "404"
                raise
        self.lengths[queue] = found
        return found

    def publish(self, intent: Intent) -> str:
        """Send ``intent``'s message as it was first sent; its task's name."""
        envelope = decode_envelope(intent.message)
        producer = self.producer
        if intent.queue not in self.declared:
            self._queue(intent, envelope)(producer.channel).declare()
            self.declared.add(intent.queue)
        # Declared above, once per pass: kombu's per-publish declaration would cost a check each.
        publish_envelope(self.app, envelope, producer, declare=False)
        return str(envelope.headers.get("task", ""))

    def _queue(self, intent: Intent, envelope: Envelope) -> Any:
        """The app's own queue of that name (its exchange and bindings), else one bound to the
        envelope's exchange (the default exchange: none) and routing key."""
        known = self.app.amqp.queues.get(intent.queue)
        exchange = entity.Exchange(envelope.exchange, type=envelope.exchange_type or "direct")  # type: ignore[no-untyped-call]
        return known or entity.Queue(intent.queue, exchange,  # type: ignore[no-untyped-call]
                                     routing_key=envelope.routing_key or intent.queue)

    def close(self) -> None:
        if self._channel is not None:
            with contextlib.suppress(Exception):
                self._channel.close()
        self.held.close()


# -- reading an intent's message, and sending it again ------------------------------------------

#: kombu's Redis payload's properties that the transport adds (a re-send gets its own).
_TRANSPORT_PROPERTIES = frozenset({"delivery_tag", "delivery_info", "body_encoding"})


def decode_envelope(data: bytes) -> Envelope:
    """The envelope ``intents.encode_envelope`` wrote, or an intent written within the Redis
    publish (``intents.kombu_redis_head``, then the message as kombu's Redis transport pushed it).

    Raises:
        ValueError: ``data`` is not an envelope this version reads.
    """
    head, newline, body = bytes(data).partition(b"\n")  # JSON's text has no raw newline
    try:
        raw = json.loads(head)
        if raw.get("v") == KOMBU_REDIS:
            return _from_kombu_redis(raw, body)
        if raw.get("v") != VERSION:
            raise ValueError(f"envelope version {raw.get('v')!r} (this celery_idem reads "
                             f"{VERSION} and {KOMBU_REDIS})")
        if not newline:
            raise KeyError("body")
        return Envelope(
            body=body, content_type=raw["content_type"],
            content_encoding=raw["content_encoding"], headers=raw["headers"],
            properties=raw["properties"], exchange=raw["exchange"],
            exchange_type=raw["exchange_type"], routing_key=raw["routing_key"], queue=raw["queue"])
    except (KeyError, TypeError, AttributeError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"not a celery_idem intent envelope: {exc}") from exc


def _from_kombu_redis(head: Mapping[str, Any], data: bytes) -> Envelope:
    """The envelope of kombu's Redis payload ``data`` (``Channel._put``'s message: body,
    content type and encoding, headers, properties with ``delivery_info``)."""
    # As the transport reads it (kombu's JSON, its types: datetimes, UUIDs ...).
    message = kombu_loads(data)  # type: ignore[no-untyped-call]
    properties = dict(message["properties"])
    info = properties.get("delivery_info") or {}
    body = message.get("body") or ""
    encoding = properties.get("body_encoding")
    if encoding and str(encoding).lower() != "utf-8":
        if str(encoding).lower() != "base64":  # the only codec kombu's virtual transports have
            raise ValueError(f"body encoding {encoding!r}")
        body = base64.b64decode(body)
    elif isinstance(body, str):
        body = body.encode()
    kept = {k: v for k, v in properties.items() if k not in _TRANSPORT_PROPERTIES}
    if kept.get("expiration") is not None:  # kombu's ms string; publish takes seconds
        kept["expiration"] = int(kept["expiration"]) / 1000
    return Envelope(
        body=body, content_type=message["content-type"],
        content_encoding=message["content-encoding"], headers=message.get("headers") or {},
        properties=kept, exchange=str(info.get("exchange") or ""),
        exchange_type=str(head.get("exchange_type") or "direct"),
        routing_key=str(info.get("routing_key") or ""), queue=str(head["queue"]))


def publish_envelope(app: Any, envelope: Envelope, producer: Any, *, declare: bool = True) -> None:
    """Send ``envelope`` again with ``producer``, declaring its queue (a broker that restarted
    empty, or was flushed, has lost it and its binding: kombu's Redis transport would drop the
    message); ``declare=False`` when the caller declared it on this channel already."""
    queue = app.amqp.queues.get(envelope.queue) if envelope.queue and declare else None
    if queue is None and envelope.queue and declare:
        exchange = entity.Exchange(envelope.exchange, type=envelope.exchange_type)  # type: ignore[no-untyped-call]
        queue = entity.Queue(envelope.queue, exchange=exchange,  # type: ignore[no-untyped-call]
                      routing_key=envelope.routing_key)
    properties = dict(envelope.properties)
    properties.setdefault("delivery_mode", 2)
    producer.publish(
        envelope.body, exchange=envelope.exchange, routing_key=envelope.routing_key,
        headers=dict(envelope.headers), content_type=envelope.content_type,
        content_encoding=envelope.content_encoding, declare=[queue] if queue is not None else [],
        # Bounded as Celery's own publish is: a broker that stays down fails this send.
        retry=True, retry_policy=app.conf.task_publish_retry_policy, **properties)
