"""Machinery for the chaos suite: private servers, a fault-injecting TCP proxy, the ledger.

* :class:`ChaosRedis`: a private ``redis-server`` on a free port, with any extra settings
  (persistence, TLS, size limits), that a test may kill and restart on the same port.
* :class:`TcpProxy`: sits between workers and a store and cuts connections on command: before a
  matching request reaches the server (``drop_request``), or after the server executed it and
  before its reply reaches the client (``drop_reply``), or at random.
* :class:`Ledger`: the PostgreSQL tables the task bodies commit their effects to.
* :class:`Stack`: one configuration (broker, store, ledger, workers) and the test process's
  view of it.

Nothing here sleeps to synchronise: every wait polls a condition against a deadline.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import redis

import celery_idem.app as idem_app
from celery_idem.stores.redis import _load as _load_script
from tests.integration import app as app_module
from tests.integration.harness import Worker, drop_result_backend, free_port, wait_for

__all__ = [
    "ChaosRedis", "Ledger", "Rule", "Stack", "TcpProxy", "load_scripts", "lua_sha", "reset_app",
    "wait_for",
]

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"


def _lua(name: str) -> str:
    return _load_script(name)  # what the store registers (the shared prelude included)


def lua_sha(name: str) -> str:
    """The SHA1 a Redis client sends with ``EVALSHA`` for the store's ``<name>.lua``."""
    return hashlib.sha1(_lua(name).encode("utf-8")).hexdigest()


def load_scripts(client: redis.Redis) -> None:
    """``SCRIPT LOAD`` the store's scripts, as a server that served the store before has them.

    On a fresh server the first ``EVALSHA`` of a verb gets ``NOSCRIPT`` and writes nothing, so a
    fault armed on it would cut a request that had no effect.
    """
    for name in ("claim", "record", "release", "renew"):
        client.script_load(_lua(name))


def tag() -> str:
    return uuid.uuid4().hex[:10]


# -- servers ----------------------------------------------------------------------------------


