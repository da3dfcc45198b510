"""Redis store (``redis://``, ``rediss://``, ``unix://``): one Lua script per verb.

Each record is a hash at ``<prefix><key>`` with short field names, to keep a done record small:

====  ==========================================  ====  ======================================
s     state (in_progress/done/failed/released)    l     lease expiry, server ms
t     fencing token                               h     payload hash (idempotency_validate)
o     owner (host:pid)                            c     content type of ``d``
i     task id of the claiming attempt             d     encoded result or error
a     attempt (request.retries)                   u     last write, server ms
====  ==========================================  ====  ======================================

The scripts read the server clock (``TIME``), so lease expiry never depends on worker clocks.
Redis needs persistence (AOF ``appendfsync everysec`` or better) for records to survive a
restart; see docs/stores.md.
"""

from __future__ import annotations

import contextlib
import itertools
import re
from collections.abc import Iterator
from importlib import resources
from typing import Any, ClassVar

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from ..exceptions import (
    CorruptRecord,
    IdempotencyError,
    ImproperlyConfigured,
    LeaseLost,
    StoreUnavailable,
)
from ..records import Claim, ClaimStatus, Record, State
from .base import BackendWrite, Store

__all__ = ["RedisStore"]

_FIELDS = ("s", "t", "o", "i", "a", "l", "h", "c", "d", "u")

#: Client defaults: fail fast instead of hanging a worker when the store is down. No automatic
#: retries inside redis-py: the gate decides what to retry (a blind retry of a claim whose reply
#: was lost would find its own claim and report it as busy).
_CLIENT_DEFAULTS: dict[str, Any] = {
    "socket_timeout": 5.0,
    "socket_connect_timeout": 3.0,
    "health_check_interval": 30,
}


#: A claim script's status reply -> ClaimStatus, without an Enum lookup per claim.
_STATUSES = {status.value.encode(): status for status in ClaimStatus}


def _load(name: str) -> str:
    return resources.files(__package__).joinpath("lua", f"{name}.lua").read_text("utf-8")


#: Every error redis-py raises (RedisClusterException, no node of a cluster answers, is not a
#: RedisError).
_REDIS_ERRORS = (redis.RedisError, redis.exceptions.RedisClusterException)


def _translated(store: RedisStore, key: str | None, exc: Exception) -> IdempotencyError:
    """The store contract's error for a redis-py error, most specific first."""
    if isinstance(exc, redis.ResponseError):
        if str(exc).startswith("WRONGTYPE"):
            return CorruptRecord(
                f"the Redis key {store.prefix}{key} is not a celery_idem record (another program "
                f"wrote it, or the prefix is shared): {exc}",
                key=key,
            )
        return StoreUnavailable(f"the Redis store at {store.location} refused: {exc}")
    if isinstance(exc, (redis.ConnectionError, redis.TimeoutError)):
        return StoreUnavailable(f"could not reach the Redis store at {store.location}: {exc}")
    return StoreUnavailable(f"the Redis store at {store.location} failed: {exc}")


@contextlib.contextmanager
def _translate_errors(store: RedisStore, key: str | None = None) -> Iterator[None]:
    """Map redis-py errors to the store contract's (see :func:`_translated`).

    The hot verbs (claim, record) use a plain ``try``/``except _REDIS_ERRORS`` with
    :func:`_translated` instead: a generator context manager costs a few µs per call.
    """
    try:
        yield
    except _REDIS_ERRORS as exc:
        raise _translated(store, key, exc) from exc


