"""Redis Cluster (``redis+cluster://``) and Redis Sentinel (``sentinel://``) stores.

An add-on: ``store_from_url`` loads it by name for these schemes, so nothing of
``redis.cluster`` is imported before one is asked for. Both stores are
:class:`~celery_idem.stores.redis.RedisStore` with another client: the same Lua scripts, record
layout and fencing. What differs is how a key finds its server (RedisStore's ``name_of``,
``client_for``, ``servers`` and ``run_script``, overridden here):

* **Cluster**: every record is named ``<prefix>{<key>}``: the hash tag puts the record and any
  key derived from it (its reservation) on one slot, while records spread over the masters.
* **Sentinel**: the client asks the sentinels for the current master of ``master_name`` on
  every new connection, so after a failover the next call reaches the promoted replica.

Redis replicates asynchronously, so a failover can lose a write the old master acknowledged:
both stores wait for one replica by default (``wait_replicas=1``, see docs/redis-cluster.md).
``wait_replicas=0`` accepts that loss; the worker warns at start.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping
from typing import Any, ClassVar
from urllib.parse import parse_qsl, unquote, urlencode

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.connection import parse_url
from redis.retry import Retry
from redis.sentinel import Sentinel

from ..config import DEFAULT_PREFIX
from ..exceptions import ImproperlyConfigured, StoreUnavailable
from ..stores.base import DurabilityFinding, Store
from ..stores.redis import CLIENT_DEFAULTS, REDIS_ERRORS, RedisStore, store_options
from ..stores.redis_durability import config_get, durability_findings, text

__all__ = ["RedisClusterStore", "RedisSentinelStore"]

#: Replicas each write waits for unless the store is told otherwise (see the module doc).
DEFAULT_WAIT_REPLICAS = 1

def _split_hosts(url: str, scheme_hint: str) -> tuple[str, str, list[tuple[str, int]], str, str]:
    """``scheme://[auth@]h1:p1,h2:p2[/path][?query]`` -> (scheme, auth, hosts, path, query)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise ImproperlyConfigured(f"{scheme_hint} URL needs '://': {url!r}")
    rest, _, query = rest.partition("?")
    netloc, _, path = rest.partition("/")
    auth, _, hostlist = netloc.rpartition("@")
    hosts: list[tuple[str, int]] = []
    for item in hostlist.split(","):
        host, _, port = item.strip().rpartition(":")
        if not host or not port.isdigit():
            raise ImproperlyConfigured(
                f"{scheme_hint} URL {url.split('@')[-1]!r}: each node must be host:port, got "
                f"{item!r}"
            )
        hosts.append((host.strip("[]"), int(port)))
    return scheme.lower(), auth, hosts, path, query


def _client_kwargs(auth: str, path: str, query: str, tls: bool) -> dict[str, Any]:
    """Typed client settings from the URL's auth, path (db) and query, via redis-py's parser."""
    scheme = "rediss" if tls else "redis"
    auth_part = f"{auth}@" if auth else ""
    kwargs: dict[str, Any] = parse_url(  # type: ignore[no-untyped-call, unused-ignore]
        f"{scheme}://{auth_part}localhost:1/{path}?{query}")
    for name in ("host", "port", "connection_class"):
        kwargs.pop(name, None)
    if tls:
        kwargs["ssl"] = True
    return kwargs


