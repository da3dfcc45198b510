"""Redis store (``redis://``, ``rediss://``, ``unix://``): one Lua script per verb.

Each record is one string at ``<prefix><key>`` (:mod:`celery_idem.stores.redis_format`). Each
script reads the server clock (``TIME``), so lease expiry never depends on worker clocks. Redis
needs persistence (AOF, ``appendfsync everysec`` or better) for records to survive a restart;
:meth:`RedisStore.check_durability` reads those settings at worker start (docs/stores.md).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import re
from collections.abc import Iterator
from importlib import resources
from typing import TYPE_CHECKING, Any, ClassVar

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from ..config import DEFAULT_PREFIX
from ..exceptions import CorruptRecord, ImproperlyConfigured, LeaseLost, StoreUnavailable
from ..records import Claim, ClaimStatus, Record, Reservation, State
from .base import BackendWrite, DurabilityFinding, Store, new_claim_id
from .redis_durability import config_get, durability_findings, text
from .redis_format import (
    MARK,
    STATE_CODE,
    STATE_OF,
    content_code,
    decode,
    pack_task_id,
    refuse_nul,
    unreadable,
)
from .redis_intents import SCRIPTS as INTENT_SCRIPTS
from .redis_intents import RedisIntents

if TYPE_CHECKING:
    from .redis_wire import WireScripts

__all__ = ["CLIENT_DEFAULTS", "REDIS_ERRORS", "RedisStore", "Scripts", "same_server", "store_options"]

#: Client defaults: fail fast instead of hanging a worker when the store is down. No automatic
#: retries inside redis-py: the gate decides what to retry (a blind retry of a claim whose reply
#: was lost would find its own claim and report it as busy).
CLIENT_DEFAULTS: dict[str, Any] = {"socket_timeout": 5.0, "socket_connect_timeout": 3.0,
                                   "health_check_interval": 30}


#: A claim script's status reply -> ClaimStatus, without an Enum lookup per claim.
_STATUSES = {status.value.encode(): status for status in ClaimStatus}

#: The scripts' replies: REPLY_OK, a refusal (``fenced:<state>:<token>``, ``reissued:...``),
#: REPLY_MISSING; REPLY_CORRUPT for a value that is not a record; record.lua REPLY_OK_NOMETA
#: when the backend's meta write was refused (recorded all the same).
REPLY_OK = b"ok"
REPLY_OK_NOMETA = b"ok:nometa"
REPLY_CORRUPT = b"corrupt"
REPLY_MISSING = "missing"
REPLY_REISSUED = "reissued"


def _load(name: str) -> str:
    """The script ``<name>.lua`` as registered: a verb's after the record parsing (``_record.lua``)."""
    lua = resources.files(__package__).joinpath("lua")
    head = lua.joinpath("_record.lua").read_text("utf-8") if name in _RECORD_SCRIPTS else ""
    return head + lua.joinpath(f"{name}.lua").read_text("utf-8")


#: After a record's name, names its reservation (``Store.reserve``): under the store's prefix
#: (for ACLs), on the record's cluster slot, and never a record's name (a key is printable).
RESERVED = "\x1freserved"


#: Every error redis-py raises (RedisClusterException, no cluster node answers, is not a RedisError).
REDIS_ERRORS = (redis.RedisError, redis.exceptions.RedisClusterException)


class _translate_errors:
    """Map redis-py errors to the contract's (a class, not a generator: on every verb's path)."""

    __slots__ = ("key", "store")

    def __init__(self, store: RedisStore, key: str | None = None) -> None:
        self.store, self.key = store, key

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        if exc is None or not isinstance(exc, REDIS_ERRORS):
            return  # not redis-py's (StoreUnavailable from run_script, say)
        store, key = self.store, self.key
        if isinstance(exc, redis.ResponseError):
            if str(exc).startswith("WRONGTYPE"):
                raise CorruptRecord(
                    f"the Redis key {store.prefix}{key} is not a celery_idem record (another "
                    f"program wrote it, the prefix is shared, or an older celery_idem wrote it "
                    f"as a hash): {exc}", key=key) from exc
            raise StoreUnavailable(f"the Redis store at {store.location} refused: {exc}") from exc
        if isinstance(exc, (redis.ConnectionError, redis.TimeoutError)):
            raise StoreUnavailable(
                f"could not reach the Redis store at {store.location}: {exc}") from exc
        raise StoreUnavailable(f"the Redis store at {store.location} failed: {exc}") from exc


