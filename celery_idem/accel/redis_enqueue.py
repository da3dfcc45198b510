"""The enqueue check and the publish in one round trip, for a Redis broker that holds the store.

An acceleration (see :mod:`celery_idem.accel`); the plain path reads the record, then publishes.

``IdempotentTask.apply_async`` reads the key's record before it publishes (the enqueue check):
a done key is answered from the record and nothing is sent. That read is a round trip of its
own on every ``delay()``, and on a unique key (the common case) it finds nothing. When the
broker is kombu's Redis transport on the same server and database as a plain
:class:`~celery_idem.stores.redis.RedisStore`, the read can ride on the publish instead: the
message is pushed by a script (``lua/publish.lua``) that pushes it only when the record is not
done or failed, and otherwise hands the record back. One round trip instead of two, and the
check and the push are one atomic step.

The hook is the channel's ``_put`` (where kombu's Redis transport pushes a message to its
queue list), replaced on the channel *instance* the task publishes on, never on kombu's class;
it acts only on the message whose ``idempotency_key`` header is the key being enqueued in this
context (:func:`begin`), and every other publish on the channel goes to kombu's own
``_put``. A publish kombu would make in more than one command (a publish batch, a queue with
``x-expires``) reads the record first instead (two round trips, as without the hook).
"""

from __future__ import annotations

import hashlib
import weakref
from contextvars import ContextVar, Token
from dataclasses import dataclass
from importlib import resources
from types import MethodType
from typing import Any

import redis
from kombu.utils.json import dumps

from ..exceptions import StoreUnavailable
from ..records import Record, Reservation, State
from ..stores.redis import RESERVED, RedisStore

__all__ = ["RecordFound", "RedisStore", "ReservationFound", "begin", "end", "fuse", "same_server"]

# Beside the store's scripts (celery_idem/stores/lua/), where the store's loader finds Lua.
_LUA = resources.files("celery_idem.stores").joinpath("lua", "publish.lua").read_text("utf-8")
_SHA = hashlib.sha1(_LUA.encode()).hexdigest()
_CHECK = b"check"
#: On a channel: whether it takes the hook, per store checked against it.
_ATTR = "_celery_idem_stores"


#: Connection settings that must be equal for two clients to reach one server, one database,
#: as one user (a script runs with its connection's permissions).
_SAME_SERVER = ("host", "port", "db", "path", "username", "password")


def same_server(a: Any, b: Any) -> bool:
    """Whether redis-py clients ``a`` and ``b`` talk to the same server and database.

    The connection classes are compared by kind (TLS, Unix socket, TCP): kombu's Redis
    transport connects through a subclass of its own making.
    """
    pa, pb = a.connection_pool, b.connection_pool
    if _connection_kind(pa.connection_class) != _connection_kind(pb.connection_class):
        return False  # TLS on one side only, say
    ka, kb = pa.connection_kwargs, pb.connection_kwargs
    return all(ka.get(name) == kb.get(name) for name in _SAME_SERVER)


def _connection_kind(connection_class: type) -> str:
    for kind in (redis.SSLConnection, redis.UnixDomainSocketConnection):
        if issubclass(connection_class, kind):
            return kind.__name__
    return "tcp"


class RecordFound(Exception):
    """Raised out of the publish: the key is done or failed (or, when the enqueue may attach,
    in progress), and nothing was pushed."""

    def __init__(self, record: Record) -> None:
        super().__init__(record.key)
        self.record = record


class ReservationFound(Exception):
    """Raised out of the publish: another queued message reserved the key; nothing was pushed."""

    def __init__(self, reservation: Reservation) -> None:
        super().__init__(reservation.task_id)
        self.reservation = reservation


@dataclass
class _Pending:
    store: RedisStore
    key: str
    header: str
    #: When the enqueue may attach: (task id, fingerprint or "", reservation lease in ms).
    reserve: tuple[str, str, int] | None = None


_PENDING: ContextVar[_Pending | None] = ContextVar("celery_idem_pending_publish", default=None)


def fuse(channel: Any, store: Any) -> bool:
    """Hook ``channel`` so the enqueue check rides on the publish; False if it cannot.

    It can when ``channel`` is kombu's Redis transport channel on the same server and
    database as ``store``, a plain :class:`RedisStore` (no replica wait: a read needs none).
    The verdict is kept on the channel, per store: a channel's connection does not change
    server, and kombu's producer pools (so their channels) are shared by every app in the
    process with the same broker URL.
    """
    verdicts = channel.__dict__.get(_ATTR)
    if verdicts is None:
        verdicts = weakref.WeakKeyDictionary()
        setattr(channel, _ATTR, verdicts)
    ok: bool | None = verdicts.get(store)
    if ok is None:
        ok = verdicts[store] = _compatible(channel, store)
        if ok and "_put" not in channel.__dict__:
            channel._put = MethodType(_put, channel)
    return ok


