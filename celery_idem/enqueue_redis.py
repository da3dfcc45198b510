"""The enqueue check within the Redis publish, and the memory of this process's own messages.

The fast twin of :class:`celery_idem.enqueue.ReadFirst` (two round trips). When the broker is
kombu's Redis transport on the server of a plain :class:`~celery_idem.stores.redis.RedisStore`
(its database or another: the script selects each key's), a script (``lua/publish.lua``) pushes
the message only when the record is not done or failed (reserving the key for an enqueue that
may attach), else hands back what it found: one atomic round trip, sent on a wire on the
broker's pool (docs/benchmarks.md, "Each fast path alone").

The hook is ``_put`` on the channel *instance*, never on kombu's class, and acts only on the
message whose ``idempotency_key`` header is the key enqueued in this context (its
:class:`_Pending`). A publish of several commands (a batch, a queue with ``x-expires``) reads
the record first. An answered enqueue has paid for its message already, so the check rides on
the publish only while few enqueues are answered (:attr:`WithinPublish.THRESHOLD`).
:meth:`WithinPublish.mine` lets a copy enqueued while this process's own message is in flight
attach with no round trip (docs/benchmarks.md, "In-flight copies").
"""

from __future__ import annotations

import hashlib
import logging
import time
import weakref
from contextvars import ContextVar
from dataclasses import dataclass
from importlib import resources
from types import MethodType
from typing import TYPE_CHECKING, Any
from uuid import uuid4 as uuid

import redis
from celery.signals import after_task_publish, before_task_publish
from kombu.exceptions import EncodeError
from kombu.utils.json import dumps

from .attach import add_to_parent
from .config import settings
from .enqueue import Answer, Decision, EnqueueRequest, Publish, ReadFirst
from .exceptions import StoreUnavailable
from .identity import HEADER
from .intents import intent_times, kombu_redis_head, too_large
from .records import Record, Reservation, State
from .stores.redis import RESERVED, RedisStore, same_server
from .stores.redis_intents import INTENT, INTENT_LUA, intent_spec
from .stores.redis_wire import pack, wire_on

try:  # the join guard Celery's own result handles use (celery/result.py)
    from celery._state import task_join_will_block
except ImportError:  # pragma: no cover - a Celery without it: the record is read first
    task_join_will_block = None  # type: ignore[assignment, unused-ignore]

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from collections.abc import Callable

    from celery.result import AsyncResult

__all__ = ["WithinPublish", "fuse"]

_LUA = INTENT_LUA + resources.files("celery_idem.stores").joinpath("lua", "publish.lua").read_text("utf-8")
_SHA = hashlib.sha1(_LUA.encode()).hexdigest()
_CHECK = b"check"
#: On a channel: whether it takes the hook, per store checked against it; its pool and wire.
_ATTR, _WIRE = "_celery_idem_stores", "_celery_idem_wire"

#: The Celery backends whose ``on_task_call`` leaves nothing to undo (by name: no import).
_NOTHING_TO_UNDO = ("celery.backends.base", "celery.backends.rpc")


@dataclass
class _Pending:
    """The enqueue whose message the hooked ``_put`` checks; ``found`` is what stopped it;
    ``reserve``, when it may attach: (task id, fingerprint or "", reservation lease in ms);
    ``intent``: the task, when the script writes its intent with the message (``conf``, its
    app's settings; ``taken`` once the hook built it); ``mode``: the script's argument saying
    whether it attaches, without and with the databases to select (``fuse``)."""

    store: RedisStore
    key: str
    mode: tuple[str, str]
    reserve: tuple[str, str, int] | None = None
    found: Record | Reservation | None = None
    intent: Any = None
    conf: Any = None
    taken: bool = False

    def intent_of(self, channel: Any, queue: str,
                  message: dict[str, Any]) -> tuple[bytes, bytes, float, float | None]:
        """kombu's payload of ``message`` for ``queue``, and what the intent keeps before it
        (``intents.kombu_redis_head``), its TTL and eta (``intents.intent_times``).

        Raises:
            IntentTooLarge: With the head, over ``idempotency_intent_max_bytes``.
        """
        task, self.taken = self.intent, True
        payload: bytes = dumps(message).encode()  # type: ignore[no-untyped-call]
        info = message["properties"].get("delivery_info") or {}
        head = kombu_redis_head(queue, channel.typeof(info.get("exchange") or "").type)
        limit = self.conf.intent_max_bytes
        if len(head) + len(payload) > limit:
            raise too_large(task.name, len(head) + len(payload), limit)
        return payload, head, *intent_times(task, self.store, message["headers"])

    def intent_spec(self, queue: str, message: dict[str, Any], head: bytes, ttl: float,
                    eta: float | None) -> bytes:
        """The script's argument that writes the intent (``redis_intents.intent_spec``)."""
        return intent_spec(str(message["headers"].get("id") or ""), queue, head,
                           round(self.conf.relay_after * 1000),
                           max(1, round(ttl * 1000)), round(eta * 1000) if eta else 0)

    def write_intent(self, channel: Any, queue: str, message: dict[str, Any]) -> None:
        """Write the intent with its own round trip (kombu pushes the message itself)."""
        if self.intent is not None:
            payload, head, ttl, eta = self.intent_of(channel, queue, message)
            self.store.intend(self.key, str(message["headers"].get("id") or ""), queue,
                              head + payload, relay_after=self.conf.relay_after,
                              ttl=ttl, eta=eta)