class ChaosRedis:
    """A private ``redis-server``; ``args`` are extra command-line settings.

    Args:
        args: e.g. ``("--appendonly", "yes")``.
        tls: Serve TLS only (``rediss://``), with a self-signed certificate made in its dir.
    """

    def __init__(self, *args: str, tls: bool = False) -> None:
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="celery-idem-chaos-redis-"))
        self.args = list(args)
        self.tls = tls
        self.proc: subprocess.Popen[bytes] | None = None
        if tls:
            self.cert = self.dir / "cert.pem"
            self.key = self.dir / "key.pem"
            subprocess.run(
                ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                 "-keyout", str(self.key), "-out", str(self.cert), "-subj", "/CN=127.0.0.1",
                 "-addext", "subjectAltName=IP:127.0.0.1"],
                check=True, capture_output=True, timeout=60,
            )
        self.start()

    @property
    def url(self) -> str:
        return self.url_for()

    def url_for(self, user: str = "", password: str = "", db: int = 0) -> str:
        auth = f"{user}:{password}@" if user or password else ""
        if self.tls:
            return (f"rediss://{auth}127.0.0.1:{self.port}/{db}?ssl_cert_reqs=required"
                    f"&ssl_ca_certs={self.cert}")
        return f"redis://{auth}127.0.0.1:{self.port}/{db}"

    def client(self, **kwargs: Any) -> redis.Redis:
        if self.tls:
            kwargs.update(ssl=True, ssl_ca_certs=str(self.cert), ssl_cert_reqs="required")
        return redis.Redis(host="127.0.0.1", port=self.port, socket_connect_timeout=1,
                           socket_timeout=10, **kwargs)

    def start(self) -> None:
        listen = (["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", str(self.cert),
                   "--tls-key-file", str(self.key), "--tls-ca-cert-file", str(self.cert),
                   "--tls-auth-clients", "no"] if self.tls else ["--port", str(self.port)])
        self.proc = subprocess.Popen(
            [REDIS_SERVER, *listen, "--bind", "127.0.0.1", "--save", "", "--dir", str(self.dir),
             *self.args],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        client = self.client()

        def up() -> bool:
            if self.proc is not None and self.proc.poll() is not None:
                raise AssertionError(f"redis-server {self.args} exited with {self.proc.returncode}")
            try:
                return bool(client.ping())
            except redis.RedisError:
                return False

        try:
            wait_for(up, timeout=20, what=f"redis-server on {self.port}")
        except BaseException:
            self.stop()
            raise
        finally:
            client.close()

    def stop(self, sig: int = signal.SIGKILL) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(20)

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


# -- the proxy --------------------------------------------------------------------------------


class Rule:
    """Cut the connection the next ``times`` times a request contains every pattern."""

    def __init__(self, patterns: tuple[bytes, ...], mode: str, times: int,
                 exclude: tuple[bytes, ...] = ()) -> None:
        if mode not in ("drop_request", "drop_reply"):
            raise ValueError(mode)
        self.patterns = patterns
        self.exclude = exclude
        self.mode = mode
        self.remaining = times
        self.hits = 0
        self.fired = threading.Event()

    def matches(self, data: bytes) -> bool:
        return (self.remaining > 0 and all(p in data for p in self.patterns)
                and not any(p in data for p in self.exclude))


# PostgreSQL's extended protocol sends a prepared statement's SQL once, in its Parse message;
# every later run is a Bind naming it. To match a rule's SQL patterns against those runs too,
# the proxy learns each connection's psycopg statement names (``_pg3_<n>``) and their SQL.
_PG_PARSE = re.compile(rb"P.{4}(_pg3_\d+)\x00([^\x00]*)\x00", re.DOTALL)
_PG_BIND = re.compile(rb"B.{4}[^\x00]*\x00(_pg3_\d+)\x00", re.DOTALL)


class _Pipe:
    def __init__(self, client: socket.socket, upstream: socket.socket) -> None:
        self.client = client
        self.upstream = upstream
        self.blackhole = False
        self._closed = False
        self._lock = threading.Lock()
        self._statements: dict[bytes, bytes] = {}

    def request(self, data: bytes) -> bytes:
        """What rules match a request against: the bytes, plus the SQL of any prepared
        statement the request runs (PostgreSQL; nothing is added for other protocols)."""
        for name, sql in _PG_PARSE.findall(data):
            self._statements[name] = sql
        runs = [self._statements[name] for name in _PG_BIND.findall(data) if name in self._statements]
        return b"\x00".join([data, *runs])

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for s in (self.client, self.upstream):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                s.close()


class TcpProxy:
    """A TCP proxy on a free port in front of ``upstream_port`` that injects connection faults.

    ``drop_request`` closes the client's connection without forwarding the request: the server
    never sees it (what ``CLIENT KILL`` does to a command still waiting). ``drop_reply``
    forwards the request, waits for the first byte of the server's answer, discards it and
    closes both sides: the server executed the command, the client never learns the outcome.
    """

    def __init__(self, upstream_port: int, upstream_host: str = "127.0.0.1", seed: int = 0,
                 listen_host: str = "127.0.0.1") -> None:
        self.upstream = (upstream_host, upstream_port)
        self.listen_host = listen_host  # another address (a test's network namespace gateway)
        self.port = free_port()
        self.drop_rate = 0.0
        self.drops = {"drop_request": 0, "drop_reply": 0}
        self.connections = 0
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._pipes: set[_Pipe] = set()
        self._rules: list[Rule] = []
        self._listener: socket.socket | None = None
        self.up()

    # control ------------------------------------------------------------------------------

    def up(self) -> None:
        """Accept connections (again, on the same port)."""
        with self._lock:
            if self._listener is not None:
                return
            listener = socket.socket()
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((self.listen_host, self.port))
            listener.listen(128)
            self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True,
                         name=f"proxy-{self.port}").start()

    def down(self) -> None:
        """Refuse new connections (ECONNREFUSED) and cut every open one: the server is gone."""
        with self._lock:
            listener, self._listener = self._listener, None
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()
        self.cut_all()

    def cut_all(self) -> int:
        with self._lock:
            pipes = list(self._pipes)
        for pipe in pipes:
            pipe.close()
        return len(pipes)

    def arm(self, *patterns: bytes | str, mode: str = "drop_reply", times: int = 1,
            exclude: tuple[bytes | str, ...] = ()) -> Rule:
        """Cut the next ``times`` requests that contain every pattern and no ``exclude``."""

        def raw(items: tuple[bytes | str, ...]) -> tuple[bytes, ...]:
            return tuple(p.encode() if isinstance(p, str) else p for p in items)

        rule = Rule(raw(patterns), mode, times, raw(exclude))
        with self._lock:
            self._rules.append(rule)
        return rule

    def close(self) -> None:
        self.down()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    # data path ----------------------------------------------------------------------------

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.upstream, timeout=3)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            pipe = _Pipe(client, upstream)
            with self._lock:
                if self._listener is not listener:  # went down meanwhile
                    pipe.close()
                    continue
                self._pipes.add(pipe)
                self.connections += 1
            threading.Thread(target=self._forward, args=(pipe,), daemon=True).start()
            threading.Thread(target=self._backward, args=(pipe,), daemon=True).start()

    def _decide(self, data: bytes) -> str | None:
        with self._lock:
            for rule in self._rules:
                if rule.matches(data):
                    rule.remaining -= 1
                    rule.hits += 1
                    rule.fired.set()
                    self.drops[rule.mode] += 1
                    return rule.mode
            if self.drop_rate and self._rng.random() < self.drop_rate:
                mode = self._rng.choice(("drop_request", "drop_reply"))
                self.drops[mode] += 1
                return mode
        return None

    def _forward(self, pipe: _Pipe) -> None:
        try:
            while True:
                data = pipe.client.recv(65536)
                if not data:
                    return
                mode = self._decide(pipe.request(data))
                if mode == "drop_request":
                    return
                if mode == "drop_reply":
                    pipe.blackhole = True
                pipe.upstream.sendall(data)
        except OSError:
            return
        finally:
            if not pipe.blackhole:
                self._drop(pipe)

    def _backward(self, pipe: _Pipe) -> None:
        try:
            while True:
                data = pipe.upstream.recv(65536)
                if not data or pipe.blackhole:
                    return
                pipe.client.sendall(data)
        except OSError:
            return
        finally:
            self._drop(pipe)

    def _drop(self, pipe: _Pipe) -> None:
        pipe.close()
        with self._lock:
            self._pipes.discard(pipe)