class _Replicated(RedisStore):
    """What both stores check of their replicas: a failover promotes one."""

    def _replica_clients(self) -> list[tuple[Any, str]]:
        raise NotImplementedError

    def _unlisted(self) -> str:
        """Why no replica's settings were read when the replicas cannot be listed."""
        raise NotImplementedError

    def check_durability(self) -> list[DurabilityFinding]:
        """The masters' settings, every replica's (a failover promotes one), and ``wait_replicas``.

        Raises:
            StoreUnavailable: No master could be reached.
        """
        findings = super().check_durability()
        try:
            replicas = self._replica_clients()
        except REDIS_ERRORS as exc:
            return [*findings, DurabilityFinding(
                "replicas", None, f"{self._unlisted()} ({exc}), so their settings were not checked",
                logging.INFO), *_wait_findings(self)]
        try:
            return [*findings, *_replica_findings(replicas), *_wait_findings(self)]
        finally:
            for client, _ in replicas:
                client.close()

    def replication_warnings(self) -> list[str]:
        """A warning per master with fewer connected replicas than ``wait_replicas`` (read at
        worker start)."""
        if not self.wait_replicas:
            return []
        lines: list[str] = []
        for client, where in self.servers():
            try:
                connected = int(client.info("replication").get("connected_slaves", 0))
            except REDIS_ERRORS as exc:
                raise StoreUnavailable(f"could not read the replication of {where}: {exc}") from exc
            if connected < self.wait_replicas:
                lines.append(
                    f"{where} has {connected} connected replica(s) and the store waits for "
                    f"{self.wait_replicas} (wait_replicas): every write waits {self.wait_timeout:g} "
                    f"s and fails, and the tasks are re-queued, until a replica connects. A "
                    f"deployment without replicas sets idempotency_store_options="
                    f"{{'wait_replicas': 0}} (a failover can then lose records)"
                )
        return lines


