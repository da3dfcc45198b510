"""The Redis store's hot path to the server: one packed command, one reply, no redis-py layers.

The fast twin of the store's plain scripts (see :mod:`celery_idem.paths`): :func:`wire_scripts`
wraps them (``RedisStore._scripts``) in :class:`WireScripts`, which runs the same ``EVALSHA`` on
a :class:`Wire`. Through ``redis.Redis`` a command also pays for a pool checkout, a retry
wrapper, per-argument encoding and response callbacks: about 100 µs of client CPU against 20 µs
on a raw socket. :class:`Wire` keeps what matters of that path:

* connections come from the client's own pool (its settings, TLS, credentials, fork handling)
  and stay checked out in a small free list of the store's;
* before reuse, one ``poll`` tells whether the server closed the connection or left unread
  data: it is then reconnected *before* the command is sent, so no command is sent twice;
* the command is packed by hiredis (or in Python) and the reply read by the connection's parser.

An error leaves the connection disconnected and raises, as the client does with the store's
default ``Retry(NoBackoff(), 0)``. A client with retries, a single connection, client-side
caching, RESP3 or another pool class (Sentinel, Cluster) gets no wire (:func:`wire_for`).

What it buys (``python -m bench.accel``): about a fifth of an ``IdempotentTask``'s time per
task against redis-py's scripts (docs/benchmarks.md, "Each fast path alone").
"""

from __future__ import annotations

import inspect
import os
import select
import weakref
from collections.abc import Callable
from typing import Any

import redis

try:
    from hiredis import pack_command as _hiredis_pack
except ImportError:  # pragma: no cover - hiredis is in the redis extra
    _hiredis_pack = None  # type: ignore[assignment, unused-ignore]

__all__ = ["Wire", "WireScripts", "pack", "wire_for", "wire_on", "wire_scripts"]


def _pack_python(args: tuple[Any, ...]) -> bytes:
    out = [b"*%d\r\n" % len(args)]
    for arg in args:
        if isinstance(arg, str):
            arg = arg.encode()
        elif isinstance(arg, int):
            arg = b"%d" % arg
        out.append(b"$%d\r\n%s\r\n" % (len(arg), arg))
    return b"".join(out)


def pack(args: tuple[Any, ...]) -> bytes:
    """One RESP command from ``args`` (str, bytes, int), as redis-py would send it."""
    if _hiredis_pack is not None:
        return _hiredis_pack(args)  # type: ignore[no-any-return, unused-ignore]
    return _pack_python(args)  # pragma: no cover - hiredis is in the redis extra


class _Lane:
    """One connection of the free list, with a poller on its current socket."""

    __slots__ = ("conn", "poller", "sock")

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self.sock: Any = None
        self.poller: Any = None

    def ready(self) -> None:
        sock = self.conn._sock
        if sock is None:
            return  # disconnected: sending connects
        if sock is not self.sock:
            self.poller = select.poll()
            self.poller.register(sock, select.POLLIN)
            self.sock = sock
        if self.poller.poll(0):
            # Readable while idle: the server closed it (EOF) or left a stray reply. Nothing was
            # sent yet: reconnect safely.
            self.conn.disconnect()


#: Every live wire, so a forked child drops the connections (sockets) it shares with its parent.
_WIRES: weakref.WeakSet[Wire] = weakref.WeakSet()


def _after_fork() -> None:  # pragma: no cover - runs in a forked child
    for wire in list(_WIRES):
        wire.lanes = []


os.register_at_fork(after_in_child=_after_fork)