# -- the ledger -------------------------------------------------------------------------------


def libpq_url(sqlalchemy_url: str) -> str:
    """``postgresql+psycopg://...`` -> ``postgresql://...`` (what psycopg.connect takes)."""
    scheme, rest = sqlalchemy_url.split("://", 1)
    return f"{scheme.split('+')[0]}://{rest}"


class Ledger:
    """The PostgreSQL tables ``<base>_ledger``, ``_remote``, ``_calls`` and ``_kills``."""

    def __init__(self, url: str, base: str | None = None) -> None:
        import psycopg

        self.url = url
        self.base = base or f"chaos_{tag()}"
        self.conn = psycopg.connect(url, autocommit=True)
        b = self.base
        now = "extract(epoch from clock_timestamp())"
        for ddl in (
            f"CREATE TABLE {b}_ledger (id bigserial PRIMARY KEY, action text NOT NULL, "
            f"idem_key text, token bigint, task_id text, retries int, pid int, "
            f"at double precision NOT NULL DEFAULT {now})",
            f"CREATE INDEX ON {b}_ledger (action)",
            f"CREATE TABLE {b}_remote (idem_key text PRIMARY KEY, action text NOT NULL, "
            f"at double precision NOT NULL DEFAULT {now})",
            f"CREATE TABLE {b}_calls (id bigserial PRIMARY KEY, action text NOT NULL, "
            f"idem_key text, token bigint, task_id text, retries int, pid int, applied bool, "
            f"tag text, at double precision NOT NULL DEFAULT {now})",
            f"CREATE INDEX ON {b}_calls (action)",
            f"CREATE TABLE {b}_kills (action text, point text, PRIMARY KEY (action, point))",
        ):
            self.conn.execute(ddl)

    def _rows(self, sql: str, params: tuple[Any, ...] = ()) -> list[dict[str, Any]]:
        from psycopg.rows import dict_row

        with self.conn.cursor(row_factory=dict_row) as cur:
            cur.execute(sql, params)
            return list(cur.fetchall())

    def effects(self, action: str) -> list[dict[str, Any]]:
        return self._rows(f"SELECT * FROM {self.base}_ledger WHERE action = %s ORDER BY id", (action,))

    def calls(self, action: str) -> list[dict[str, Any]]:
        return self._rows(f"SELECT * FROM {self.base}_calls WHERE action = %s ORDER BY id", (action,))

    def effect_counts(self, prefix: str) -> dict[str, int]:
        rows = self._rows(
            f"SELECT action, count(*) AS n FROM {self.base}_ledger WHERE action LIKE %s "
            f"GROUP BY action", (prefix.replace("_", r"\_") + "%",),
        )
        return {r["action"]: int(r["n"]) for r in rows}

    def all_calls(self) -> list[dict[str, Any]]:
        return self._rows(f"SELECT * FROM {self.base}_calls ORDER BY at, id")

    def drop(self) -> None:
        for t in ("ledger", "remote", "calls", "kills"):
            self.conn.execute(f"DROP TABLE IF EXISTS {self.base}_{t}")
        self.conn.close()


# -- the test process's app -------------------------------------------------------------------

_CONF_KEYS = ("broker_url", "result_backend", "idempotency_store", "idempotency_key_prefix",
              "task_default_queue", "idempotency_store_options")