_PENDING: ContextVar[_Pending | None] = ContextVar("celery_idem_pending_publish", default=None)


class WithinPublish(ReadFirst):
    """The enqueue check within the Redis publish, where it pays; else read first."""

    #: The weight of each enqueue in the running share of enqueues answered from the record; at
    #: or above THRESHOLD the record is read first (an answered enqueue costs about five times
    #: more within the publish than a read first costs every enqueue).
    WEIGHT = 1 / 16
    THRESHOLD = 0.2
    #: Seconds this process's own message answers a copy of its key without asking the store
    #: (short, so an operator's ``forget`` or a store's data loss is not hidden); at most
    #: MAX_RECENT keys (a larger burst starts the memory over).
    RECENT = 1.0
    MAX_RECENT = 4096

    def __init__(self) -> None:
        self.answered = 0.0
        self.possible = True  # False once the broker turned out not to take the hook
        self._backend: Any = None
        self._undo: Callable[[str], None] | None = None
        self._mine: dict[str, tuple[Reservation, weakref.ref[AsyncResult], float]] = {}

    def decide(self, req: EnqueueRequest) -> Decision:
        """Answer a copy of this process's own message, or publish with the check within, or read first."""
        attaching = self.attaching(req)
        if attaching and req.gate.store.reserves:
            found = self.mine(req.key)
            if found is not None:
                answer = self.answer(req, found, attaching)
                return Answer(answer) if answer is not None else Publish(req.task_id)
        if self.within_publish(req, attaching):
            decision = self.publish(req, attaching)
            if decision is not None:
                return decision
        decision = super().decide(req)
        self.saw(isinstance(decision, Answer))
        return decision

    def published(self, req: EnqueueRequest, decision: Publish, result: AsyncResult) -> None:
        """Remember a message published under this process's reservation of its key."""
        if decision.reserved:
            self.remember(req.key, result, req.fingerprint(), req.task.idempotency_config.lease)

    def remember(self, key: str, result: AsyncResult, fingerprint: str | None, lease: float) -> None:
        """Note that this process published ``result`` under its reservation of ``key``."""
        mine = self._mine
        if len(mine) >= self.MAX_RECENT:
            mine.clear()  # each entry lives a moment: a burst this large only starts over
        mine[key] = (Reservation(result.id, fingerprint or None), weakref.ref(result),
                     time.monotonic() + min(self.RECENT, lease))

    def mine(self, key: str) -> Reservation | None:
        """The reservation of ``key`` for this process's own message in flight (published less
        than :attr:`RECENT` ago, its result held by the caller and not seen finished), or None."""
        if (found := self._mine.get(key)) is None:
            return None
        reservation, ref, deadline = found
        result = ref()
        # AsyncResult._cache: its outcome, once this process has read it (no round trip).
        if result is None or getattr(result, "_cache", None) or deadline <= time.monotonic():
            self._mine.pop(key, None)
            return None
        return reservation

    def saw(self, answered: bool) -> None:
        """Count one checked enqueue (answered from the record, or published)."""
        self.answered += ((1.0 if answered else 0.0) - self.answered) * self.WEIGHT

    def within_publish(self, req: EnqueueRequest, attaching: bool) -> bool:
        """Whether this enqueue tries the check within the publish: not eager, not with publish
        signal receivers or sent events (they would hear of an unsent message), not with a
        backend whose ``on_task_call`` cannot be undone. ``attaching``: it may attach (so it
        is not eager)."""
        if not self.possible or self.answered >= self.THRESHOLD:
            return False
        if type(req.gate.store) is not RedisStore:
            self.possible = False
            return False
        app = req.task.app
        conf = app.conf
        # Each setting read costs a few µs of an enqueue: eager is known already when attaching.
        if (not attaching and conf.task_always_eager) or conf.task_send_sent_event \
                or before_task_publish.receivers or after_task_publish.receivers:
            return False
        return self._undo_for(app.backend) is not None

    def _undo_for(self, backend: Any) -> Callable[[str], None] | None:
        if backend is not self._backend:  # the app's backend is built once (thread-local)
            self._backend, self._undo = backend, _undo_for(backend)
        return self._undo

    def publish(self, req: EnqueueRequest, attaching: bool) -> Decision | None:
        """Publish with the check within; None when the broker cannot take it or the message
        cannot be encoded (nothing was sent: read first)."""
        store: Any = req.gate.store
        task = req.task
        reserving = attaching and store.reserves
        with task.app.producer_or_acquire(req.producer) as prod:
            mode = fuse(prod.channel, store)
            if mode is None:
                self.possible = False
                return None
            sent_id = req.task_id or str(uuid())
            lease = max(int(task.idempotency_config.lease * 1000), 1)
            pending = _Pending(store, req.key, mode, (sent_id, req.fingerprint() or "", lease)
                               if reserving else None)
            intent = task.idempotency_config.intent
            if intent:  # the script writes it with the message (keeps_intents: a plain RedisStore)
                pending.intent, pending.conf = task, settings(task.app)
            token = _PENDING.set(pending)
            try:
                # Celery lists the result among a running task's children only once sent.
                result = req.publish(prod, sent_id, add_to_parent=False, intent_within=intent)
            except EncodeError:
                pending.found = None
                result = None
            finally:
                _PENDING.reset(token)
        if result is None or pending.found is not None:
            # Not sent: the result subscription Celery made for it is not wanted.
            undo = self._undo_for(task.app.backend)
            if undo is not None:
                undo(sent_id)
            if result is None:
                return None  # the caller reads first; a done key is still answered
            self.saw(True)
            answer = self.answer(req, pending.found, attaching)
            return Answer(answer) if answer is not None else Publish(req.task_id)
        self.saw(False)
        if pending.intent is not None and not pending.taken:
            # Sent without kombu's queue push (a fanout exchange): no intent was written.
            logger.warning("celery_idem: %s's message went out without passing kombu's Redis "
                           "queue push (a fanout exchange?): no intent was kept for key=%s; a "
                           "broker that loses it loses the action", task.name, req.key)
        add_to_parent(task, result, req.options)
        if reserving:
            self.published(req, Publish(sent_id, True), result)
        return Answer(result)


