"""In-process measurements: the gate, the Redis floor, record size, and a profile.

Timing: each call is timed on its own, wall (``perf_counter_ns``) and this thread's CPU
(``thread_time_ns``); medians are reported (and the wall p90). Things that are compared (a verb and
a trivial round trip) are timed in turn in one loop, so they see the same machine conditions.
Round trips are counted exactly, by a ``redis.Connection`` subclass that counts replies read
(health-check PINGs included), and for SQL by counting psycopg's network exchanges
(``Connection.wait``, one per round trip once a connection's statements are prepared, which the
warm-up calls do), with SQLAlchemy's cursor events counting the statements that went through
SQLAlchemy (none on the store's psycopg fast path).
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import socket
import statistics
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis
from celery import Celery

from celery_idem import IdempotentTask
from celery_idem.codec import KombuCodec
from celery_idem.enqueue import answer_from_record
from celery_idem.gate import Attempt, Gate
from celery_idem.lease import keeper
from celery_idem.stores.base import Store
from celery_idem.stores.redis import RedisStore

#: What the no-op body returns in the gate benchmarks (a small JSON result).
RESULT = {"order_id": "ord_12345", "ok": True}


class Counter:
    replies = 0


class CountingConnection(redis.Connection):
    """Counts every reply read: one per round trip (no pipelining on the store's hot path)."""

    def read_response(self, *args: Any, **kwargs: Any) -> Any:
        Counter.replies += 1
        return super().read_response(*args, **kwargs)


@dataclass
class Timing:
    median_us: float
    p90_us: float
    cpu_us: float  # client CPU per call: median of this thread's CPU time (thread_time)
    calls: int
    round_trips: float | None = None  # per call
    split: float | None = None  # SQL: statements per call executed through SQLAlchemy
    server_us: float | None = None  # Redis server time per EVALSHA (INFO commandstats), if clean

    def row(self) -> dict[str, Any]:
        return {"median_us": self.median_us, "p90_us": self.p90_us, "cpu_us": self.cpu_us,
                "round_trips": self.round_trips, "calls": self.calls}


def time_interleaved(fns: dict[str, Callable[[int], Any]], n: int, warm: int = 0,
                     count: Callable[[], int] | None = None) -> dict[str, Timing]:
    """Time each ``fn(i)`` for i in range(n), the functions taking turns (call i of every
    function runs before call i + 1 of any), so they see the same machine conditions.

    ``warm`` untimed rounds run first, with negative i. Per call: wall time (``perf_counter_ns``)
    and this thread's CPU time (``thread_time_ns``); both are reported as medians.
    """
    for i in range(warm):
        for fn in fns.values():
            fn(-1 - i)
    names = list(fns)
    calls = [fns[name] for name in names]
    wall: list[list[int]] = [[0] * n for _ in names]
    cpu: list[list[int]] = [[0] * n for _ in names]
    trips = [0] * len(names)
    clock, cpu_clock = time.perf_counter_ns, time.thread_time_ns
    counter = count or (lambda: 0)
    for i in range(n):
        for j, fn in enumerate(calls):
            before = counter()
            c = cpu_clock()
            t = clock()
            fn(i)
            wall[j][i] = clock() - t
            cpu[j][i] = cpu_clock() - c
            trips[j] += counter() - before
    out = {}
    for j, name in enumerate(names):
        w = sorted(wall[j])
        out[name] = Timing(statistics.median(w) / 1000, w[int(n * 0.9)] / 1000,
                           statistics.median(cpu[j]) / 1000, n, trips[j] / n if count else None)
    return out


def time_calls(fn: Callable[[int], Any], n: int, warm: int = 0,
               count: Callable[[], int] | None = None) -> Timing:
    """Time ``fn(i)`` for i in range(n), after ``warm`` untimed calls with negative i."""
    return time_interleaved({"fn": fn}, n, warm, count)["fn"]


def _evalsha_stats(client: redis.Redis) -> tuple[int, int]:
    row = client.info("commandstats").get("cmdstat_evalsha") or {}
    return int(row.get("calls", 0)), int(row.get("usec", 0))


def with_server_time(client: redis.Redis, expected_calls: int, run: Callable[[], Timing]) -> Timing:
    """Run ``run`` and attach the server's µs per EVALSHA, from ``INFO commandstats`` deltas.

    The server is shared: the figure is kept only when the EVALSHA count grew by exactly our
    calls (no other client ran a script meanwhile); else it stays None.
    """
    calls0, usec0 = _evalsha_stats(client)
    timing = run()
    calls1, usec1 = _evalsha_stats(client)
    if calls1 - calls0 == expected_calls:
        timing.server_us = (usec1 - usec0) / expected_calls
    return timing


def _bench_task(store: Store | str, prefix: str, eager: bool = False,
                store_options: dict[str, Any] | None = None) -> tuple[Celery, Any, Any]:
    """A throwaway app with the no-op as a plain task and as an IdempotentTask."""
    app = Celery("bench-micro", set_as_current=False)
    app.conf.update(task_always_eager=eager, idempotency_store=store, idempotency_key_prefix=prefix,
                    result_backend=None)
    if store_options:
        app.conf.idempotency_store_options = store_options

    @app.task(shared=False, name="bench.micro.idem", base=IdempotentTask, idempotency_fields=("action",))
    def idem(action: str) -> dict[str, Any]:
        return RESULT

    @app.task(shared=False, name="bench.micro.plain")
    def plain(action: str) -> dict[str, Any]:
        return RESULT

    return app, app.tasks["bench.micro.idem"], app.tasks["bench.micro.plain"]


def _gate_for(store: Store, prefix: str) -> tuple[Gate, Any]:
    _, task, _ = _bench_task(store, prefix)
    return Gate(store, task.idempotency_config, KombuCodec("json", ["json"])), task


def _body(token: int) -> dict[str, Any]:
    return RESULT


OWNER = f"{socket.gethostname()}:{os.getpid()}"


def gate_timings(store: Store, prefix: str, n: int, tag: str,
                 count: Callable[[], int] | None = None,
                 floor: Callable[[int], Any] | None = None,
                 raw_floor: Callable[[int], Any] | None = None) -> dict[str, Timing]:
    """``Gate.run`` with a no-op body: first runs (unique keys) and duplicates (one done key).

    With ``floor`` (one trivial round trip), it is timed in turn with the gate: the entries
    ``floor/first`` and ``floor/duplicate`` are the floor measured alongside each; ``raw_floor``
    (the same round trip on a raw socket) gives ``raw/first`` and ``raw/duplicate``.
    """
    gate, task = _gate_for(store, prefix)
    attempts = {i: Attempt(key=task.idempotency_key_for((f"{tag}:{i}",)), task_id=str(uuid.uuid4()),
                           owner=OWNER) for i in range(-50, n)}
    dup_attempt = attempts[0]
    out: dict[str, Timing] = {}
    for kind, fn in (("first", lambda i: gate.run(attempts[i], _body)),
                     ("duplicate", lambda i: gate.run(dup_attempt, _body))):
        fns: dict[str, Callable[[int], Any]] = {kind: fn}
        if floor is not None:
            fns[f"floor/{kind}"] = floor
        if raw_floor is not None:
            fns[f"raw/{kind}"] = raw_floor
        timed = time_interleaved(fns, n, warm=50 if kind == "first" else 20, count=count)
        for name, t in timed.items():
            if name != kind:
                t.round_trips = None  # the counter saw the gate's trips only (floors: 1 each)
        out.update(timed)
    return out


def redis_floor(client: redis.Redis, prefix: str, n: int) -> dict[str, Timing]:
    """Loopback round trips: PING, SET NX PX, EVALSHA of ``return 1`` (redis-py, and raw RESP)."""
    script = client.register_script("return 1")
    script()
    out = {
        "PING (redis-py)": time_calls(lambda i: client.ping(), n, warm=50),
        "SET NX PX (redis-py)": time_calls(
            lambda i: client.set(f"{prefix}floor:{i}", "1", nx=True, px=60000), n, warm=50),
        "EVALSHA return 1 (redis-py)": with_server_time(
            client, n + 50, lambda: time_calls(lambda i: script(), n, warm=50)),
    }
    kwargs = client.connection_pool.connection_kwargs
    with socket.create_connection((kwargs.get("host", "127.0.0.1"), kwargs.get("port", 6379))) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sha = script.sha.encode()
        cmd = b"*3\r\n$7\r\nEVALSHA\r\n$40\r\n" + sha + b"\r\n$1\r\n0\r\n"

        def raw(i: int) -> None:
            sock.sendall(cmd)
            if sock.recv(64) != b":1\r\n":
                raise RuntimeError("unexpected reply to EVALSHA")

        out["EVALSHA return 1 (raw socket)"] = with_server_time(
            client, n + 50, lambda: time_calls(raw, n, warm=50))
    return out


@dataclass
class RecordSize:
    result_bytes: int
    memory_usage: int
    encoding: str
    key_chars: int
    fields: int
    payload_bytes: int  # sum of field names and values
    overhead: int = field(init=False)

    def __post_init__(self) -> None:
        self.overhead = self.memory_usage - self.result_bytes


def record_sizes(client: redis.Redis, store: RedisStore, prefix: str, tag: str) -> list[RecordSize]:
    """``MEMORY USAGE`` of done records written by the gate (a realistic owner and task id)."""
    gate, task = _gate_for(store, prefix)
    out = []
    for size, result in (("small", RESULT), ("100 B", {"order_id": "ord_12345", "note": "x" * 72})):
        key = task.idempotency_key_for((f"{tag}:mem:{size}",))
        gate.run(Attempt(key=key, task_id=str(uuid.uuid4()), owner=OWNER), lambda t, r=result: r)
        name = store.prefix + key
        usage = int(client.memory_usage(name, samples=0) or 0)
        value = client.get(name)  # one packed string (celery_idem/stores/redis.py)
        rec = store.get(key)
        assert value is not None and rec is not None and rec.data is not None
        out.append(RecordSize(
            len(rec.data), usage, client.object("encoding", name).decode(), len(name),
            value.count(b"\0", 0, len(value) - len(rec.data)) + 1, len(value),
        ))
    return out


def component_timings(store: RedisStore, client: redis.Redis, prefix: str, n: int,
                      tag: str) -> dict[str, Timing]:
    """The pieces of one first run and one duplicate, each timed alone (Redis store)."""
    gate, task = _gate_for(store, prefix)
    codec = gate.codec
    cfg = gate.config
    keys = {i: task.idempotency_key_for((f"{tag}:c:{i}",)) for i in range(-50, n)}
    claims: dict[int, Any] = {}

    def claim(i: int) -> None:
        claims[i] = store.claim(keys[i], owner=OWNER, task_id="t", attempt=0, lease=cfg.lease, ttl=cfg.ttl)

    ctype, data = codec.encode_result(RESULT)
    done = _done()
    script = store.client.register_script("return 1")

    def record(i: int) -> None:
        store.record(keys[i], claims[i].token, state=done, content_type=ctype, data=data, ttl=cfg.ttl)

    def claim_done(i: int) -> None:
        store.claim(keys[i], owner=OWNER, task_id="t", attempt=0, lease=cfg.lease, ttl=cfg.ttl)

    # Wall and CPU: each verb in turn with a trivial EVALSHA on the same client (the verbs are
    # compared only with the EVALSHA of their own loop).
    out = time_interleaved({"store.claim (claimed)": claim, "store.record": record,
                            "EVALSHA return 1 (in turn with claim and record)": lambda i: script()},
                           n, warm=50)
    out.update(time_interleaved({"store.claim (done, duplicate)": claim_done,
                                 "store.get (done)": lambda i: store.get(keys[i]),
                                 "EVALSHA return 1 (in turn with the two above)":
                                     lambda i: script()}, n, warm=50))
    # Server time per script: separate loops on fresh keys (the INFO deltas cannot tell scripts apart).
    m = max(100, n // 2)
    skeys = {i: task.idempotency_key_for((f"{tag}:srv:{i}",)) for i in range(-50, m)}

    def sclaim(i: int) -> None:
        claims[10**9 + i] = store.claim(skeys[i], owner=OWNER, task_id="t", attempt=0, lease=cfg.lease,
                                        ttl=cfg.ttl)

    def srecord(i: int) -> None:
        store.record(skeys[i], claims[10**9 + i].token, state=done, content_type=ctype, data=data,
                     ttl=cfg.ttl)

    def sdup(i: int) -> None:
        store.claim(skeys[i], owner=OWNER, task_id="t", attempt=0, lease=cfg.lease, ttl=cfg.ttl)

    for label, fn in (("store.claim (claimed)", sclaim), ("store.record", srecord),
                      ("store.claim (done, duplicate)", sdup)):
        timed = with_server_time(client, m + 50, lambda f=fn: time_calls(f, m, warm=50))
        out[label].server_us = timed.server_us
    out["codec.encode_result"] = time_calls(lambda i: codec.encode_result(RESULT), n, warm=50)
    out["codec.decode_result"] = time_calls(lambda i: codec.decode_result("k", ctype, data), n, warm=50)
    k = keeper()

    def hold(i: int) -> None:
        with k.hold(store, keys[i], 1, cfg.lease):
            pass

    out["lease keeper hold() enter+exit"] = time_calls(hold, n, warm=50)
    value = store.client.get(store.prefix + keys[0])
    out["RedisStore._decode (a done record)"] = time_calls(
        lambda i: store._decode(keys[0], value), n, warm=50)
    out["idempotency_key_for (producer)"] = time_calls(
        lambda i: task.idempotency_key_for((f"x{i}",)), n, warm=50)
    return out


def _done() -> Any:
    from celery_idem.records import State

    return State.DONE


def eager_timings(redis_url: str, prefix: str, n: int, tag: str) -> dict[str, Timing]:
    """The whole task layer in process: ``delay`` with ``task_always_eager`` (producer check,
    key derivation, Celery's eager apply, ``__call__``, the gate), against the plain task."""
    app, idem, plain = _bench_task(redis_url, prefix, eager=True,
                                   store_options={"connection_class": CountingConnection})

    def count() -> int:
        return Counter.replies

    out = {
        "plain task delay() (eager)": time_calls(lambda i: plain.delay(f"{tag}:p:{i}"), n, warm=50),
        "IdempotentTask delay() (eager), first": time_calls(
            lambda i: idem.delay(f"{tag}:e:{i}"), n, warm=50, count=count),
        "IdempotentTask delay() (eager), duplicate": time_calls(
            lambda i: idem.delay(f"{tag}:e:0"), n, warm=20, count=count),
    }
    app.close()
    return out


@dataclass
class Profile:
    label: str
    calls: int
    seconds: float
    categories: dict[str, float]  # share of tottime
    top: list[tuple[str, int, float, float]]  # (function, ncalls, tottime us/call-of-loop, cumtime)
    own: list[tuple[str, int, float, float]]  # celery_idem functions


def _where(func: tuple[str, int, str]) -> str:
    filename, line, name = func
    if filename == "~":
        return name
    for marker in ("site-packages/", "celery_idem/", "lib/python3.11/"):
        if marker in filename:
            filename = filename.split(marker, 1)[1] if marker != "celery_idem/" else \
                "celery_idem/" + filename.split(marker, 1)[1]
            break
    return f"{filename}:{line}({name})"


def _category(func: tuple[str, int, str]) -> str:
    filename, _, name = func
    if filename == "~":
        if any(s in name for s in ("recv", "send", "select", "poll", "socket")):
            return "socket I/O (waiting for the server)"
        return "builtins"
    if "/psycopg/" in filename and name == "wait":
        return "socket I/O (waiting for the server)"
    if "/celery_idem/" in filename:
        return "celery_idem"
    if "/redis/" in filename:
        return "redis-py"
    if "/kombu/" in filename:
        return "kombu (codec)"
    if "/sqlalchemy/" in filename:
        return "SQLAlchemy"
    if "/psycopg/" in filename:
        return "psycopg"
    if "/celery/" in filename:
        return "celery"
    return "stdlib (dataclasses, enum, contextlib, threading, ...)"


def profile(label: str, fn: Callable[[int], Any], n: int) -> Profile:
    prof = cProfile.Profile()
    t = time.perf_counter()
    prof.enable()
    for i in range(n):
        fn(i)
    prof.disable()
    seconds = time.perf_counter() - t
    stats = pstats.Stats(prof, stream=io.StringIO())
    total = sum(v[2] for v in stats.stats.values())  # type: ignore[attr-defined]
    cats: dict[str, float] = {}
    rows = []
    for func, (_cc, nc, tt, ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        cats[_category(func)] = cats.get(_category(func), 0.0) + tt
        rows.append((func, nc, tt, ct))
    per = 1e6 / n

    def fmt(r: tuple[Any, int, float, float]) -> tuple[str, int, float, float]:
        return (_where(r[0]), r[1], r[2] * per, r[3] * per)

    top = [fmt(r) for r in sorted(rows, key=lambda r: -r[2])[:15]]
    own = [fmt(r) for r in sorted((r for r in rows if "/celery_idem/" in r[0][0]), key=lambda r: -r[3])[:15]]
    return Profile(label, n, seconds, {k: v / total for k, v in sorted(cats.items(), key=lambda kv: -kv[1])},
                   top, own)


def profiles(redis_url: str, prefix: str, n: int, tag: str,
             pg: tuple[str, str] | None = None) -> list[Profile]:
    store = RedisStore.from_url(redis_url, prefix=prefix)
    gate, task = _gate_for(store, prefix)
    attempts = {i: Attempt(key=task.idempotency_key_for((f"{tag}:prof:{i}",)), task_id=str(uuid.uuid4()),
                           owner=OWNER) for i in range(-50, n)}
    for i in range(-50, 0):
        gate.run(attempts[i], _body)
    out = [profile("Gate.run, Redis store, first run", lambda i: gate.run(attempts[i], _body), n)]
    out.append(profile("Gate.run, Redis store, duplicate", lambda i: gate.run(attempts[0], _body), n))
    app, idem, _ = _bench_task(redis_url, prefix, eager=True)
    for i in range(50):
        idem.delay(f"{tag}:profeager:w{i}")
    out.append(profile("IdempotentTask.delay() eager, Redis store, first run",
                       lambda i: idem.delay(f"{tag}:profeager:{i}"), n))
    app.close()
    store.close()
    if pg is not None:
        from celery_idem.stores.sql import SQLStore

        sql = SQLStore.from_url(pg[0], prefix=prefix, table_name=pg[1])
        gate, task = _gate_for(sql, prefix)
        m = max(50, n // 4)
        attempts = {i: Attempt(key=task.idempotency_key_for((f"{tag}:profsql:{i}",)),
                               task_id=str(uuid.uuid4()), owner=OWNER) for i in range(-20, m)}
        for i in range(-20, 0):
            gate.run(attempts[i], _body)
        out.append(profile("Gate.run, SQL store (PostgreSQL), first run",
                           lambda i: gate.run(attempts[i], _body), m))
        sql.close()
    return out


def pyinstrument_text(redis_url: str, prefix: str, n: int, tag: str,
                      pg: tuple[str, str] | None = None) -> str | None:
    """A pyinstrument call tree of ``Gate.run`` (first runs; Redis, or the SQL store on PostgreSQL
    with ``pg`` = (url, table)), if pyinstrument is installed."""
    try:
        from pyinstrument import Profiler
    except ImportError:
        return None
    store: Store
    if pg is None:
        store = RedisStore.from_url(redis_url, prefix=prefix)
    else:
        from celery_idem.stores.sql import SQLStore

        store = SQLStore.from_url(pg[0], prefix=prefix, table_name=pg[1])
    gate, task = _gate_for(store, prefix)
    for i in range(20):  # connections, prepared statements
        gate.run(Attempt(key=task.idempotency_key_for((f"{tag}:pyiw:{i}",)), task_id="w", owner=OWNER), _body)
    attempts = [Attempt(key=task.idempotency_key_for((f"{tag}:pyi:{i}",)), task_id=str(uuid.uuid4()),
                        owner=OWNER) for i in range(n)]
    profiler = Profiler(interval=0.0001)
    profiler.start()
    for a in attempts:
        gate.run(a, _body)
    profiler.stop()
    store.close()
    return str(profiler.output_text(unicode=False, color=False, show_all=False, short_mode=False))


def pg_counters(store: Any) -> dict[str, int]:
    """Count, on a new SQLStore's engine: ``trips``, psycopg's network exchanges on every
    connection it opens (``Connection.wait``; a statement's first run on a connection also
    prepares it, in the same exchange but one more round trip), and ``sqlalchemy``, the
    statements SQLAlchemy executed. Call before the store's first connection."""
    import sqlalchemy as sa

    counts = {"trips": 0, "sqlalchemy": 0}

    @sa.event.listens_for(store._engine, "connect")
    def _wrap(dbapi_connection: Any, _record: Any) -> None:
        wait = dbapi_connection.wait

        def counting_wait(*args: Any, **kwargs: Any) -> Any:
            counts["trips"] += 1
            return wait(*args, **kwargs)

        dbapi_connection.wait = counting_wait

    @sa.event.listens_for(store._engine, "before_cursor_execute")
    def _stmt(*_: Any) -> None:
        counts["sqlalchemy"] += 1

    return counts


def sql_gate(pg_url: str, prefix: str, table: str, n: int, tag: str) -> dict[str, Timing]:
    """``Gate.run`` on the SQL store (PostgreSQL), counting round trips and SQLAlchemy statements."""
    from celery_idem.stores.sql import SQLStore

    store = SQLStore.from_url(pg_url, prefix=prefix, table_name=table)
    counts = pg_counters(store)
    try:
        timings = gate_timings(store, prefix, n, tag, count=lambda: counts["trips"])
        # The same loops once more, to count the statements that went through SQLAlchemy (the
        # duplicate loop reuses the first loop's key 0, already done).
        gate, task = _gate_for(store, prefix)
        for label, fresh in (("first", True), ("duplicate", False)):
            before = counts["sqlalchemy"]
            for i in range(100):
                key = task.idempotency_key_for((f"{tag}:split:{i if fresh else 0}",))
                gate.run(Attempt(key=key, task_id="t", owner=OWNER), _body)
            timings[label].split = (counts["sqlalchemy"] - before) / 100
        return timings
    finally:
        store.close()


#: The fast path with ``synchronous_commit=off`` (measured for comparison only).
NOT_DURABLE = "fast path, synchronous_commit=off"


def sql_paths(pg_url: str, prefix: str, table: str, n: int, tag: str) -> dict[str, Timing]:
    """``Gate.run`` on PostgreSQL through the store's psycopg fast path and through SQLAlchemy
    (the same store with the fast path off: the code path before it existed), timed in turn."""
    from celery_idem.stores.sql import SQLStore

    stores = {"fast path": SQLStore.from_url(pg_url, prefix=prefix, table_name=table),
              "SQLAlchemy path": SQLStore.from_url(pg_url, prefix=prefix, table_name=table,
                                                   accelerate=False),
              # What the durable commits cost: NOT a recommendation (a PostgreSQL crash could lose
              # the last commits, records included, and a lost record lets the body run again).
              NOT_DURABLE: SQLStore.from_url(pg_url, prefix=prefix, table_name=table, engine_options={
                  "connect_args": {"options": "-c synchronous_commit=off"}})}
    counts = {name: pg_counters(store) for name, store in stores.items()}
    try:
        out: dict[str, Timing] = {}
        for kind in ("first", "duplicate"):
            fns: dict[str, Callable[[int], Any]] = {}
            for name, store in stores.items():
                gate, task = _gate_for(store, prefix)
                attempts = {i: Attempt(key=task.idempotency_key_for((f"{tag}:{name}:{i}",)),
                                       task_id=str(uuid.uuid4()), owner=OWNER) for i in range(-20, n)}
                if kind == "first":
                    fns[f"{name}/first"] = lambda i, g=gate, a=attempts: g.run(a[i], _body)
                else:
                    fns[f"{name}/duplicate"] = lambda i, g=gate, a=attempts: g.run(a[-1], _body)
            out.update(time_interleaved(fns, n, warm=20,
                                        count=lambda: sum(c["trips"] for c in counts.values())))
        return out
    finally:
        for store in stores.values():
            store.close()


def sql_floor(pg_url: str, n: int) -> dict[str, Timing]:
    """PostgreSQL round trips: raw psycopg ``SELECT 1``, and SQLAlchemy with the store's engine
    options (a pooled checkout + ``SELECT 1``, through a SQLAlchemy ``Connection`` and on the
    psycopg connection itself as the store's fast path does)."""
    import psycopg
    import sqlalchemy as sa

    from celery_idem.stores.sql.engine import build_engine, sqlalchemy_url

    sa_url = sqlalchemy_url(pg_url)
    out: dict[str, Timing] = {}
    dsn = sa_url.set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(dsn, autocommit=True) as conn, conn.cursor() as cur:
        def raw(i: int) -> None:
            cur.execute("SELECT 1")
            cur.fetchone()

        out["SELECT 1 (psycopg)"] = time_calls(raw, n, warm=50)
    engine = build_engine(sa_url, {})
    select_one = sa.text("SELECT 1")

    def pooled(i: int) -> None:
        with engine.connect() as c:
            c.execute(select_one).scalar_one()

    label = "checkout + SELECT 1 (SQLAlchemy Connection, store's engine options)"
    out[label] = time_calls(pooled, n, warm=50)

    def raw_pooled(i: int) -> None:
        fairy = engine.raw_connection()
        try:
            cur = fairy.driver_connection.cursor()  # type: ignore[union-attr]
            cur.execute(select_one.text, prepare=True)
            cur.fetchone()
        finally:
            fairy.close()

    label = "checkout + prepared SELECT 1 (psycopg connection from the pool: the store's fast path)"
    out[label] = time_calls(raw_pooled, n, warm=50)
    engine.dispose()
    return out


# -- the per-task CPU budget ---------------------------------------------------------------------

#: Argument counts the key derivation is reported for.
KEY_ARGS = (2, 8, 32)


def key_timings(n: int) -> dict[int, Timing]:
    """``idempotency_key_for`` of a task with 2, 8 and 32 scalar arguments (str, int, float in
    turn), the whole call as ``apply_async`` makes it: binding, canonical JSON, hash."""
    app = Celery("bench-keys", set_as_current=False)
    app.conf.update(idempotency_store="memory://", result_backend=None)
    fns: dict[str, Callable[[int], Any]] = {}
    for count in KEY_ARGS:
        namespace: dict[str, Any] = {}
        params = ", ".join(f"a{i}" for i in range(count))
        exec(f"def task_{count}({params}):\n    return None", namespace)  # a fixed text: n parameters
        task = app.task(namespace[f"task_{count}"], base=IdempotentTask, shared=False,
                        name=f"bench.keys.{count}")
        args = tuple(f"ord_{i}" if i % 3 == 0 else i * 17 if i % 3 == 1 else i * 0.5
                     for i in range(count))
        fns[str(count)] = lambda i, t=task, a=args: t.idempotency_key_for(a)
    out = time_interleaved(fns, n, warm=100)
    app.close()
    return {int(k): v for k, v in out.items()}


class RawRedis:
    """A raw-socket client (RESP by hand, no library): the floor of a Redis round trip here."""

    def __init__(self, client: redis.Redis) -> None:
        kwargs = client.connection_pool.connection_kwargs
        self.sock = socket.create_connection((kwargs.get("host", "127.0.0.1"), kwargs.get("port", 6379)))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        db = int(kwargs.get("db", 0) or 0)
        if db:
            self.sock.sendall(f"*2\r\n$6\r\nSELECT\r\n${len(str(db))}\r\n{db}\r\n".encode())
            self.sock.recv(64)
        self.sha = client.script_load("return 1")
        self.cmd = b"*3\r\n$7\r\nEVALSHA\r\n$40\r\n" + self.sha.encode() + b"\r\n$1\r\n0\r\n"

    def evalsha(self, i: int = 0) -> None:
        """A trivial EVALSHA (``return 1``)."""
        self.sock.sendall(self.cmd)
        if self.sock.recv(64) != b":1\r\n":
            raise RuntimeError("unexpected reply to EVALSHA")

    def close(self) -> None:
        self.sock.close()


def enqueue_check_timings(store: RedisStore, client: redis.Redis, prefix: str, n: int,
                          tag: str) -> dict[str, Timing]:
    """The producer's enqueue check (:func:`celery_idem.enqueue.answer_from_record`, as
    ``apply_async`` calls it, on a key never seen: one ``GET``), timed in turn with a
    raw-socket round trip; with the server's time per ``GET``."""
    _, task, _ = _bench_task(store, prefix)
    keys = {i: task.idempotency_key_for((f"{tag}:q:{i}",)) for i in range(-50, n)}
    raw = RawRedis(client)
    try:
        def check(i: int) -> None:
            if answer_from_record(task, task._gate, task._result_writer, keys[i], (f"{tag}:q:{i}",),
                                  {}, None, {}, arguments_hash=str) is not None:
                raise RuntimeError("a key never used was answered from the record")

        out = time_interleaved({"check": check, "raw": raw.evalsha}, n, warm=50)
        # Server time per GET, alone (INFO commandstats deltas; None if another client's GETs
        # ran meanwhile, which on a shared server is likely: then only the CPU figure counts).
        row0 = client.info("commandstats").get("cmdstat_get") or {}
        for i in range(n):
            store.get(keys[i])
        row1 = client.info("commandstats").get("cmdstat_get") or {}
        calls = int(row1.get("calls", 0)) - int(row0.get("calls", 0))
        if calls == n:
            out["check"].server_us = (int(row1.get("usec", 0)) - int(row0.get("usec", 0))) / n
        return out
    finally:
        raw.close()


#: The systems of :func:`publish_timings`, in the order they are timed.
PUBLISH_PLAIN = "plain task delay()"
PUBLISH_OFF = "IdempotentTask delay(), `idempotency_check_on_enqueue=False`"
PUBLISH_WITHIN = "IdempotentTask delay(), check within the publish (the default here)"
PUBLISH_FIRST = "IdempotentTask delay(), check read first (one `GET`, then the publish)"


def publish_timings(redis_url: str, prefix: str, n: int, tag: str) -> dict[str, Timing]:
    """``delay()`` through a real Redis broker, its store and result backend on that server.

    Unique keys, timed in turn: the plain task, and the IdempotentTask with the enqueue check
    off, within the publish (one script reads the record and pushes the message), and read
    first (``GET``, then kombu's ``LPUSH``). Nothing consumes the queue; the run's cleanup
    deletes it with every key under ``prefix``.
    """
    app = Celery("bench-publish", broker=redis_url, backend=redis_url, set_as_current=False)
    app.conf.update(
        broker_transport_options={"global_keyprefix": prefix},
        result_backend_transport_options={"global_keyprefix": prefix},
        idempotency_key_prefix=prefix + "pub:", task_default_queue="publish-q",
    )

    @app.task(shared=False, name="bench.pub.plain")
    def plain(action: str) -> str:
        return action

    def idem_task(name: str, check: bool) -> Any:
        @app.task(shared=False, name=name, base=IdempotentTask, idempotency_fields=("action",),
                  idempotency_check_on_enqueue=check)
        def idem(action: str) -> str:
            return action

        return app.tasks[name]

    off = idem_task("bench.pub.off", False)
    within = idem_task("bench.pub.within", True)
    first = idem_task("bench.pub.first", True)
    first._enqueue_check.possible = False  # read first, as with another broker (or switched off)
    tasks = {PUBLISH_PLAIN: app.tasks["bench.pub.plain"], PUBLISH_OFF: off,
             PUBLISH_WITHIN: within, PUBLISH_FIRST: first}
    try:
        out = time_interleaved(
            {name: (lambda i, t=t, j=j: t.delay(f"{tag}:{j}:{i}"))
             for j, (name, t) in enumerate(tasks.items())}, n, warm=50)
        check = within._enqueue_check
        if getattr(check, "answered", 0) or not getattr(check, "possible", True):
            raise RuntimeError("the check did not ride on the publish")
        return out
    finally:
        app.close()