class RedisClusterStore(_Replicated):
    """Idempotency records in a Redis Cluster, one Lua script on one slot per verb.

    Args:
        client: A ``redis.cluster.RedisCluster`` (``decode_responses`` must be False).
        prefix: Prepended to every key (keep braces out of it: a ``{tag}`` in the prefix would
            put every record in one slot, on one master).
        wait_replicas: Replicas each write waits for (``WAIT``); 1 by default, 0 for a cluster
            without replicas. See :class:`~celery_idem.stores.redis.RedisStore`.
        wait_timeout: See :class:`~celery_idem.stores.redis.RedisStore`.

    ``now()`` reads one node's clock, while each script reads the clock of the master that owns
    its key: the masters' clocks should agree (NTP) for lease arithmetic across slots.
    """

    #: The intents' index spans every key: one slot cannot hold it.
    keeps_intents = False

    accelerates: ClassVar[bool] = False  # no wire for a cluster client

    def __init__(self, client: RedisCluster, prefix: str = DEFAULT_PREFIX, *,
                 wait_replicas: int = DEFAULT_WAIT_REPLICAS, wait_timeout: float = 1.0) -> None:
        nodes = ",".join(f"{n.host}:{n.port}" for n in client.get_primaries())  # type: ignore[no-untyped-call, unused-ignore]
        super().__init__(client, prefix, wait_replicas=wait_replicas,  # type: ignore[arg-type, unused-ignore]
                         wait_timeout=wait_timeout, location=f"cluster {nodes}")
        self.cluster = client

    @classmethod
    def from_url(cls, url: str, *, prefix: str = DEFAULT_PREFIX,
                 **options: Any) -> RedisClusterStore:
        """Build a store from ``redis+cluster://[user:password@]host:port[,host:port...][?...]``.

        The nodes are seeds: the client learns the rest of the cluster from any one of them.
        ``rediss+cluster://`` uses TLS. ``options`` go to ``RedisCluster`` (socket timeouts,
        ``ssl_ca_certs``, ...), except ``wait_replicas`` and ``wait_timeout``.

        Raises:
            ImproperlyConfigured: A malformed URL, or a database other than 0 (a cluster has one).
        """
        scheme, auth, hosts, path, query = _split_hosts(url, "a Redis Cluster")
        kwargs = _client_kwargs(auth, path, query, tls=scheme == "rediss+cluster")
        if int(kwargs.pop("db", 0) or 0) != 0:
            raise ImproperlyConfigured(
                f"a Redis Cluster has only database 0; drop '/{path}' from the store URL"
            )
        store_opts = store_options(options)
        opts = {**CLIENT_DEFAULTS, **kwargs, **options}
        # No blind retries (see CLIENT_DEFAULTS); the client still follows MOVED/ASK.
        opts.setdefault("retry", Retry(NoBackoff(), 0))
        seeds = [ClusterNode(h, p) for h, p in hosts]  # type: ignore[no-untyped-call, unused-ignore]
        try:
            # Unlike redis.Redis, RedisCluster connects at once: it needs the slot map.
            client = RedisCluster(startup_nodes=seeds, **opts)
        except REDIS_ERRORS as exc:
            raise StoreUnavailable(
                f"could not reach the Redis Cluster store at {','.join(f'{h}:{p}' for h, p in hosts)}"
                f": {exc}"
            ) from exc
        return cls(client, prefix=prefix, **store_opts)

    def name_of(self, key: str) -> str:
        """``<prefix>{<key>}``: the hash tag keeps the record and its reservation on one slot."""
        return f"{self.prefix}{{{key}}}"

    def key_of(self, name: bytes | str) -> str:
        return text(name)[len(self.prefix) + 1:-1]

    def client_for(self, name: str) -> redis.Redis:
        """The client of the master that owns the slot of ``name``."""
        node = self.cluster.get_node_from_key(name)  # type: ignore[no-untyped-call, unused-ignore]
        return self.cluster.get_redis_connection(node)

    def servers(self) -> list[tuple[Any, str]]:
        """Every master: each holds a share of the records, so each one's settings count."""
        return [
            (self.cluster.get_redis_connection(node), f"cluster master {node.host}:{node.port}")
            for node in self.cluster.get_primaries()  # type: ignore[no-untyped-call, unused-ignore]
        ]

    def _replica_clients(self) -> list[tuple[Any, str]]:
        # A failover promotes a replica, so its settings count too. redis-py's slot map lists
        # replicas only when it reads from them: ask CLUSTER NODES, connect as to the masters.
        primary = self.cluster.get_primaries()[0]  # type: ignore[no-untyped-call, unused-ignore]
        pool = self.cluster.get_redis_connection(primary).connection_pool
        raw = self.cluster.get_redis_connection(primary).execute_command("CLUSTER", "NODES")  # type: ignore[no-untyped-call, unused-ignore]
        kwargs = {k: v for k, v in pool.connection_kwargs.items()
                  if k not in ("host", "port", "redis_connect_func") and not k.startswith("orig_")}
        clients: list[tuple[Any, str]] = []
        for host, port in _cluster_replicas(text(raw) if isinstance(raw, (bytes, str)) else ""):
            node_pool = redis.ConnectionPool(connection_class=pool.connection_class, host=host,
                                             port=port, **kwargs)
            clients.append((redis.Redis(connection_pool=node_pool),
                            f"cluster replica {host}:{port}"))
        return clients

    def _unlisted(self) -> str:
        return "the cluster did not list its replicas"

    # A Celery result key hashes to another slot than the record: no script can write both.
    record_with = Store.record_with

    def run_script(self, name: str, key: str, args: list[Any], other: str | None = None) -> Any:
        """RedisStore's, after a redirection once more; a failover under way is an outage."""
        for attempt in range(2):
            try:
                return super().run_script(name, key, args, other)
            except redis.exceptions.AskError as exc:  # MovedError is one too
                # The WAIT path talks to the key's master directly, past the client's
                # redirections: during a failover or resharding the old master answers
                # MOVED/ASK without running the script. Learn the topology and try once more; a
                # second redirection is an unfinished failover (an outage, not a refusal).
                self._learn_topology()
                if attempt:
                    raise StoreUnavailable(
                        f"the Redis Cluster store at {self.location} is moving the slot of "
                        f"{key!r} (failover or resharding in progress; redirected: {exc})"
                    ) from exc
            except (redis.exceptions.ClusterDownError, redis.exceptions.TryAgainError) as exc:
                self._learn_topology()  # between two topologies: an outage, not a refusal
                raise StoreUnavailable(
                    f"the Redis Cluster store at {self.location} is failing over or resharding "
                    f"({exc})"
                ) from exc
            except (redis.ConnectionError, redis.TimeoutError, redis.ResponseError):
                if self.wait_replicas:  # the WAIT path: learn it before the gate's next try
                    self._learn_topology()
                raise
        raise AssertionError("unreachable")  # pragma: no cover - the loop returns or raises

    def _learn_topology(self) -> None:
        with contextlib.suppress(redis.RedisError):
            self.cluster.nodes_manager.initialize()

    def close(self) -> None:
        self.cluster.close()