class Wire:
    """Send one packed command and read its reply on a connection of ``pool`` (the client's
    ``ConnectionPool`` or ``BlockingConnectionPool``)."""

    def __init__(self, pool: redis.ConnectionPool) -> None:
        self.pool = pool
        self.lanes: list[_Lane] = []
        self._checkout: Callable[[], Any] = _checkout_of(pool)
        _WIRES.add(self)

    def call(self, packed: bytes) -> Any:
        """Send ``packed`` (see :func:`pack`) and return the parsed reply.

        Raises:
            redis.ResponseError: The server answered with an error (the connection is fine).
            redis.RedisError: Anything else; the connection was disconnected.
        """
        lanes = self.lanes
        try:
            lane = lanes.pop()
        except IndexError:
            lane = _Lane(self._checkout())
        conn = lane.conn
        try:
            lane.ready()
            conn.send_packed_command((packed,))
            reply = conn.read_response()
        except redis.ResponseError:
            lanes.append(lane)  # a whole reply was read: the connection is clean
            raise
        except BaseException:
            # An error between send and read (an interrupt) may leave a reply unread.
            conn.disconnect()
            self.pool.release(conn)
            raise
        lanes.append(lane)
        return reply

    def close(self) -> None:
        """Give every connection back to the pool (the caller then closes the client)."""
        lanes, self.lanes = self.lanes, []
        for lane in lanes:
            self.pool.release(lane.conn)


def _checkout_of(pool: redis.ConnectionPool) -> Callable[[], Any]:
    """``pool.get_connection`` as this redis-py takes it (a command name before 5.3, none after)."""
    try:
        param = inspect.signature(pool.get_connection).parameters.get("command_name")
    except (TypeError, ValueError):  # pragma: no cover
        param = None
    if param is not None and param.default is inspect.Parameter.empty:  # pragma: no cover
        return lambda: pool.get_connection("EVALSHA")
    return pool.get_connection


def _retries(retry: Any) -> int:
    """How many retries a redis-py ``Retry`` makes (``get_retries()`` is new in redis-py 6)."""
    get = getattr(retry, "get_retries", None)
    return int(get() if get is not None else getattr(retry, "_retries", 1))


def wire_for(client: Any) -> Wire | None:
    """A :class:`Wire` for ``client``, or None when the client needs its own path (see above)."""
    if type(client) is not redis.Redis or getattr(client, "connection", None) is not None:
        return None  # a subclass may override execute_command; single_connection_client
    return wire_on(client.connection_pool)


def wire_on(pool: Any) -> Wire | None:
    """A :class:`Wire` on ``pool``, or None when its connections need redis-py's path."""
    if type(pool) not in (redis.ConnectionPool, redis.BlockingConnectionPool):
        return None  # Sentinel's pool checks the master on checkout
    kwargs = pool.connection_kwargs
    retry = kwargs.get("retry")
    if (retry is not None and _retries(retry) != 0) or (
            retry is None and (kwargs.get("retry_on_timeout") or kwargs.get("retry_on_error"))):
        return None  # the user asked for retries: redis-py's wrapper does them
    if getattr(pool, "cache", None) is not None or str(kwargs.get("protocol", 2)) == "3":
        return None  # client-side caching, RESP3 push messages / maintenance notifications
    return Wire(pool)


class WireScripts:
    """The store's plain scripts (``client``, ``registered``; ``run``, ``get``, ``close`` as
    theirs) over a :class:`Wire` on that client's pool."""

    def __init__(self, plain: Any, wire: Wire) -> None:
        self.client = plain.client
        self.registered: dict[str, Any] = plain.registered
        self.wire = wire

    def run(self, name: str, keys: tuple[str, ...], args: list[Any]) -> Any:
        """``EVALSHA`` of the script ``name``; after a NOSCRIPT (a restarted or flushed server),
        ``SCRIPT LOAD`` and once more (its SHA1 does not change)."""
        script = self.registered[name]
        packed = pack(("EVALSHA", script.sha, len(keys), *keys, *args))
        try:
            return self.wire.call(packed)
        except redis.exceptions.NoScriptError:
            self.client.script_load(script.script)
            return self.wire.call(packed)

    def get(self, name: str) -> bytes | None:
        return self.wire.call(pack(("GET", name)))  # type: ignore[no-any-return]

    def close(self) -> None:
        self.wire.close()


def wire_scripts(plain: Any) -> WireScripts | None:
    """``plain`` (the store's scripts) over a wire, or None when its client needs redis-py."""
    wire = wire_for(plain.client)
    return None if wire is None else WireScripts(plain, wire)