def fuse(channel: Any, store: Any) -> tuple[str, str] | None:
    """Hook ``channel`` so the enqueue check rides on the publish; None if it cannot (not
    kombu's Redis channel on the server of ``store``, a plain :class:`RedisStore` without replica
    wait), else the script's mode arguments (``lua/publish.lua``: without and with attaching).
    The verdict is kept on the channel per store: kombu's producer pools are shared by the apps
    of one broker URL."""
    verdicts = channel.__dict__.get(_ATTR)
    if verdicts is None:  # not setdefault: that would build a dictionary on every publish
        verdicts = channel.__dict__[_ATTR] = weakref.WeakKeyDictionary()
    mode: tuple[str, str] | bool | None = verdicts.get(store, False)
    if mode is False:
        mode = verdicts[store] = _modes(channel, store)
        if mode is not None and "_put" not in channel.__dict__:
            channel._put = MethodType(_put, channel)
    return mode  # type: ignore[return-value]


def _modes(channel: Any, store: Any) -> tuple[str, str] | None:
    from kombu.transport.redis import Channel  # imports without redis-py too (this module needs it)

    if type(store) is not RedisStore or store.wait_replicas or not isinstance(channel, Channel) \
            or not store.accelerated:
        return None
    # Every method the hook calls, as kombu 5.4-5.7 define them.
    names = ("_get_message_priority", "_q_for_pri", "conn_or_acquire", "pool", "typeof")
    if not all(hasattr(channel, name) for name in names):
        return None
    try:
        broker = channel.client
    except Exception:  # a transport that builds its client its own way
        return None
    if type(broker.connection_pool) not in (redis.ConnectionPool, redis.BlockingConnectionPool):
        return None  # Sentinel's managed pool
    if not same_server(broker, store.client, db=False):
        return None
    # A store on another database of the broker's server (Celery's common "broker on /0,
    # backend on /1"): the script selects the store's database for the record and the intent
    # and the broker's for the push. A script's SELECT does not change its connection's.
    dbs = [int(c.connection_pool.connection_kwargs.get("db") or 0) for c in (store.client, broker)]
    if dbs[0] == dbs[1]:
        return "0", "1"
    try:  # once per channel and store: a server (or a proxy) may refuse a script's SELECT
        broker.eval("redis.call('SELECT', ARGV[1]) return 1", 0, dbs[0])
    except redis.RedisError:
        return None
    return f"0 {dbs[0]} {dbs[1]}", f"1 {dbs[0]} {dbs[1]}"