class RedisSentinelStore(_Replicated):
    """Idempotency records in the Redis master that Sentinel names, found again after failover.

    Args:
        sentinel: A ``redis.sentinel.Sentinel``.
        master_name: The monitored master's name.
        prefix: Prepended to every key.
        wait_replicas: Replicas each write waits for (``WAIT``); 1 by default, 0 for a master
            without replicas.
        wait_timeout: See :class:`~celery_idem.stores.redis.RedisStore`.
        client_options: Keyword arguments for ``Sentinel.master_for`` (``db``, ``password``,
            socket timeouts, ...).
    """

    accelerates: ClassVar[bool] = False  # no wire for Sentinel's managed pool
    reads_transport_options: ClassVar[bool] = True  # master_name, as Celery's Sentinel backend

    def __init__(self, sentinel: Sentinel, master_name: str, prefix: str = DEFAULT_PREFIX, *,
                 wait_replicas: int = DEFAULT_WAIT_REPLICAS, wait_timeout: float = 1.0,
                 client_options: Mapping[str, Any] | None = None) -> None:
        self.sentinel = sentinel
        self.master_name = master_name
        client = sentinel.master_for(  # type: ignore[no-untyped-call, unused-ignore]
            master_name, **dict(client_options or {}))
        nodes = ",".join(
            f"{c.connection_pool.connection_kwargs.get('host')}:"
            f"{c.connection_pool.connection_kwargs.get('port')}"
            for c in sentinel.sentinels
        )
        db = client.connection_pool.connection_kwargs.get("db", 0)
        super().__init__(client, prefix, wait_replicas=wait_replicas, wait_timeout=wait_timeout,
                         location=f"sentinel master {master_name!r} (db {db}) via {nodes}")

    @classmethod
    def from_url(cls, url: str, *, prefix: str = DEFAULT_PREFIX,
                 backend_transport_options: Mapping[str, Any] | None = None,
                 **options: Any) -> RedisSentinelStore:
        """Build a store from Celery's sentinel URL.

        ``sentinel://[:password@]host:26379[/db];sentinel://host2:26379[/db][?master_name=m]``
        (or one ``host1:26379,host2:26379`` list). The first part's password and database apply
        to the master. ``master_name`` comes, first found, from ``options``, the URL, or
        ``backend_transport_options`` (the app's ``result_backend_transport_options``), as do
        ``sentinel_kwargs`` (for the connections to the sentinels) and ``min_other_sentinels``.

        Raises:
            ImproperlyConfigured: A malformed URL, or no master name anywhere.
        """
        hosts: list[tuple[str, int]] = []
        first: tuple[str, str] | None = None
        params: dict[str, str] = {}
        for chunk in filter(None, (c.strip() for c in url.split(";"))):
            scheme, auth, chunk_hosts, path, query = _split_hosts(chunk, "a Redis Sentinel")
            if scheme != "sentinel":
                raise ImproperlyConfigured(
                    f"every part of a sentinel store URL starts with sentinel://, got {scheme}://"
                )
            hosts.extend(chunk_hosts)
            if first is None:
                first = (auth, path)
            # A query may follow any part (usually the last): the first mention of a name wins.
            params = {**dict(parse_qsl(query)), **params}
        if first is None:
            raise ImproperlyConfigured(f"a Redis Sentinel URL names no sentinel: {url!r}")
        auth, path = first
        # master_name is ours, not a client setting: keep it out of redis-py's URL parser.
        url_master = params.pop("master_name", None)
        kwargs = _client_kwargs(auth, path, urlencode(params), tls=False)
        store_opts = store_options(options)
        backend = dict(backend_transport_options or {})
        master_name = options.pop("master_name", None) or url_master or backend.get("master_name")
        if not master_name:
            raise ImproperlyConfigured(
                "a sentinel:// store needs the master's name: add ?master_name=<name> to the URL, "
                "or set idempotency_store_options={'master_name': ...} or, as for Celery's "
                "result backend, result_backend_transport_options={'master_name': ...}"
            )
        sentinel_kwargs = options.pop("sentinel_kwargs", None) or backend.get("sentinel_kwargs")
        min_other = options.pop("min_other_sentinels", backend.get("min_other_sentinels", 0))
        client_opts = {**CLIENT_DEFAULTS, **kwargs, **options}
        client_opts.setdefault("retry", Retry(NoBackoff(), 0))
        sentinel_conn = {
            k: v for k, v in client_opts.items() if k in ("socket_timeout", "socket_connect_timeout")
        }
        sentinel = Sentinel(  # type: ignore[no-untyped-call, unused-ignore]
            hosts,
            min_other_sentinels=int(min_other),
            sentinel_kwargs={**sentinel_conn, **dict(sentinel_kwargs or {})},
        )
        return cls(sentinel, unquote(str(master_name)), prefix=prefix,
                   client_options=client_opts, **store_opts)

    def _replica_clients(self) -> list[tuple[Any, str]]:
        # The replicas the sentinels know, reached with the master's credentials and database.
        kwargs = self.client.connection_pool.connection_kwargs
        keep = ("username", "password", "db", "socket_timeout", "socket_connect_timeout")
        return [
            (redis.Redis(host=host, port=port, **{k: kwargs[k] for k in keep if k in kwargs}),
             f"sentinel replica {host}:{port} of {self.master_name!r}")
            for host, port in self._replica_addresses()
        ]

    def _unlisted(self) -> str:
        return f"the sentinels did not list the replicas of {self.master_name!r}"

    def _replica_addresses(self) -> list[tuple[str, int]]:
        found = self.sentinel.discover_slaves(self.master_name)  # type: ignore[no-untyped-call, unused-ignore]
        return [(text(host) if isinstance(host, (bytes, str)) else str(host), int(port))
                for host, port in found]

    def close(self) -> None:
        super().close()
        for client in self.sentinel.sentinels:
            client.close()