def _compatible(channel: Any, store: Any) -> bool:
    try:
        from kombu.transport.redis import Channel
    except ImportError:  # pragma: no cover - kombu without redis-py
        return False
    if type(store) is not RedisStore or store.wait_replicas or not isinstance(channel, Channel):
        return False
    if not store.accelerated:
        return False  # accelerations switched off (celery_idem.accel.enabled)
    # Every method the hook calls, as kombu 5.4-5.7 define them (5.7 added queue expiry,
    # ``_expires``, and publish batches: both optional here).
    if not all(hasattr(channel, name) for name in
               ("_get_message_priority", "_q_for_pri", "conn_or_acquire")):
        return False
    try:
        broker = channel.client
    except Exception:  # a transport that builds its client its own way
        return False
    if type(broker.connection_pool) not in (redis.ConnectionPool, redis.BlockingConnectionPool):
        return False  # Sentinel's managed pool
    return same_server(broker, store.client)


def begin(store: RedisStore, key: str, header: str,
          reserve: tuple[str, str, int] | None = None) -> Token[_Pending | None]:
    """From now until :func:`end`: the publish of the message whose ``header`` is ``key``
    checks the record (and raises :class:`RecordFound` out of the publish, nothing pushed,
    when the key is done or failed).

    With ``reserve`` (the message's task id, its fingerprint or "", a lease in ms), the
    enqueue may attach to the action under way: a record in progress raises
    :class:`RecordFound` too, another message's reservation :class:`ReservationFound`, and a
    pushed message reserves the key.
    """
    return _PENDING.set(_Pending(store, key, header, reserve))


def end(token: Token[_Pending | None]) -> None:
    """End what :func:`begin` started."""
    _PENDING.reset(token)


def _put(self: Any, queue: str, message: dict[str, Any], **kwargs: Any) -> None:
    pending = _PENDING.get()
    put = type(self)._put
    if pending is None or (message.get("headers") or {}).get(pending.header) != pending.key:
        return put(self, queue, message, **kwargs)  # type: ignore[no-any-return]
    store = pending.store
    expires = getattr(self, "_expires", None)
    if kwargs.get("_publish_batch") is not None or (expires and queue in expires):
        # kombu sends this one in several commands: read first, then let kombu push it.
        _raise_if_done(store, pending.key, attach=pending.reserve is not None)
        return put(self, queue, message, **kwargs)  # type: ignore[no-any-return]
    name = self._q_for_pri(queue, self._get_message_priority(message, reverse=False))
    record = store.name_of(pending.key)
    payload = dumps(message)  # type: ignore[no-untyped-call]
    # EVALSHA names the queue first: kombu's global_keyprefix client prefixes exactly that
    # key, as it does for LPUSH; the record's and the reservation's names are the store's own.
    if pending.reserve is None:
        keys: tuple[str, ...] = (name, record)
        args: tuple[Any, ...] = (payload, "0")
    else:
        keys, args = (name, record, record + RESERVED), (payload, "1", *pending.reserve)
    with self.conn_or_acquire() as client:
        try:
            reply = client.evalsha(_SHA, len(keys), *keys, *args)
        except redis.exceptions.NoScriptError:
            client.script_load(_LUA)  # a new or restarted server
            reply = client.evalsha(_SHA, len(keys), *keys, *args)
    if reply is None:
        return None  # pushed
    if reply == _CHECK:
        # Not a plain record (another program's value): nothing was pushed. The store's read
        # raises what it raises without the hook (CorruptRecord), or finds the key gone.
        _raise_if_done(store, pending.key, attach=pending.reserve is not None)
        return put(self, queue, message, **kwargs)  # type: ignore[no-any-return]
    if isinstance(reply, list):
        task_id, _, fingerprint = reply[0].decode().partition("\0")
        raise ReservationFound(Reservation(task_id, fingerprint or None))
    raise RecordFound(store._decode(pending.key, reply))


def _raise_if_done(store: RedisStore, key: str, *, attach: bool = False) -> None:
    """The enqueue check in two steps: read the record; raise RecordFound if done or failed
    (or in progress, when the enqueue may attach)."""
    try:
        record = store.get(key)
    except StoreUnavailable:
        return  # as the check does: the worker's gate still guards the body; publish
    if record is not None and (record.state in (State.DONE, State.FAILED)
                               or (attach and record.state is State.IN_PROGRESS)):
        raise RecordFound(record)