#: The scripts (celery_idem/stores/lua/<name>.lua): the verbs' parse records, the reservations' not.
_RECORD_SCRIPTS = ("claim", "record", "release", "renew", "forget")
_PLAIN_SCRIPTS = ("reserve", "unreserve")


class Scripts:
    """The plain path: redis-py's ``Script`` objects (``EVALSHA``; after NOSCRIPT, load and again)."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.registered: dict[str, Any] = {
            name: client.register_script(_load(name)) for name in (*_RECORD_SCRIPTS, *_PLAIN_SCRIPTS)}
        self.registered.update((name, client.register_script(lua)) for name, lua in INTENT_SCRIPTS.items())

    def run(self, name: str, keys: tuple[str, ...], args: list[Any]) -> Any:
        return self.registered[name](keys=keys, args=args)

    def get(self, name: str) -> bytes | None:
        return self.client.get(name)  # type: ignore[no-any-return]

    def close(self) -> None:
        return None


class RedisStore(RedisIntents, Store):
    """Idempotency records in Redis, one Lua script (one round trip) per verb.

    Args:
        client: A ``redis.Redis`` client (``decode_responses`` must be False).
        prefix: Prepended to every key.
        wait_replicas: After each write, ``WAIT`` until this many replicas have it, so a
            failover cannot lose an acknowledged write (0: no wait; docs/redis-cluster.md).
        wait_timeout: Seconds ``WAIT`` may take; fewer replicas by then raises ``StoreUnavailable``.
        location: Where the store is, for messages (default: host:port/db of ``client``).
        accelerate: Send the verbs through :mod:`celery_idem.stores.redis_wire` when the client
            allows it (an app passes its acceleration switch; False: redis-py's own path).

    A store for another Redis deployment (Cluster, Sentinel) subclasses this one and overrides
    :meth:`name_of`, :meth:`key_of`, :meth:`client_for`, :meth:`servers`, :meth:`run_script`.
    """

    accelerates: ClassVar[bool] = True

    def __init__(self, client: redis.Redis, prefix: str = DEFAULT_PREFIX, *, wait_replicas: int = 0,
                 wait_timeout: float = 1.0, location: str | None = None, accelerate: bool = True) -> None:
        super().__init__(prefix)
        if not isinstance(wait_replicas, int) or isinstance(wait_replicas, bool) or wait_replicas < 0:
            raise ImproperlyConfigured(
                f"wait_replicas must be an int >= 0 (replicas to confirm each write), got {wait_replicas!r}")
        if not isinstance(wait_timeout, (int, float)) or wait_timeout <= 0:
            raise ImproperlyConfigured(
                f"wait_timeout must be a number of seconds > 0, got {wait_timeout!r}")
        self.client = client
        self._fold_refused = False  # record_with: the server refused the backend's key once
        self.wait_replicas = wait_replicas
        self.wait_timeout = float(wait_timeout)
        if location is None:
            kwargs = client.connection_pool.connection_kwargs
            where = kwargs.get("path") or f"{kwargs.get('host', '?')}:{kwargs.get('port', '?')}"
            location = f"{where}/{kwargs.get('db', 0)}"
        self.location = location
        self.accelerated = accelerate is not False
        # The seam where commands go to the server: redis-py's Script objects, or the same
        # commands over the wire (a plain client only: not Sentinel, Cluster, retries, RESP3).
        plain = Scripts(client)
        self._scripts: Scripts | WireScripts = plain
        if self.accelerated:
            from .redis_wire import wire_scripts

            self._scripts = wire_scripts(plain) or plain

    @classmethod
    def from_url(cls, url: str, *, prefix: str = DEFAULT_PREFIX, **options: Any) -> RedisStore:
        """Build a store from a Redis URL; ``options`` go to ``redis.Redis.from_url`` but the
        store's own ``wait_replicas``, ``wait_timeout`` and ``accelerate``."""
        store_opts = store_options(options)
        opts = {**CLIENT_DEFAULTS, **options}
        opts.setdefault("retry", Retry(NoBackoff(), 0))
        client = redis.Redis.from_url(url, **opts)
        return cls(client, prefix=prefix, **store_opts)

    # -- where a record lives and how a script reaches it (overridden for Cluster, Sentinel) ----

    def name_of(self, key: str) -> str:
        """The Redis key that holds the record of ``key``: ``<prefix><key>``."""
        return self.prefix + key

    def key_of(self, name: bytes | str) -> str:
        """The idempotency key whose record is at the Redis key ``name`` (see :meth:`name_of`)."""
        return text(name)[len(self.prefix):]

    def client_for(self, name: str) -> redis.Redis:
        """The client of the server that holds the Redis key ``name``."""
        return self.client

    def servers(self) -> list[tuple[Any, str]]:
        """The servers that hold records, as (client, name for messages); read by check_durability."""
        return [(self.client, self.location)]

    def run_script(self, name: str, key: str, args: list[Any], other: str | None = None) -> Any:
        """Run the Lua script ``name`` (``stores/lua/<name>.lua``) on the record of ``key`` and
        ``other``, a second Redis key it writes (the result backend's, the reservation's).
        redis-py's errors are raised as they are: the verb maps them.

        Returns:
            The script's reply, once ``wait_replicas`` replicas confirmed what it wrote.

        Raises:
            StoreUnavailable: Too few replicas confirmed the write within ``wait_timeout``.
        """
        record = self.name_of(key)
        keys = (record,) if other is None else (record, other)
        if not self.wait_replicas:
            return self._scripts.run(name, keys, args)
        script = self._scripts.registered[name]
        # WAIT counts the replicas that have every write made *on this connection*, so the
        # script and the WAIT go down one connection, pipelined (still one network exchange).
        node = self.client_for(record)
        for _ in range(2):
            pipe = node.pipeline(transaction=False)
            pipe.evalsha(script.sha, len(keys), *keys, *args)
            pipe.execute_command(  # type: ignore[no-untyped-call, unused-ignore]
                "WAIT", self.wait_replicas, _ms(self.wait_timeout))
            # raise_on_error=False: a raised pipeline error has its message rewritten, which
            # would hide a WRONGTYPE (a foreign key: CorruptRecord) from _translate_errors.
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
                    f"the Redis store at {self.location} wrote {record} but only {acked} of "
                    f"{self.wait_replicas} replicas confirmed it within {self.wait_timeout:g} s "
                    f"(wait_replicas): not known to survive a failover", reply)
            return reply
        raise StoreUnavailable(f"the Redis store at {self.location} keeps losing its scripts")

    def _errors(self, key: str | None = None) -> _translate_errors:
        return _translate_errors(self, key)

    # -- verbs ---------------------------------------------------------------------------------

    def claim(self, key: str, *, owner: str, task_id: str, attempt: int, lease: float, ttl: float,
              payload_hash: str | None = None) -> Claim:
        if "\0" in owner or "\0" in task_id or (payload_hash and "\0" in payload_hash):
            refuse_nul(owner=owner, task_id=task_id, payload_hash=payload_hash or "")
        claim_id = new_claim_id()
        args: list[str | int] = [owner, pack_task_id(task_id), attempt, _ms(lease), _ms(ttl),
                                 payload_hash or "", claim_id]
        try:
            with _translate_errors(self, key):
                reply = self.run_script("claim", key, args)
        except _NotReplicated as short:
            # The claim is on the master only. Give it back (best effort, no WAIT) so the
            # re-queued message can claim again at once instead of finding it busy for a lease.
            status = _STATUSES.get(short.reply[0])
            if status is not None and status.holds:
                with contextlib.suppress(redis.RedisError):
                    self._scripts.run("release", (self.name_of(key),), [int(short.reply[1]), claim_id])
            raise
        raw, token, now, value = reply
        if raw == REPLY_CORRUPT:
            self._decode(key, value)  # raises CorruptRecord saying what is wrong with it
            raise unreadable(self.name_of(key), key, value)  # pragma: no cover - the script and _decode agree
        status = _STATUSES.get(raw) or ClaimStatus(raw.decode())
        record = self._decode(key, value) if value is not None else None
        return Claim(status, int(token), record, int(now) / 1000,
                     claim_id if status.holds else "")

    def record(self, key: str, token: int, *, state: State, content_type: str, data: bytes, ttl: float,
               claim_id: str | None = None) -> None:
        self._fenced("record", key, token, _record_args(token, state, content_type, data, ttl, claim_id))

    def record_with(self, key: str, token: int, *, state: State, content_type: str, data: bytes, ttl: float,
                    also: BackendWrite, claim_id: str | None = None) -> bool:
        """:meth:`Store.record_with` in the record's script (``also``: SET + PUBLISH). The caller
        knows ``also.key`` is on this store's server and database (``same_server``)."""
        args = _record_args(token, state, content_type, data, ttl, claim_id)
        reply = None
        if not self._fold_refused:
            args += [also.value, max(0, also.expires)]
            with _translate_errors(self, key):
                try:
                    reply = self.run_script("record", key, args, other=also.key)
                except redis.exceptions.NoPermissionError:
                    # An ACL keeps the store's user off the backend's key: nothing was run.
                    # Record alone, now and from now on; the backend writes its result itself.
                    self._fold_refused = True
        if reply is None:
            self.record(key, token, state=state, content_type=content_type, data=data, ttl=ttl,
                        claim_id=claim_id)
            return False
        if reply == REPLY_OK:
            return True
        if reply != REPLY_OK_NOMETA:  # recorded; the backend writes its meta itself
            raise self._refused(reply, key, token, "record")
        return False

    def release(self, key: str, token: int, *, claim_id: str | None = None) -> None:
        self._fenced("release", key, token, [token, claim_id or ""])

    def renew(self, key: str, token: int, lease: float, *, claim_id: str | None = None) -> float:
        with _translate_errors(self, key):
            reply = self.run_script("renew", key, [token, _ms(lease), claim_id or ""])
        if isinstance(reply, int):
            return float(reply) / 1000
        raise self._refused(reply, key, token, "renew")

    # -- reservations --------------------------------------------------------------------------

    reserves: ClassVar[bool] = True

    def reserve(self, key: str, task_id: str, lease: float,
                fingerprint: str | None = None) -> Record | Reservation | None:
        if "\0" in task_id or (fingerprint and "\0" in fingerprint):
            refuse_nul(task_id=task_id, fingerprint=fingerprint or "")
        name = self.name_of(key)
        args: list[Any] = [task_id, fingerprint or "", max(_ms(lease), 1)]
        with _translate_errors(self, key):
            if self.wait_replicas:
                # No WAIT: losing a reservation only lets a copy be published (the claim decides).
                reply = self._scripts.run("reserve", (name, name + RESERVED), args)
            else:
                reply = self.run_script("reserve", key, args, other=name + RESERVED)
        if reply is None:
            return None
        if isinstance(reply, list):
            return _reservation(reply[0])
        return self._decode(key, reply)

    def reservation(self, key: str) -> Reservation | None:
        with _translate_errors(self, key):
            value = self.client.get(self.name_of(key) + RESERVED)
        return _reservation(value) if value else None  # b"": dropped (unreserve.lua)

    def unreserve(self, key: str, task_id: str) -> None:
        with _translate_errors(self, key):
            self._scripts.run("unreserve", (self.name_of(key) + RESERVED,), [task_id])

    def get(self, key: str) -> Record | None:
        # The producer's read (the enqueue check): through the scripts' seam, as the verbs.
        with _translate_errors(self, key):
            value = self._scripts.get(self.name_of(key))
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
                if not isinstance(value, bytes) or value[:1] != MARK:
                    # A foreign key under our prefix (another type: WRONGTYPE; a string without
                    # the marker), or one that expired between the calls.
                    continue
                rec = self._decode(self.key_of(name), value)
                if state is None or rec.state is state:
                    yield rec

    def forget(self, key: str, token: int) -> None:
        self._fenced("forget", key, token, [token])

    def expires_at(self, key: str) -> float | None:
        # PTTL and TIME from the server that holds the key, so the expiry is on its clock.
        with _translate_errors(self, key):
            pipe = self.client_for(self.name_of(key)).pipeline(transaction=False)
            pipe.pttl(self.name_of(key))
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
        """Each server's ``appendonly``, ``appendfsync`` and ``maxmemory-policy`` (``CONFIG GET``);
        one INFO finding instead when a server refuses ``CONFIG`` (a managed Redis, an ACL user)."""
        findings: list[DurabilityFinding] = []
        for client, where in self.servers():
            with _translate_errors(self):
                try:
                    settings = config_get(client)
                except redis.ResponseError as exc:  # NoPermissionError is one too
                    return [DurabilityFinding(
                        "CONFIG", None, f"the Redis store at {where} does not allow CONFIG GET "
                        f"({exc}), so celery_idem cannot check that it keeps records; make sure it "
                        f"persists them (AOF, appendfsync everysec) and never evicts them "
                        f"(maxmemory-policy noeviction)", logging.INFO)]
            findings.extend(durability_findings(settings, where))
        return findings

    def close(self) -> None:
        self._scripts.close()
        self.client.close()

    # -- helpers -------------------------------------------------------------------------------

    def _fenced(self, verb: str, key: str, token: int, args: list[Any]) -> None:
        """Run the script of a fenced ``verb`` (record, release, forget) that replies ``ok``."""
        with _translate_errors(self, key):
            reply = self.run_script(verb, key, args)
        if reply != REPLY_OK:
            raise self._refused(reply, key, token, verb)

    def _refused(self, reply: Any, key: str, token: int, verb: str) -> CorruptRecord | LeaseLost:
        if reply == REPLY_CORRUPT:
            return unreadable(self.name_of(key), key, None)
        detail = reply.decode() if isinstance(reply, bytes) else repr(reply)
        if detail == REPLY_MISSING:
            why = "the record is gone (expired, removed by an operator, or lost by the server)"
        else:
            verdict, code, current = detail.split(":", 2)
            state = STATE_OF.get(ord(code[:1] or "?"))
            why = f"the record is {state.value if state else code} with token {current}"
            if verdict == REPLY_REISSUED:
                why += " of another claim (the token was issued again after the store lost data)"
        return LeaseLost(f"{verb} of {key!r} with token {token} refused: {why}", key=key, token=token)

    def _decode(self, key: str, value: bytes) -> Record:
        return decode(self.name_of(key), key, value)


