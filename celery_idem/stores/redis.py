"""Redis store (``redis://``, ``rediss://``, ``unix://``): one Lua script per verb.

Each record is ONE string at ``<prefix><key>`` (not a hash: a string has no per-field overhead
and no listpack-to-hashtable cliff for results over 64 bytes), packed as::

    0xC1 <state> <t> [. <n>] NUL <u> NUL <i> NUL <h> NUL <tail>

=====  ==========================================  ==========================================
0xC1   format marker (version 1); a value without   it is not a celery_idem record
       it under the prefix is foreign
state  ``i`` in_progress, ``d`` done, ``f`` failed, ``r`` released (one byte)
t      fencing token (decimal): max(previous + 1, server clock in µs), see
       ``celery_idem.stores.base`` ("Tokens")
n      claim id (8 base64url characters) after a dot; absent from a released tombstone and
       from records written before claim ids (they still parse, with an empty claim id)
u      last write, server ms (decimal)
i      task id of the claiming attempt (a canonical UUID packed as 0x01 + 22 base64url chars)
h      payload hash (idempotency_validate; empty when not validated)
tail   in_progress: ``<o> NUL <a> NUL <l>``: owner (host:pid), attempt (request.retries),
       lease expiry in server ms. done/failed: ``<c> NUL <d>``: content type (one byte code
       for the common ones, see ``_CONTENT_TYPES``, else verbatim) and the encoded result or
       error, which is the rest of the value (any bytes, NULs included). released: empty.
=====  ==========================================  ==========================================

The client refuses a NUL in owner, task id, payload hash and content type (``ValueError``
naming the field, before anything is sent), so the header parses unambiguously; the data comes
last and is never scanned. Each script parses the header with one anchored ``string.match``
and reads the server clock (``TIME``), so lease expiry never depends on worker clocks. Redis
needs persistence (AOF ``appendfsync everysec`` or better) for records to survive a restart;
see docs/stores.md. :meth:`RedisStore.check_durability` reads those settings at worker start.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import logging
import re
from collections.abc import Iterator
from importlib import resources
from typing import Any, ClassVar

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from ..config import DEFAULT_PREFIX
from ..exceptions import (
    CorruptRecord,
    IdempotencyError,
    ImproperlyConfigured,
    LeaseLost,
    StoreUnavailable,
)
from ..records import Claim, ClaimStatus, Record, Reservation, State
from .base import BackendWrite, DurabilityFinding, Store, new_claim_id
from .redis_durability import DURABILITY_SETTINGS, config_get, durability_findings, text
from .redis_wire import pack, wire_for

__all__ = ["CLIENT_DEFAULTS", "RedisStore", "durability_findings", "same_server", "store_options", "text"]

#: The first byte of every record (format version 1): neither UTF-8 text nor msgpack ever starts
#: with it, so a foreign string under the prefix is told apart at once.
_MARK = b"\xc1"
_MARK_BYTE = _MARK[0]

#: A record's state byte -> State, and the state codes ``record`` sends.
_STATE_OF = {ord("i"): State.IN_PROGRESS, ord("d"): State.DONE, ord("f"): State.FAILED,
             ord("r"): State.RELEASED}
_STATE_CODE = {State.DONE: b"d", State.FAILED: b"f"}

#: Content types stored as a one-byte code (its index + 1): what the result codec and the error
#: codec write. Any other content type is stored verbatim (control characters refused, so a code
#: never reads as a verbatim type).
_CONTENT_TYPES = (
    "application/json;utf-8",
    "application/x-celery-idem-error+json",
    "application/json",
    "application/x-python-serialize;binary",
    "application/x-msgpack;binary",
    "application/x-yaml;utf-8",
)
_CONTENT_CODE = {ctype: bytes([n]) for n, ctype in enumerate(_CONTENT_TYPES, 1)}
_CONTENT_TYPE_OF = {code: ctype for ctype, code in _CONTENT_CODE.items()}
_CONTROL = re.compile(r"[\x00-\x1f]")

#: Client defaults: fail fast instead of hanging a worker when the store is down. No automatic
#: retries inside redis-py: the gate decides what to retry (a blind retry of a claim whose reply
#: was lost would find its own claim and report it as busy).
CLIENT_DEFAULTS: dict[str, Any] = {
    "socket_timeout": 5.0,
    "socket_connect_timeout": 3.0,
    "health_check_interval": 30,
}


#: A claim script's status reply -> ClaimStatus, without an Enum lookup per claim.
_STATUSES = {status.value.encode(): status for status in ClaimStatus}

#: The scripts' replies (celery_idem/stores/lua/): the fenced verbs answer REPLY_OK, a refusal
#: (``fenced:<state>:<token>``, ``reissued:...``) or REPLY_MISSING; any script REPLY_CORRUPT
#: for a value that is not a record; record.lua REPLY_OK_NOMETA when the backend's meta write
#: was refused (recorded all the same).
REPLY_OK = b"ok"
REPLY_OK_NOMETA = b"ok:nometa"
REPLY_CORRUPT = b"corrupt"
REPLY_MISSING = "missing"
REPLY_REISSUED = "reissued"
#: The claim statuses that took the key (the claim is to be given back if not replicated).
_TAKEN = (ClaimStatus.CLAIMED.value.encode(), ClaimStatus.TAKEOVER.value.encode())


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


def _load(name: str) -> str:
    """The script ``<name>.lua`` as registered: the shared record parsing (``_record.lua``) first."""
    lua = resources.files(__package__).joinpath("lua")
    return lua.joinpath("_record.lua").read_text("utf-8") + lua.joinpath(f"{name}.lua").read_text("utf-8")


def _plain(name: str) -> str:
    """The script ``<name>.lua`` alone (it does not parse records)."""
    return resources.files(__package__).joinpath("lua", f"{name}.lua").read_text("utf-8")


#: Put after a record's name to name its reservation (``Store.reserve``): under the store's
#: prefix (an ACL user limited to ``~<prefix>*`` may write it), on the record's cluster slot
#: (the name keeps the record's hash tag), and never a record's own name, since a key is
#: printable text and this is not. A scan skips it: its value is not a record.
RESERVED = "\x1freserved"


def _refuse_nul(**fields: str) -> None:
    """Raise a ValueError naming the first field holding a NUL (the record format's separator)."""
    for name, value in fields.items():
        if "\0" in value:
            raise ValueError(
                f"{name} must not contain a NUL character (the Redis record separator): {value!r}")


#: A canonical (lowercase, dashed) UUID task id, what Celery makes: stored as 16 bytes in
#: base64url after a 0x01 byte (23 characters instead of 36; 13 bytes less per record).
_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\Z")
_PACKED_ID = "\x01"


def _pack_task_id(task_id: str) -> str:
    if _UUID.match(task_id):  # the hex digits of the UUID are its 16 bytes, in order
        raw = bytes.fromhex(task_id.replace("-", ""))
        return _PACKED_ID + base64.urlsafe_b64encode(raw).rstrip(b"=").decode()
    if task_id.startswith(_PACKED_ID):
        raise ValueError(f"task_id must not start with a \\x01 character (it marks a packed UUID in "
                         f"the Redis record): {task_id!r}")
    return task_id


def _unpack_task_id(raw: bytes) -> str:
    if raw[:1] == b"\x01":  # a packed UUID: its 16 bytes, written as str(uuid.UUID) writes them
        h = base64.urlsafe_b64decode(raw[1:] + b"==").hex()
        if len(h) != 32:
            raise ValueError(f"a packed task id of {len(h) // 2} bytes")
        return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"
    return raw.decode()


def _content_code(content_type: str) -> str | bytes:
    """What a record stores for ``content_type``: its one-byte code, or the type itself."""
    code = _CONTENT_CODE.get(content_type)
    if code is not None:
        return code
    if _CONTROL.search(content_type):
        raise ValueError(
            f"content_type must not contain control characters (NUL separates the Redis "
            f"record's fields): {content_type!r}")
    return content_type


#: Every error redis-py raises (RedisClusterException, no node of a cluster answers, is not a
#: RedisError).
_REDIS_ERRORS = (redis.RedisError, redis.exceptions.RedisClusterException)


def _translated(store: RedisStore, key: str | None, exc: Exception) -> IdempotencyError:
    """The store contract's error for a redis-py error, most specific first."""
    if isinstance(exc, redis.ResponseError):
        if str(exc).startswith("WRONGTYPE"):
            return CorruptRecord(
                f"the Redis key {store.prefix}{key} is not a celery_idem record (another program "
                f"wrote it, the prefix is shared, or an older celery_idem wrote it as a hash): {exc}",
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

    def __init__(self, client: redis.Redis, prefix: str = DEFAULT_PREFIX, *,
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
        self._forget = client.register_script(_load("forget"))
        # Plain scripts (no record parsing): the enqueue check's reservations.
        self._reserve = client.register_script(_plain("reserve"))
        self._unreserve = client.register_script(_plain("unreserve"))
        # The hot path to the server without redis-py's per-call layers (see redis_wire), for a
        # plain client; None for any other (Sentinel, Cluster, retries, RESP3): redis-py then.
        self._wire = wire_for(client)

    @classmethod
    def from_url(cls, url: str, *, prefix: str = DEFAULT_PREFIX, **options: Any) -> RedisStore:
        """Build a store from a Redis URL; ``options`` go to ``redis.Redis.from_url``.

        ``wait_replicas`` and ``wait_timeout`` in ``options`` are the store's own (see the class).
        """
        store_opts = store_options(options)
        opts = {**CLIENT_DEFAULTS, **options}
        opts.setdefault("retry", Retry(NoBackoff(), 0))
        client = redis.Redis.from_url(url, **opts)
        return cls(client, prefix=prefix, **store_opts)

    def _k(self, key: str) -> str:
        return self.prefix + key

    def _key_of(self, name: bytes | str) -> str:
        """The idempotency key of a Redis key name (the inverse of ``_k``)."""
        return text(name)[len(self.prefix):]

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
            wire = self._wire
            if wire is not None:
                try:
                    return wire.call(pack(("EVALSHA", script.sha, len(keys), *keys, *args)))
                except redis.exceptions.NoScriptError:
                    script.sha = self.client.script_load(script.script)  # a restarted server
                    return wire.call(pack(("EVALSHA", script.sha, len(keys), *keys, *args)))
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
            pipe.execute_command(  # type: ignore[no-untyped-call, unused-ignore]
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
            if reply == REPLY_CORRUPT or (isinstance(reply, list) and reply[0] == REPLY_CORRUPT):
                return reply  # not a record: nothing was written, so nothing to wait for
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
        if "\0" in owner or "\0" in task_id or (payload_hash and "\0" in payload_hash):
            _refuse_nul(owner=owner, task_id=task_id, payload_hash=payload_hash or "")
        claim_id = new_claim_id()
        args: list[str | int] = [owner, _pack_task_id(task_id), attempt, _ms(lease), _ms(ttl),
                                 payload_hash or "", claim_id]
        try:
            try:
                reply = self._run(self._claim, key, args)
            except _REDIS_ERRORS as exc:
                raise _translated(self, key, exc) from exc
        except _NotReplicated as short:
            # The claim is on the master only. Give it back (best effort, no WAIT) so the
            # re-queued message can claim again at once instead of finding it busy for a lease.
            if short.reply[0] in _TAKEN:
                with contextlib.suppress(redis.RedisError):
                    self._release(keys=[self._k(key)], args=[int(short.reply[1]), claim_id])
            raise
        raw, token, now, value = reply
        if raw == REPLY_CORRUPT:
            self._decode(key, value)  # raises CorruptRecord saying what is wrong with it
            raise self._unreadable(key, value)  # pragma: no cover - the script and _decode agree
        status = _STATUSES.get(raw) or ClaimStatus(raw.decode())
        record = self._decode(key, value) if value is not None else None
        return Claim(status, int(token), record, int(now) / 1000,
                     claim_id if status.holds else "")

    def record(
        self, key: str, token: int, *, state: State, content_type: str, data: bytes, ttl: float,
        claim_id: str | None = None,
    ) -> None:
        code = _STATE_CODE.get(state)
        if code is None:
            raise ValueError(f"record() takes DONE or FAILED, not {state}")
        try:
            reply = self._run(
                self._record, key,
                [token, code, _content_code(content_type), data, _ms(ttl), claim_id or ""],
            )
        except _REDIS_ERRORS as exc:
            raise _translated(self, key, exc) from exc
        if reply != REPLY_OK:
            self._check_fence(reply, key, token, "record")

    def record_with(
        self, key: str, token: int, *, state: State, content_type: str, data: bytes, ttl: float,
        also: BackendWrite, claim_id: str | None = None,
    ) -> bool:
        """Record, and write ``also`` (SET + PUBLISH) in the same script, only if the fence holds.

        Returns whether ``also`` was written. The caller must know that ``also.key`` lives on
        this store's server and database (the task checks the backend's connection is this).
        """
        code = _STATE_CODE.get(state)
        if code is None:
            raise ValueError(f"record() takes DONE or FAILED, not {state}")
        if self._fold_refused:
            self.record(key, token, state=state, content_type=content_type, data=data, ttl=ttl,
                        claim_id=claim_id)
            return False
        args = [token, code, _content_code(content_type), data, _ms(ttl), claim_id or "",
                also.value, max(0, also.expires)]
        try:
            reply = self._run(self._record, key, args, other=also.key)
        except redis.exceptions.NoPermissionError:
            # The store's user may not touch the backend's key (an ACL): nothing was run. Record
            # alone, now and from now on; the backend writes its result itself.
            self._fold_refused = True
            self.record(key, token, state=state, content_type=content_type, data=data, ttl=ttl,
                        claim_id=claim_id)
            return False
        except _REDIS_ERRORS as exc:
            raise _translated(self, key, exc) from exc
        if reply == REPLY_OK:
            return True
        if reply != REPLY_OK_NOMETA:  # recorded; the backend writes its meta itself
            self._check_fence(reply, key, token, "record")
        return False

    def release(self, key: str, token: int, *, claim_id: str | None = None) -> None:
        with _translate_errors(self, key):
            reply = self._run(self._release, key, [token, claim_id or ""])
        self._check_fence(reply, key, token, "release")

    def renew(self, key: str, token: int, lease: float, *, claim_id: str | None = None) -> float:
        with _translate_errors(self, key):
            reply = self._run(self._renew, key, [token, _ms(lease), claim_id or ""])
        if isinstance(reply, int):
            return float(reply) / 1000
        self._check_fence(reply, key, token, "renew")
        raise AssertionError("unreachable")  # pragma: no cover - _check_fence raised

    # -- reservations --------------------------------------------------------------------------

    reserves: ClassVar[bool] = True

    def reserve(
        self, key: str, task_id: str, lease: float, fingerprint: str | None = None
    ) -> Record | Reservation | None:
        if "\0" in task_id or (fingerprint and "\0" in fingerprint):
            _refuse_nul(task_id=task_id, fingerprint=fingerprint or "")
        name = self._k(key)
        args: list[Any] = [task_id, fingerprint or "", max(_ms(lease), 1)]
        with _translate_errors(self, key):
            if self.wait_replicas:
                # Not through _run's WAIT: a reservation needs no replica's confirmation
                # (losing one only lets a copy be published, which the claim sorts out).
                reply = self._reserve(keys=[name, name + RESERVED], args=args)
            else:
                reply = self._run(self._reserve, key, args, other=name + RESERVED)
        if reply is None:
            return None
        if isinstance(reply, list):
            return _reservation(reply[0])
        return self._decode(key, reply)

    def reservation(self, key: str) -> Reservation | None:
        with _translate_errors(self, key):
            value = self.client.get(self._k(key) + RESERVED)
        return _reservation(value) if value else None  # b"": dropped (unreserve.lua)

    def unreserve(self, key: str, task_id: str) -> None:
        with _translate_errors(self, key):
            self._unreserve(keys=[self._k(key) + RESERVED], args=[task_id])

    def get(self, key: str) -> Record | None:
        # The producer's read (the enqueue check): a plain try, as claim and record do.
        try:
            if self._wire is not None:
                value: bytes | None = self._wire.call(pack(("GET", self._k(key))))
            else:
                value = self.client.get(self._k(key))  # type: ignore[assignment, unused-ignore]
        except _REDIS_ERRORS as exc:
            raise _translated(self, key, exc) from exc
        return None if value is None else self._decode(key, value)

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
                    pipe.get(name)
                rows = pipe.execute(raise_on_error=False)
            for name, value in zip(names, rows, strict=True):
                if not isinstance(value, bytes) or value[:1] != _MARK:
                    # A foreign key under our prefix (another type: WRONGTYPE; a string without
                    # the marker), or one that expired between the calls.
                    continue
                rec = self._decode(self._key_of(name), value)
                if state is None or rec.state is state:
                    yield rec

    def forget(self, key: str, token: int) -> None:
        with _translate_errors(self, key):
            reply = self._run(self._forget, key, [token])
        self._check_fence(reply, key, token, "forget")

    def expires_at(self, key: str) -> float | None:
        # PTTL and TIME from the server that holds the key, so the expiry is on its clock.
        with _translate_errors(self, key):
            pipe = self._node(self._k(key)).pipeline(transaction=False)
            pipe.pttl(self._k(key))
            pipe.time()
            ttl_ms, (seconds, micros) = pipe.execute()
        if ttl_ms < 0:  # -2: no key; -1: no TTL (not written by celery_idem)
            return None
        return float(seconds) + float(micros) / 1e6 + float(ttl_ms) / 1000

    def now(self) -> float:
        with _translate_errors(self):
            seconds, micros = self.client.time()
        return float(seconds) + float(micros) / 1e6

    def check_durability(self) -> list[DurabilityFinding]:
        """Read ``appendonly``, ``appendfsync`` and ``maxmemory-policy`` (``CONFIG GET``).

        Returns:
            A WARNING finding per setting that can lose records; one INFO finding instead when
            the server refuses ``CONFIG`` (a managed Redis, a renamed command, an ACL user
            without ``+config|get``).

        Raises:
            StoreUnavailable: The server could not be reached.
        """
        findings: list[DurabilityFinding] = []
        for client, where in self._config_clients():
            try:
                settings = config_get(client, DURABILITY_SETTINGS)
            except redis.ResponseError as exc:  # NoPermissionError is one too
                return [DurabilityFinding(
                    "CONFIG", None,
                    f"the Redis store at {where} does not allow CONFIG GET ({exc}), so celery_idem "
                    f"cannot check that it keeps records; make sure it persists them (AOF, "
                    f"appendfsync everysec) and never evicts them (maxmemory-policy noeviction)",
                    logging.INFO,
                )]
            except _REDIS_ERRORS as exc:
                raise _translated(self, None, exc) from exc
            findings.extend(durability_findings(settings, where))
        return findings

    def _config_clients(self) -> list[tuple[Any, str]]:
        """The servers whose settings decide durability, with their names for messages."""
        return [(self.client, self.location)]

    def close(self) -> None:
        if self._wire is not None:
            self._wire.close()
        self.client.close()

    # -- helpers -------------------------------------------------------------------------------

    def _check_fence(self, reply: Any, key: str, token: int, verb: str) -> None:
        if reply == REPLY_OK:
            return
        if reply == REPLY_CORRUPT:
            raise self._unreadable(key, None)
        detail = reply.decode() if isinstance(reply, bytes) else repr(reply)
        if detail == REPLY_MISSING:
            why = "the record is gone (expired, removed by an operator, or lost by the server)"
        else:
            verdict, code, current = detail.split(":", 2)
            state = _STATE_OF.get(ord(code[:1] or "?"))
            why = f"the record is {state.value if state else code} with token {current}"
            if verdict == REPLY_REISSUED:
                why += " of another claim (the token was issued again after the store lost data)"
        raise LeaseLost(f"{verb} of {key!r} with token {token} refused: {why}", key=key, token=token)

    def _unreadable(self, key: str, value: bytes | None, why: str = "") -> CorruptRecord:
        """The error for a value under ``key`` that is not a readable record (left as it is).

        The value itself stays out of the message: it may be another program's data.
        """
        foreign = "another program wrote it, the prefix is shared, or an older celery_idem wrote it"
        if value is None:  # a script's verdict: not a record, or a damaged one
            what = f"is not a celery_idem record, or a damaged one ({foreign})"
        elif value[:1] == _MARK:
            what = f"is a damaged celery_idem record{f' ({why})' if why else ''}"
        else:
            what = f"is not a celery_idem record ({foreign})"
        return CorruptRecord(f"the Redis key {self._k(key)} {what}", key=key)

    def _decode(self, key: str, value: bytes) -> Record:
        """A stored record (see the module docstring) -> Record."""
        if value[:1] != _MARK:
            raise self._unreadable(key, value)
        try:
            state = _STATE_OF.get(value[1])
            if state is None:
                raise ValueError(f"unknown state {value[1:2]!r}")
            if state is State.DONE or state is State.FAILED:
                head, u, i, h, c, d = value.split(b"\0", 5)
                token, _, claim_id = head[2:].partition(b".")
                return Record(
                    key=key, state=state, token=int(token), task_id=_unpack_task_id(i),
                    payload_hash=h.decode() or None,
                    content_type=_CONTENT_TYPE_OF.get(c) or c.decode() or None,
                    data=d, updated=int(u) / 1000, claim_id=claim_id.decode(),
                )
            if state is State.IN_PROGRESS:
                head, u, i, h, o, a, lease = value.split(b"\0")
                token, _, claim_id = head[2:].partition(b".")
                return Record(
                    key=key, state=state, token=int(token), owner=o.decode(),
                    task_id=_unpack_task_id(i), attempt=int(a), lease_expires=int(lease) / 1000,
                    payload_hash=h.decode() or None, updated=int(u) / 1000,
                    claim_id=claim_id.decode(),
                )
            if state is State.RELEASED:
                head, u, _, _, tail = value.split(b"\0")
                if tail:
                    raise ValueError("a released record has no tail")
                return Record(key=key, state=state, token=int(head[2:]), updated=int(u) / 1000)
        except (ValueError, IndexError, UnicodeDecodeError) as exc:
            raise self._unreadable(key, value, str(exc) or type(exc).__name__) from exc


class _NotReplicated(StoreUnavailable):
    """A write the master made but too few replicas confirmed (``wait_replicas``)."""

    def __init__(self, message: str, reply: Any) -> None:
        super().__init__(message)
        self.reply = reply


def store_options(options: dict[str, Any]) -> dict[str, Any]:
    """Take the store's own settings out of ``options`` (the rest go to the client)."""
    return {name: options.pop(name) for name in ("wait_replicas", "wait_timeout") if name in options}


def _ms(seconds: float) -> int:
    return max(1, int(seconds * 1000))


def _reservation(value: bytes | str) -> Reservation:
    task_id, _, fingerprint = text(value).partition("\0")
    return Reservation(task_id, fingerprint or None)