def reset_app(app: Any) -> None:
    """Forget every cached connection of ``app``: store, gates, result backend, broker pools."""
    store = idem_app.forget_store(app)
    if store is not None:
        with contextlib.suppress(Exception):
            store.close()
    for task in app.tasks.values():
        task.__dict__.pop("_gate", None)
    drop_result_backend(app)
    # kombu keeps one pool per broker URL in a global registry: dropping the app's references
    # is enough for the next publish to use the pool of the URL now configured. (Closing them
    # would leave a closed pool in the registry for the next stack on the same URL.)
    amqp = app.__dict__.get("amqp")
    if amqp is not None:
        amqp._producer_pool = None
    app._pool = None


class Stack:
    """One configuration under test: broker, store, ledger and workers.

    Args:
        broker: The private Redis used as broker and result backend (and for body flags).
        store_url: The idempotency store (``redis://``, ``rediss://`` or ``db+postgresql://``).
        ledger: Where bodies commit their effects.
        store_options: ``idempotency_store_options``.
        env: Extra worker environment (``IDEM_VISIBILITY``, ...).
    """

    def __init__(self, broker: ChaosRedis, store_url: str, ledger: Ledger, *,
                 store_options: dict[str, Any] | None = None, env: dict[str, str] | None = None,
                 name: str = "") -> None:
        self.tag = tag()
        self.name = name
        self.broker = broker
        self.ledger = ledger
        self.prefix = f"chaos-{self.tag}:"
        self.queue = f"chaos-{self.tag}"
        self.store_url = store_url
        self.store_options = store_options
        self.env = {
            "IDEM_BROKER": broker.url, "IDEM_BACKEND": broker.url, "IDEM_LEDGER": broker.url,
            "IDEM_STORE": store_url, "IDEM_PREFIX": self.prefix, "IDEM_QUEUE": self.queue,
            "IDEM_PG_URL": ledger.url, "IDEM_PG_LEDGER": ledger.base, **(env or {}),
        }
        if store_options:
            self.env["IDEM_STORE_OPTIONS"] = json.dumps(store_options)
        self.app = app_module.app
        self.workers: list[Worker] = []
        self.flags = broker.client()
        self._saved: dict[str, Any] | None = None

    # the test process ---------------------------------------------------------------------

    def activate(self) -> None:
        """Point the test process's app at this stack."""
        conf = self.app.conf
        if self._saved is None:
            self._saved = {k: conf.get(k) for k in _CONF_KEYS}
        reset_app(self.app)
        conf.broker_url = self.broker.url
        conf.result_backend = self.broker.url
        conf.idempotency_store = self.store_url
        conf.idempotency_key_prefix = self.prefix
        conf.task_default_queue = self.queue
        conf.idempotency_store_options = self.store_options

    def deactivate(self) -> None:
        reset_app(self.app)
        if self._saved is not None:
            for k, v in self._saved.items():
                self.app.conf[k] = v
            self._saved = None

    @contextlib.contextmanager
    def active(self) -> Iterator[Stack]:
        self.activate()
        try:
            yield self
        finally:
            self.deactivate()

    @property
    def store(self) -> Any:
        return idem_app.get_store(self.app)

    # workers ------------------------------------------------------------------------------

    def worker(self, name: str = "w1", concurrency: int = 2, **kwargs: Any) -> Worker:
        w = Worker(dict(self.env), f"{name}-{self.tag}", concurrency=concurrency, **kwargs)
        self.workers.append(w)
        return w

    def logs(self) -> str:
        return "\n".join(w.text() for w in self.workers)

    def key_lines(self, key: str) -> list[str]:
        """Log lines of every worker that mention ``key``."""
        return [line for line in self.logs().splitlines() if key in line]

    # the ledger and body flags ------------------------------------------------------------

    def effects(self, action: str) -> list[dict[str, Any]]:
        return self.ledger.effects(action)

    def calls(self, action: str) -> list[dict[str, Any]]:
        return self.ledger.calls(action)

    def release(self, action: str) -> None:
        """Let a body that is holding (``hold=``) go on."""
        self.flags.set(f"{self.prefix}flag:release:{action}", 1, ex=600)

    def queue_empty(self) -> bool:
        """No message of this stack is waiting in the queue or unacknowledged."""
        if self.flags.llen(self.queue):
            return False
        return not any(self.queue.encode() in (v or b"")
                       for v in self.flags.hvals("unacked"))

    def close(self) -> None:
        for w in self.workers:
            w.stop()
        self.workers.clear()
        self.flags.close()


def pids(marker: Path) -> list[int]:
    """The pids a body wrote to ``marker`` (one line per start)."""
    return [int(p) for p in marker.read_text().split()] if marker.exists() else []


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def elapsed(start: float) -> float:
    return time.monotonic() - start