class RedisStore(Store):
    """Idempotency records in Redis, one Lua script (one round trip) per verb.

    Args:
        client: A ``redis.Redis`` client (``decode_responses`` must be False).
        prefix: Prepended to every key.
        wait_replicas: After each write (claim, record, release, renew), wait (``WAIT``)
            until this many replicas have it, so a failover cannot lose an acknowledged claim
            or result. 0 (the default): no wait; see docs/redis-cluster.md for the trade.
        wait_timeout: Seconds ``WAIT`` may take; fewer replicas by then raises
            ``StoreUnavailable`` (the write is on the master but not known to be durable).
        location: Where the store is, for messages (default: host:port/db of ``client``).
    """

    schemes: ClassVar[tuple[str, ...]] = ("redis", "rediss", "unix")

    def __init__(self, client: redis.Redis, prefix: str = "celery-idem:", *,
                 wait_replicas: int = 0, wait_timeout: float = 1.0,
                 location: str | None = None) -> None:
        super().__init__(prefix)
        if not isinstance(wait_replicas, int) or isinstance(wait_replicas, bool) or wait_replicas < 0:
            raise ImproperlyConfigured(
                f"wait_replicas must be an int >= 0 (replicas to confirm each write), "
                f"got {wait_replicas!r}")
        if not isinstance(wait_timeout, (int, float)) or wait_timeout <= 0:
            raise ImproperlyConfigured(
                f"wait_timeout must be a number of seconds > 0, got {wait_timeout!r}")
        self.client = client
        self._fold_refused = False  # record_with: the server refused the backend's key once
        self.wait_replicas = wait_replicas
        self.wait_timeout = float(wait_timeout)
        if location is None:
            kwargs = client.connection_pool.connection_kwargs
            location = (
                kwargs.get("path") or f"{kwargs.get('host', '?')}:{kwargs.get('port', '?')}"
            ) + f"/{kwargs.get('db', 0)}"
        self.location = location
        # register_script runs EVALSHA and falls back to EVAL once after a NOSCRIPT (a restarted
        # or flushed server): still one round trip on the hot path.
        self._claim = client.register_script(_load("claim"))
        self._record = client.register_script(_load("record"))
        self._release = client.register_script(_load("release"))
        self._renew = client.register_script(_load("renew"))

    @classmethod
    def from_url(cls, url: str, *, prefix: str = "celery-idem:", **options: Any) -> RedisStore:
        """Build a store from a Redis URL; ``options`` go to ``redis.Redis.from_url``.

        ``wait_replicas`` and ``wait_timeout`` in ``options`` are the store's own (see the class).
        """
        store_opts = _store_options(options)
        opts = {**_CLIENT_DEFAULTS, **options}
        opts.setdefault("retry", Retry(NoBackoff(), 0))
        client = redis.Redis.from_url(url, **opts)
        return cls(client, prefix=prefix, **store_opts)

    def _k(self, key: str) -> str:
        return self.prefix + key

    def _key_of(self, name: bytes | str) -> str:
        """The idempotency key of a Redis key name (the inverse of ``_k``)."""
        return _text(name)[len(self.prefix):]

    def _node(self, name: str) -> redis.Redis:
        """The client that talks to the server holding ``name`` (cluster: that key's master)."""
        return self.client

    def _run(self, script: Any, key: str, args: list[Any], other: str | None = None) -> Any:
        """Run one verb's script on ``key``: one round trip, or two with ``wait_replicas``.

        ``other``: a second key the script writes (the result backend's, see ``record_with``).
        """
        name = self._k(key)
        keys = (name,) if other is None else (name, other)
        if not self.wait_replicas:
            # What redis-py's Script.__call__ does, inlined: it costs several µs per call in
            # argument shuffling and a Pipeline type check that never applies here.
            client = script.registered_client
            try:
                return client.evalsha(script.sha, len(keys), *keys, *args)
            except redis.exceptions.NoScriptError:
                script.sha = client.script_load(script.script)  # a restarted server
                return client.evalsha(script.sha, len(keys), *keys, *args)
        # WAIT counts the replicas that have every write made *on this connection*, so the
        # script and the WAIT go down one connection, pipelined (still one network exchange).
        node = self._node(name)
        for _ in range(2):
            pipe = node.pipeline(transaction=False)
            pipe.evalsha(script.sha, len(keys), *keys, *args)
            pipe.execute_command(  # type: ignore[no-untyped-call]
                "WAIT", self.wait_replicas, _ms(self.wait_timeout))
            # raise_on_error=False: a raised pipeline error has its message rewritten
            # ("Command # 1 (EVALSHA ...) of pipeline caused error: ..."), which would hide a
            # WRONGTYPE (a foreign key: CorruptRecord) from _translate_errors.
            reply, acked = pipe.execute(raise_on_error=False)
            if isinstance(reply, redis.exceptions.NoScriptError):
                node.script_load(script.script)  # a restarted or newly promoted server
                continue
            for outcome in (reply, acked):
                if isinstance(outcome, Exception):
                    raise outcome
            if int(acked) < self.wait_replicas:
                raise _NotReplicated(
                    f"the Redis store at {self.location} wrote {name} but only {acked} of "
                    f"{self.wait_replicas} replicas confirmed it within {self.wait_timeout:g} s "
                    f"(wait_replicas): not known to survive a failover",
                    reply,
                )
            return reply
        raise StoreUnavailable(f"the Redis store at {self.location} keeps losing its scripts")

    # -- verbs ---------------------------------------------------------------------------------

    def claim(
        self,
        key: str,
        *,
        owner: str,
        task_id: str,
        attempt: int,
        lease: float,
        ttl: float,
        payload_hash: str | None = None,
    ) -> Claim:
        args: list[str | int] = [owner, task_id, attempt, _ms(lease), _ms(ttl), payload_hash or ""]
        try:
            try:
                reply = self._run(self._claim, key, args)
            except _REDIS_ERRORS as exc:
                raise _translated(self, key, exc) from exc
        except _NotReplicated as short:
            # The claim is on the master only. Give it back (best effort, no WAIT) so the
            # re-queued message can claim again at once instead of finding it busy for a lease.
            if short.reply[0] in (b"claimed", b"takeover"):
                with contextlib.suppress(redis.RedisError):
                    self._release(keys=[self._k(key)], args=[int(short.reply[1])])
            raise
        raw = reply[0]
        if raw == b"corrupt":
            raise CorruptRecord(
                f"the record {self._k(key)} has an unknown state {reply[3]!r}", key=key
            )
        status = _STATUSES.get(raw) or ClaimStatus(raw.decode())
        record = self._decode(key, reply[3:]) if reply[3] is not None else None
        return Claim(status, int(reply[1]), record, int(reply[2]) / 1000)

    def record(
        self, key: str, token: int, *, state: State, content_type: str, data: bytes, ttl: float
    ) -> None:
        if state not in (State.DONE, State.FAILED):
            raise ValueError(f"record() takes DONE or FAILED, not {state}")
        try:
            reply = self._run(
                self._record, key, [token, state.value, content_type, data, _ms(ttl)]
            )
        except _REDIS_ERRORS as exc:
            raise _translated(self, key, exc) from exc
        if reply != b"ok":
            self._check_fence(reply, key, token, "record")

    def record_with(
        self, key: str, token: int, *, state: State, content_type: str, data: bytes, ttl: float,
        also: BackendWrite,
    ) -> None:
        """Record, and write ``also`` (SET + PUBLISH) in the same script, only if the fence holds.

        The caller must know that ``also.key`` lives on this store's server and database (the
        task layer checks that the result backend's connection is this store's).
        """
        if state not in (State.DONE, State.FAILED):
            raise ValueError(f"record() takes DONE or FAILED, not {state}")
        if self._fold_refused:
            self.record(key, token, state=state, content_type=content_type, data=data, ttl=ttl)
            return
        args = [token, state.value, content_type, data, _ms(ttl), also.value, max(0, also.expires)]
        try:
            reply = self._run(self._record, key, args, other=also.key)
        except redis.exceptions.NoPermissionError:
            # The store's user may not touch the backend's key (an ACL): nothing was run. Record
            # alone, now and from now on; the backend writes its result itself.
            self._fold_refused = True
            self.record(key, token, state=state, content_type=content_type, data=data, ttl=ttl)
            return
        except _REDIS_ERRORS as exc:
            raise _translated(self, key, exc) from exc
        if reply == b"ok":
            also.written = True
        elif reply != b"ok:nometa":  # recorded; the backend writes its meta itself
            self._check_fence(reply, key, token, "record")

    def release(self, key: str, token: int) -> None:
        with _translate_errors(self, key):
            reply = self._run(self._release, key, [token])
        self._check_fence(reply, key, token, "release")

    def renew(self, key: str, token: int, lease: float) -> float:
        with _translate_errors(self, key):
            reply = self._run(self._renew, key, [token, _ms(lease)])
        if isinstance(reply, int):
            return float(reply) / 1000
        self._check_fence(reply, key, token, "renew")
        raise AssertionError("unreachable")  # pragma: no cover - _check_fence raised

    def get(self, key: str) -> Record | None:
        with _translate_errors(self, key):
            values = self.client.hmget(self._k(key), _FIELDS)
        return None if values[0] is None else self._decode(key, values)

    def scan(self, state: State | None = None, count: int = 100) -> Iterator[Record]:
        pattern = re.sub(r"([*?\[\]\\])", r"\\\1", self.prefix) + "*"
        # scan_iter walks every server that holds keys: the one server, or every cluster master.
        names_iter = self.client.scan_iter(match=pattern, count=count)
        while True:
            with _translate_errors(self):
                names = list(itertools.islice(names_iter, count))
                if not names:
                    return
                pipe = self.client.pipeline(transaction=False)
                for name in names:
                    pipe.hmget(name, _FIELDS)
                rows = pipe.execute(raise_on_error=False)
            for name, values in zip(names, rows, strict=True):
                if isinstance(values, Exception) or values[0] is None:
                    continue  # a foreign key under our prefix, or expired between the calls
                rec = self._decode(self._key_of(name), values)
                if state is None or rec.state is state:
                    yield rec

    def now(self) -> float:
        with _translate_errors(self):
            seconds, micros = self.client.time()
        return float(seconds) + float(micros) / 1e6

    def close(self) -> None:
        self.client.close()

    # -- helpers -------------------------------------------------------------------------------

    def _check_fence(self, reply: Any, key: str, token: int, verb: str) -> None:
        if reply == b"ok":
            return
        detail = reply.decode() if isinstance(reply, bytes) else repr(reply)
        if detail == "missing":
            why = "the record is gone (expired, or removed by an operator)"
        else:
            _, state, current = detail.split(":", 2)
            why = f"the record is {state} with token {current}"
        raise LeaseLost(f"{verb} of {key!r} with token {token} refused: {why}", key=key, token=token)

    def _decode(self, key: str, values: list[Any]) -> Record:
        s, t, o, i, a, lease, h, c, d, u = values
        try:
            return Record(
                key=key,
                state=State(s.decode()),
                token=int(t),
                owner=o.decode() if o else "",
                task_id=i.decode() if i else "",
                attempt=int(a) if a else 0,
                lease_expires=int(lease) / 1000 if lease else None,
                payload_hash=h.decode() if h else None,
                content_type=c.decode() if c else None,
                data=d,
                updated=int(u) / 1000 if u else None,
            )
        except (ValueError, TypeError, AttributeError, UnicodeDecodeError) as exc:
            raise CorruptRecord(
                f"the record {self._k(key)} cannot be read ({exc}); it was not written by "
                f"celery_idem, or it is damaged",
                key=key,
            ) from exc


class _NotReplicated(StoreUnavailable):
    """A write the master made but too few replicas confirmed (``wait_replicas``)."""

    def __init__(self, message: str, reply: Any) -> None:
        super().__init__(message)
        self.reply = reply


def _store_options(options: dict[str, Any]) -> dict[str, Any]:
    """Take the store's own settings out of ``options`` (the rest go to the client)."""
    return {name: options.pop(name) for name in ("wait_replicas", "wait_timeout") if name in options}


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _ms(seconds: float) -> int:
    return max(1, int(seconds * 1000))