class _NotReplicated(StoreUnavailable):
    """A write the master made but too few replicas confirmed (``wait_replicas``)."""

    def __init__(self, message: str, reply: Any) -> None:
        super().__init__(message)
        self.reply = reply


def store_options(options: dict[str, Any]) -> dict[str, Any]:
    """Take the store's own settings out of ``options`` (the rest go to the client)."""
    return {name: options.pop(name) for name in ("wait_replicas", "wait_timeout", "accelerate")
            if name in options}


def _record_args(token: int, state: State, content_type: str, data: bytes, ttl: float,
                 claim_id: str | None) -> list[Any]:
    code = STATE_CODE.get(state)
    if code is None:
        raise ValueError(f"record() takes DONE or FAILED, not {state}")
    return [token, code, content_code(content_type), data, _ms(ttl), claim_id or ""]


def _ms(seconds: float) -> int:
    return max(1, int(seconds * 1000))


def _reservation(value: bytes | str) -> Reservation:
    task_id, _, fingerprint = text(value).partition("\0")
    return Reservation(task_id, fingerprint or None)


#: Connection settings that must be equal for two clients to reach one server, one database,
#: as one user (a script runs with its connection's permissions).
_SAME_SERVER = ("host", "port", "db", "path", "username", "password")


def same_server(a: Any, b: Any, *, db: bool = True) -> bool:
    """Whether redis-py clients ``a`` and ``b`` talk to the same server and, unless ``db`` is
    False, database (their connection classes compared by kind: kombu's Redis transport
    subclasses its own)."""
    pa, pb = a.connection_pool, b.connection_pool
    for kind in (redis.SSLConnection, redis.UnixDomainSocketConnection):
        if issubclass(pa.connection_class, kind) != issubclass(pb.connection_class, kind):
            return False  # TLS on one side only, say
    ka, kb = pa.connection_kwargs, pb.connection_kwargs
    return all(ka.get(name) == kb.get(name) for name in _SAME_SERVER if db or name != "db")