def _put(self: Any, queue: str, message: dict[str, Any], **kwargs: Any) -> None:
    pending = _PENDING.get()
    put = type(self)._put
    if pending is None or (message.get("headers") or {}).get(HEADER) != pending.key:
        return put(self, queue, message, **kwargs)  # type: ignore[no-any-return]
    store = pending.store
    expires = getattr(self, "_expires", None)
    if kwargs.get("_publish_batch") is not None or (expires and queue in expires):
        # kombu sends this one in several commands: read first, then let kombu push it.
        return _put_unless_found(pending, put, self, queue, message, kwargs)
    name = self._q_for_pri(queue, self._get_message_priority(message, reverse=False))
    record = store.name_of(pending.key)
    # With an intent, the script keeps the payload it pushes: its size is checked first.
    if pending.intent is None:
        payload = dumps(message)  # type: ignore[no-untyped-call]
    else:
        payload, head, ttl, eta = pending.intent_of(self, queue, message)
    # EVALSHA names the queue first: kombu's global_keyprefix client prefixes exactly that
    # key, as it does for LPUSH; the record's and the reservation's names are the store's own.
    if pending.reserve is None:
        keys: tuple[str, ...] = (name, record)
        args: tuple[Any, ...] = (payload, pending.mode[0])
    else:
        keys, args = (name, record, record + RESERVED), (payload, pending.mode[1], *pending.reserve)
    if pending.intent is not None:  # written with the push, in the same script (no 2nd copy)
        keys = (*keys, record + INTENT, store.intent_index())
        args = (*args, pending.intent_spec(queue, message, head, ttl, eta))
    reply = _evalsha(self, keys, args)
    if reply is None:
        return None  # pushed
    if reply == _CHECK:
        # Not a plain record: nothing was pushed; the store's read raises (CorruptRecord) or not.
        _put_unless_found(pending, put, self, queue, message, kwargs)
    elif isinstance(reply, list):
        task_id, _, fingerprint = reply[0].decode().partition("\0")
        pending.found = Reservation(task_id, fingerprint or None)
    else:
        pending.found = store._decode(pending.key, reply)
    return None


def _evalsha(channel: Any, keys: tuple[str, ...], args: tuple[Any, ...]) -> Any:
    """Run the script on a wire on the broker's pool (no redis-py client per call), unless it retries."""
    pool, kept = channel.pool, channel.__dict__.get(_WIRE)
    if kept is None or kept[0] is not pool:  # kept on the channel while its pool lives
        kept = channel.__dict__[_WIRE] = (pool, wire_on(pool))
    if (wire := kept[1]) is None:
        with channel.conn_or_acquire() as client:
            try:
                return client.evalsha(_SHA, len(keys), *keys, *args)
            except redis.exceptions.NoScriptError:
                client.script_load(_LUA)  # a new or restarted server
                return client.evalsha(_SHA, len(keys), *keys, *args)
    # As kombu's global_keyprefix client prefixes an EVALSHA: its first key only.
    packed = pack(("EVALSHA", _SHA, len(keys), channel.global_keyprefix + keys[0], *keys[1:], *args))
    try:
        return wire.call(packed)
    except redis.exceptions.NoScriptError:
        wire.call(pack(("SCRIPT", "LOAD", _LUA)))
        return wire.call(packed)


def _put_unless_found(pending: _Pending, put: Any, channel: Any, queue: str,
                      message: dict[str, Any], kwargs: dict[str, Any]) -> None:
    """The enqueue check in two steps: read the record; note it when it answers the enqueue
    (done or failed, or in progress when the enqueue may attach), else let kombu push it."""
    try:
        record = pending.store.get(pending.key)
    except StoreUnavailable:
        record = None  # as the check does: the worker's gate still guards the body; publish
    if record is not None and (record.state in (State.DONE, State.FAILED) or (
            pending.reserve is not None and record.state is State.IN_PROGRESS)):
        pending.found = record
    if pending.found is None:
        pending.write_intent(channel, queue, message)
        put(channel, queue, message, **kwargs)


def _undo_for(backend: Any) -> Callable[[str], None] | None:
    """What undoes ``backend.on_task_call`` for an unsent message; None: unknown, read first."""
    on_task_call = getattr(type(backend), "on_task_call", None)
    if on_task_call is None or getattr(on_task_call, "__module__", "") in _NOTHING_TO_UNDO:
        return _nothing
    from celery.backends.redis import RedisBackend

    if on_task_call is RedisBackend.on_task_call and task_join_will_block is not None:
        consumer = backend.result_consumer

        def undo(task_id: str) -> None:
            # As on_task_call subscribed (not from within a worker's task: it would block).
            if not task_join_will_block():
                consumer.cancel_for(task_id)

        return undo
    return None


def _nothing(task_id: str) -> None:
    """Undo an ``on_task_call`` that did nothing (or only declared a reply queue)."""