def _cluster_replicas(nodes: str) -> list[tuple[str, int]]:
    """The replicas in a ``CLUSTER NODES`` reply that are up, as (host, port)."""
    found: list[tuple[str, int]] = []
    for line in nodes.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        flags = set(fields[2].split(","))
        if "slave" not in flags or flags & {"fail", "fail?", "handshake", "noaddr"}:
            continue
        address = fields[1].split("@", 1)[0]  # ip:port@cport[,hostname]
        host, _, port = address.rpartition(":")
        if host and port.isdigit():
            found.append((host.strip("[]"), int(port)))
    return found


def _replica_findings(clients: list[tuple[Any, str]]) -> list[DurabilityFinding]:
    """Each replica's settings, like a master's; one that cannot be read is a note, not a stop."""
    findings: list[DurabilityFinding] = []
    for client, where in clients:
        try:
            settings = config_get(client)
        except REDIS_ERRORS as exc:
            findings.append(DurabilityFinding(
                "CONFIG", None, f"{where} could not be checked ({exc}); a failover may promote "
                f"it", logging.INFO))
            continue
        findings.extend(durability_findings(settings, where))
    return findings


def _wait_findings(store: RedisStore) -> list[DurabilityFinding]:
    """``wait_replicas=0`` on a replicated store: acknowledged writes can be lost on failover."""
    if store.wait_replicas:
        return []
    return [DurabilityFinding(
        "wait_replicas", "0",
        f"{store.location}: wait_replicas is 0, so a claim or result a master acknowledged but "
        f"had not yet sent to its replica is lost when that replica is promoted (a failover), "
        f"and the action runs again",
        fix="remove wait_replicas from idempotency_store_options (the default waits for 1 replica)",
    )]
