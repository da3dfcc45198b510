"""What intents cost (``idempotency_intent=True``) and what the relay sustains: ``python -m bench.intents``.

* **enqueue**: ``delay()`` of a unique key through a real Redis broker, the same no-op task with
  intents off and on, in alternating blocks of ``n`` calls (the order swapped every repetition),
  on three paths: the store on the broker's server and database, and on another database of
  that server (either way the intent rides in the publish's script), and read first (the check
  within the publish turned off for the task: the intent is its own round trip, as with another
  broker or a store on another server). Per block the median µs per call; the ratio on / off
  is :func:`balanced` over the repetitions (the two orders weigh the same), beside an A/A
  control: the off task against itself in the same alternating blocks, what the block method
  resolves on this machine. Nothing consumes the queue.
* **worker**: store commands per task of a real ``celery worker -P solo`` with intents off and
  on, read with ``MONITOR`` on a private ``redis-server`` holding the store alone (broker and
  backend on the shared Redis under the run's prefix; the commands a script runs inside the
  server are left out: one script is one round trip). The messages are enqueued before the
  worker starts, so the producer's commands and the worker's are counted apart.
* **relay throughput**: ``Relay.run_once`` in a loop until every lost intent is re-sent, on the
  Redis store (shared server, the run's prefix) and the SQL store on PostgreSQL (a private
  table), the broker a private ``redis-server``. The intents are written with
  ``relay_after=0`` and their queue's watermark above them (a later message of the queue was
  seen claimed): each is lost and re-sent with reason ``overtaken``.
* **relay at rest**: ``Relay.run_forever`` with the default 1 s interval and nothing due, for
  10 s: store round trips per second.

Every Redis key of the run is under one random prefix and deleted at the end; the SQL tables are
dropped.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import logging
import os
import pstats
import secrets
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import redis
from celery import Celery
from kombu.serialization import dumps

from bench.app import Settings, build_app
from bench.e2e import Worker, sql_table
from bench.growth import PrivateRedis
from bench.report import table

SORT = "cumulative"
DEFAULT_PG = "db+postgresql+psycopg://root@127.0.0.1:5432/test"

#: The targets (``bench.cli``'s style: the goal, then what was measured).
ENQUEUE_TARGET = 1.10
REDIS_RELAY_TARGET = 2000.0
PG_RELAY_TARGET = 500.0
AT_REST_TARGET = 1.0


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -- enqueue ------------------------------------------------------------------------------------


def _block(task: Any, tag: str, n: int) -> tuple[float, float]:
    """Median wall and CPU µs of ``n`` ``delay()`` calls of unique keys."""
    wall, cpu = [0] * n, [0] * n
    clock, cpu_clock = time.perf_counter_ns, time.thread_time_ns
    for i in range(n):
        c, t = cpu_clock(), clock()
        task.delay(f"{tag}:{i}")
        wall[i], cpu[i] = clock() - t, cpu_clock() - c
    return statistics.median(wall) / 1000, statistics.median(cpu) / 1000


def balanced(ratios: list[float]) -> float:
    """The ratio of the second task to the first over repetitions that alternate which block
    runs first (even repetitions: the first task first): the geometric mean of the two orders'
    medians, so that neither order counts more when the repetitions are odd in number (a
    block run second can meet another machine than the first: :func:`_order_control`)."""
    groups = [g for g in (ratios[0::2], ratios[1::2]) if g]
    return float(statistics.geometric_mean([statistics.median(g) for g in groups]))


def _order_control(task: Any, tag: str, n: int, reps: int) -> dict[str, Any]:
    """The same task against itself in alternating blocks (an A/A run): the second block's
    median over the first's per repetition, and the balanced ratio (which should be 1)."""
    seconds, ratios = [], []
    for rep in range(reps):
        a = _block(task, f"{tag}:a:{rep}", n)[0]
        b = _block(task, f"{tag}:b:{rep}", n)[0]
        seconds.append(b / a)
        ratios.append(b / a if rep % 2 == 0 else a / b)  # "b" is the second task, run second on even reps
    return {"aa_second": seconds, "aa_ratio": balanced(ratios)}


def enqueue_cost(redis_url: str, other_db_url: str, prefix: str, n: int, reps: int) -> dict[str, Any]:
    """``delay()`` with intents off and on, fused (store on the broker's db or another db of its
    server) and read first."""
    out: dict[str, Any] = {}
    paths = {"fused (store on the broker's server and db)": (None, True),
             "fused (store on another db of the broker's server)": (other_db_url, True),
             "read first (store on another db, the check within the publish off)": (other_db_url, False)}
    for label, (store_url, fused) in paths.items():
        t = secrets.token_hex(2)
        s = Settings(prefix, f"{prefix}q-enq-{t}", redis_url, store_url=store_url)
        app = build_app(s)
        try:
            tasks = {"off": app.tasks["bench.idem"], "on": app.tasks["bench.idem_intent"]}
            for name, task in tasks.items():  # connections, scripts, imports
                _block(task, f"{prefix}enq:{t}:{name}:warm", 100)
            if not fused:
                for task in tasks.values():
                    task._enqueue_check.possible = False
            check = tasks["on"]._enqueue_check
            if fused != bool(getattr(check, "possible", False)):
                raise RuntimeError(f"{label}: the enqueue check is not on the expected path ({check!r})")
            rows: dict[str, list[tuple[float, float]]] = {"off": [], "on": []}
            for rep in range(reps):
                order = ["off", "on"] if rep % 2 == 0 else ["on", "off"]
                for name in order:
                    rows[name].append(_block(tasks[name], f"{prefix}enq:{t}:{name}:{rep}", n))
                log(f"  enqueue {label}: rep {rep + 1}: off {rows['off'][-1][0]:.0f} µs, "
                    f"on {rows['on'][-1][0]:.0f} µs")
            # bench.accel's method beside the blocks: the two take turns call by call.
            from bench.micro import time_interleaved

            il = time_interleaved({name: (lambda i, task=task, tag=f"{prefix}enq:{t}:{name}:il": task.delay(
                f"{tag}:{i}")) for name, task in tasks.items()}, n, warm=50)
            prof = cProfile.Profile()
            prof.enable()
            _block(tasks["on"], f"{prefix}enq:{t}:on:profile", 500)
            prof.disable()
            parts = shares(prof, ENQUEUE_PARTS, "delay")
            ratios = [on[0] / off[0] for on, off in zip(rows["on"], rows["off"], strict=True)]
            control = {} if out else _order_control(tasks["off"], f"{prefix}enq:{t}:aa", n, reps)
            out[label] = {
                **control,
                "off": statistics.median(w for w, _ in rows["off"]),
                "on": statistics.median(w for w, _ in rows["on"]),
                "off_cpu": statistics.median(c for _, c in rows["off"]),
                "on_cpu": statistics.median(c for _, c in rows["on"]),
                "ratio": balanced(ratios), "ratios": ratios,
                "il_off": il["off"].median_us, "il_on": il["on"].median_us,
                "il_off_cpu": il["off"].cpu_us, "il_on_cpu": il["on"].cpu_us,
                "il_ratio": il["on"].median_us / il["off"].median_us,
                "parts_us": {k: v / 500 * 1e6 for k, v in parts.items()}}
        finally:
            app.close()
    return out


# -- the worker's store commands ----------------------------------------------------------------


def _script_names() -> dict[str, str]:
    """The intent scripts' SHA1s -> their names (the relay's poll is ``due``)."""
    import hashlib

    from celery_idem.stores import redis as rs
    from celery_idem.stores import redis_intents as ri

    sources = [("intend", ri._INTEND), ("due", ri._DUE), ("reschedule", ri._RESCHEDULE),
               ("close", ri._CLOSE), ("raise", ri._RAISE)]
    for name in ("claim", "record", "reserve", "release", "renew", "forget", "unreserve", "publish"):
        with contextlib.suppress(OSError):
            sources.append((name, rs._load(name)))
    return {hashlib.sha1(src.encode()).hexdigest(): name for name, src in sources}


_SCRIPTS = _script_names()


class _Monitor:
    """The commands clients send to a private ``redis-server`` (``MONITOR``; the commands a
    script runs are left out), counted per phase; :meth:`phase` starts the next one."""

    def __init__(self, port: int) -> None:
        self._client = redis.Redis(port=port)
        self._marker = redis.Redis(port=port)
        self._token = secrets.token_hex(4)
        self.counts: dict[str, dict[str, int]] = {}
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._listen, daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("MONITOR did not start")
        self.phase("setup")

    def _listen(self) -> None:
        current: dict[str, int] = {}
        with self._client.monitor() as monitor:
            self._ready.set()
            for cmd in monitor.listen():
                words = str(cmd.get("command", "")).split()
                if cmd.get("client_type") == "lua" or not words:
                    continue
                if words[0].upper() == "ECHO" and len(words) > 1 and words[1].startswith(self._token):
                    name = words[1][len(self._token) + 1:]
                    if name == "stop":
                        return
                    current = self.counts.setdefault(name, {})
                    continue
                verb = words[0].upper()
                if verb == "EVALSHA" and len(words) > 1:
                    sha = words[1].strip('"')
                    verb = f"EVALSHA {_SCRIPTS.get(sha, sha[:8])}"
                current[verb] = current.get(verb, 0) + 1

    def phase(self, name: str) -> None:
        self._marker.echo(f"{self._token}:{name}")

    def close(self) -> None:
        self.phase("stop")
        self._thread.join(10)
        self._marker.close()
        self._client.close()


def worker_commands(redis_url: str, prefix: str, n: int) -> dict[str, Any]:
    """Store commands of the producer and of a real worker, per task, intents off and on."""
    server = PrivateRedis()
    shared = redis.Redis.from_url(redis_url)
    log_dir = Path(tempfile.mkdtemp(prefix="celery-idem-bench-intents-"))
    monitor = _Monitor(server.port)
    out: dict[str, Any] = {}
    try:
        for name, task_name in (("off", "bench.idem"), ("on", "bench.idem_intent")):
            s = Settings(prefix, f"{prefix}q-wk-{name}", redis_url, store_url=server.url)
            app = build_app(s)
            worker = None
            try:
                task = app.tasks[task_name]
                monitor.phase(f"{name}/producer")
                handles = [task.delay(f"{prefix}wk:{name}:{i}") for i in range(n)]
                monitor.phase(f"{name}/start")  # the worker's start: connections, scripts
                worker = Worker(s, "solo", log_dir)
                worker.wait_ready(shared)
                monitor.phase(f"{name}/worker")
                t0 = time.monotonic()
                for h in handles:
                    h.get(timeout=120)
                elapsed = time.monotonic() - t0
                monitor.phase(f"{name}/stop")
                worker.stop()
                worker = None
                out[name] = {"seconds": elapsed}
            finally:
                if worker is not None:
                    worker.stop()
                app.close()
        monitor.close()
        for name in ("off", "on"):
            for side in ("producer", "start", "worker"):
                out[name][side] = dict(sorted(monitor.counts.get(f"{name}/{side}", {}).items()))
            log(f"  worker, intents {name}: {out[name]}")
    finally:
        shared.close()
        server.stop()
        for p in log_dir.iterdir():
            p.unlink()
        log_dir.rmdir()
    return out


# -- the relay ----------------------------------------------------------------------------------


def _envelope(task_id: str, key: str, queue: str) -> bytes:
    from celery_idem.intents import Envelope, encode_envelope

    _, _, body = dumps([[f"{key}"], {}, {"callbacks": None, "errbacks": None, "chain": None,
                                         "chord": None}], serializer="json")
    headers = {"lang": "py", "task": "bench.idem_intent", "id": task_id, "root_id": task_id,
               "parent_id": None, "group": None, "retries": 0, "eta": None, "expires": None,
               "argsrepr": f"('{key}',)", "kwargsrepr": "{}", "idempotency_key": key}
    return encode_envelope(Envelope(
        body=body.encode(), content_type="application/json", content_encoding="utf-8",
        headers=headers, properties={"correlation_id": task_id, "reply_to": "", "priority": 0},
        exchange="", exchange_type="direct", routing_key=queue, queue=queue))


def _seed(store: Any, n: int, queue: str, tag: str) -> None:
    """``n`` intents due at once, their queue's watermark above them (each one is lost)."""
    for i in range(n):
        key, task_id = f"bench.idem_intent:{tag}:{i}", str(uuid.uuid4())
        store.intend(key, task_id, queue, _envelope(task_id, key, queue), relay_after=0.0, ttl=3600.0)
    store.raise_watermarks({queue: store.now() + 3600})


def shares(prof: cProfile.Profile, names: dict[str, tuple[str, str | None]],
           root: str) -> dict[str, float]:
    """Per label ``(function, caller)``, the cumulative seconds of that function (called from
    ``caller`` only, when given), and ``root``'s own under the key "total"."""
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    out = dict.fromkeys(names, 0.0)
    out["total"] = 0.0
    for (_file, _line, func), (_cc, _nc, _tt, ct, callers) in stats.items():
        if func == root:
            out["total"] += ct
        for label, (name, caller) in names.items():
            if func != name:
                continue
            if caller is None:
                out[label] += ct
            else:
                out[label] += sum(v[3] for k, v in callers.items() if k[2] == caller)
    return out


#: Where a relay pass spends its time (cProfile, cumulative): label -> (function, caller).
RELAY_PARTS: dict[str, tuple[str, str | None]] = {
    "publishing (kombu, the broker's LPUSH)": ("publish_envelope", None),
    "the compare-and-sets": ("reschedule_intents", "_won"),
    "reading the due intents": ("due_intents", "run_once"),
    "the WARNING line per re-send": ("warning", "_resend"),
    "observers and events": ("_notify", None),
    "decoding the envelopes": ("decode_envelope", None),
}

#: Where an intent enqueue's extra time goes (cProfile, cumulative): label -> (function, caller).
ENQUEUE_PARTS: dict[str, tuple[str, str | None]] = {
    "intent_of": ("intent_of", "_put"),
    "intent_spec": ("intent_spec", "_put"),
}


def _drain(relay: Any) -> tuple[int, int]:
    relayed = passes = 0
    while True:
        report = relay.run_once()
        passes += 1
        relayed += report.relayed
        if not report.full and not report.relayed:
            return relayed, passes


#: The relay's variants: the batch's compare-and-sets in one call (``Store.reschedule_intents``,
#: a pipeline on Redis), and one call per intent (the store's default loop), side by side.
BATCHED, PER_INTENT = "batched CAS", "one CAS per intent"


def relay_throughput(store: Any, broker_url: str, n: int, tag: str, reps: int,
                     profile: bool) -> dict[str, Any]:
    """Intents/s ``Relay.run_once`` re-sends, looping until none is due, ``reps`` times per
    variant (alternating); a cProfile of one more batched round when ``profile``."""
    from celery_idem.contrib.relay import Relay
    from celery_idem.stores.base import Store

    queue = f"bench-relay-{tag}"
    app = Celery(f"bench-relay-{tag}", broker=broker_url, set_as_current=False)
    app.conf.broker_connection_retry_on_startup = True
    broker = redis.Redis.from_url(broker_url)
    relay = Relay(app, store, relay_after=3600.0)
    variants = [BATCHED, PER_INTENT] if type(store).reschedule_intents is not Store.reschedule_intents \
        else [BATCHED]
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    try:
        for rep in range(reps):
            for variant in variants if rep % 2 == 0 else variants[::-1]:
                _seed(store, n, queue, f"{tag}:{rep}:{variant[:3]}")
                if variant == PER_INTENT:  # the default verb: one round trip per intent
                    store.reschedule_intents = Store.reschedule_intents.__get__(store)
                try:
                    before = int(broker.llen(queue))
                    c0, t0 = time.thread_time(), time.perf_counter()
                    relayed, passes = _drain(relay)
                    seconds = time.perf_counter() - t0
                    cpu = time.thread_time() - c0
                finally:
                    store.__dict__.pop("reschedule_intents", None)
                sent = int(broker.llen(queue)) - before
                runs[variant].append({"relayed": relayed, "sent": sent, "passes": passes,
                                      "seconds": seconds, "rate": relayed / seconds,
                                      "cpu_us": cpu / max(1, relayed) * 1e6})
                log(f"  {variant}, rep {rep + 1}: {relayed} re-sent in {seconds:.2f} s "
                    f"({relayed / seconds:.0f}/s), {passes} passes, {sent} in the queue")
        out: dict[str, Any] = {"n": n, "variants": {
            v: {"rate": statistics.median(r["rate"] for r in rs), "rates": [r["rate"] for r in rs],
                "relayed": min(r["relayed"] for r in rs), "sent": min(r["sent"] for r in rs),
                "passes": rs[0]["passes"],
                "cpu_us": statistics.median(r["cpu_us"] for r in rs)} for v, rs in runs.items()}}
        if profile:
            _seed(store, n, queue, f"{tag}:profile")
            prof = cProfile.Profile()
            prof.enable()
            _drain(relay)
            prof.disable()
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats(SORT).print_stats(30)
            out["profile"] = text.getvalue()
            out["parts"] = shares(prof, RELAY_PARTS, "run_once")
        return out
    finally:
        broker.delete(queue)
        broker.close()
        app.close()


class _CountingStore:
    """The store, counting the relay's calls of its verbs (each is one round trip)."""

    def __init__(self, store: Any) -> None:
        self._store, self.calls = store, 0

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._store, name)
        if not callable(attr):
            return attr

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return attr(*args, **kwargs)

        return counted


def at_rest(store: Any, broker_url: str, seconds: float = 10.0) -> dict[str, Any]:
    """Store round trips per second of a relay with nothing due (its default interval)."""
    from celery_idem.contrib.relay import Relay

    app = Celery("bench-relay-rest", broker=broker_url, set_as_current=False)
    counted = _CountingStore(store)
    relay = Relay(app, counted, relay_after=60.0)  # type: ignore[arg-type]
    stop = threading.Event()
    thread = threading.Thread(target=relay.run_forever, args=(stop,), daemon=True)
    try:
        t0 = time.monotonic()
        thread.start()
        time.sleep(seconds)  # the measurement window itself, not a synchronisation
        stop.set()
        thread.join(10)
        elapsed = time.monotonic() - t0
    finally:
        app.close()
    return {"calls": counted.calls, "seconds": elapsed, "rate": counted.calls / elapsed}


@contextlib.contextmanager
def _stores(redis_url: str, pg_url: str | None, prefix: str) -> Iterator[dict[str, Any]]:
    from celery_idem.stores.redis import RedisStore

    stores: dict[str, Any] = {"redis": RedisStore.from_url(redis_url, prefix=prefix + "relay:")}
    table_name = sql_table(prefix) + "_relay"
    if pg_url:
        from celery_idem.stores.sql import SQLStore

        stores["postgres"] = SQLStore.from_url(pg_url, prefix=prefix, table_name=table_name)
    try:
        yield stores
    finally:
        for store in stores.values():
            store.close()
        if pg_url:
            import sqlalchemy as sa

            engine = sa.create_engine(pg_url.removeprefix("db+"))
            with engine.begin() as conn:
                for t in (f"{table_name}_intents", f"{table_name}_watermarks", table_name):
                    conn.execute(sa.text(f'DROP TABLE IF EXISTS "{t}"'))
            engine.dispose()


# -- end to end ---------------------------------------------------------------------------------


def end_to_end(redis_url: str, prefix: str, tasks: int, reps: int) -> list[Any]:
    """``bench.e2e`` (prefork -c 2, Redis store, no peers, no realistic row): the unique and
    duplicate workloads, ``idem/redis (intents)`` among the systems, interleaved."""
    from bench.e2e import Plan, measure, summarize

    plan = Plan(tasks, reps, ["prefork"], ["redis"], warmup=50, peers=False, io_tasks=0)
    return summarize(measure(plan, redis_url, None, prefix + "e2e:", log))


# -- the command --------------------------------------------------------------------------------


def cleanup(redis_url: str, prefix: str) -> None:
    for url in (redis_url, _other_db(redis_url)):
        client = redis.Redis.from_url(url)
        names = list(client.scan_iter(match=prefix + "*", count=1000))
        for i in range(0, len(names), 500):
            client.unlink(*names[i:i + 500])
        client.close()


def _other_db(redis_url: str) -> str:
    base, _, db = redis_url.rpartition("/")
    return f"{base}/{(int(db or 0) + 1) % 16}"


def run(args: argparse.Namespace, emit: Callable[[str, str], None]) -> dict[str, Any]:
    prefix = f"bench{secrets.token_hex(3)}:"
    logging.getLogger("celery_idem").addHandler(logging.NullHandler())
    logging.getLogger("celery_idem").propagate = False  # a WARNING per re-sent message
    results: dict[str, Any] = {}
    try:
        if "enqueue" in args.only:
            log("enqueue ...")
            enq = results["enqueue"] = enqueue_cost(args.redis_url, _other_db(args.redis_url), prefix,
                                                    args.n, args.reps)
            emit("enqueue", table(
                ["path", "timed", "off µs", "on µs", "off CPU µs", "on CPU µs", "on / off", "per rep"],
                [row for k, v in enq.items() for row in (
                    [k, f"blocks of {args.n}, {args.reps} reps", v["off"], v["on"], v["off_cpu"],
                     v["on_cpu"], f"{v['ratio']:.3f}", " / ".join(f"{r:.2f}" for r in v["ratios"])],
                    [k, f"interleaved call by call, {args.n} each", v["il_off"], v["il_on"],
                     v["il_off_cpu"], v["il_on_cpu"], f"{v['il_ratio']:.3f}", None])]))
        if "worker" in args.only:
            log("worker ...")
            wk = results["worker"] = worker_commands(args.redis_url, prefix, args.tasks)
            rows = []
            for name, v in wk.items():
                for side in ("producer", "start", "worker"):
                    per_task = None if side == "start" else sum(v[side].values()) / args.tasks
                    rows.append([name, {"start": "worker start"}.get(side, side), per_task,
                                 ", ".join(f"{k} {c}" for k, c in sorted(v[side].items()))])
            emit("worker", table(["intents", "side", "store commands / task", "commands (all tasks)"],
                                 rows))
        if "e2e" in args.only:
            log(f"end to end: {args.e2e_tasks} messages per batch, {args.e2e_reps} reps ...")
            from bench.e2e import INTENTS

            summ = results["e2e"] = end_to_end(args.redis_url, prefix, args.e2e_tasks, args.e2e_reps)
            shown = ("plain", "idem/redis", INTENTS)
            emit("e2e", table(
                ["workload", "system", "tasks/s (median)", "per rep", "ratio vs plain", "per-rep ratio",
                 "published", "bodies", "worker CPU µs/task", "delay() CPU µs/task"],
                [[x.workload, x.system, x.rate, " / ".join(f"{r:.0f}" for r in x.rates),
                  f"{x.ratio:.2f}" if x.ratio is not None else None,
                  " / ".join(f"{r:.2f}" for r in x.ratios) or None, x.published, x.bodies,
                  x.worker_cpu_us, x.producer_cpu_us]
                 for x in summ if x.system in shown]))
        server = PrivateRedis()
        try:
            with _stores(args.redis_url, args.pg_url if args.pg else None, prefix) as stores:
                if "relay" in args.only:
                    rows = []
                    for name, store in stores.items():
                        n = args.relay_redis if name == "redis" else args.relay_pg
                        log(f"relay throughput, {name}: {n} lost intents, {args.relay_reps} reps ...")
                        r = relay_throughput(store, server.url, n, f"{prefix}{name}", args.relay_reps,
                                             args.profile)
                        results[f"relay/{name}"] = r
                        if r.get("profile"):
                            log(r["profile"])
                        for variant, v in r["variants"].items():
                            rows.append([name, variant, n, v["relayed"], v["sent"], v["passes"],
                                         v["rate"], " / ".join(f"{x:.0f}" for x in v["rates"]),
                                         v["cpu_us"], 1e6 / v["cpu_us"]])
                    emit("relay", table(["store", "relay", "lost intents", "re-sent (min)",
                                         "in the queue (min)", "passes", "intents/s (median)",
                                         "per rep", "relay CPU µs/intent", "intents per CPU s"],
                                        rows))
                if "rest" in args.only:
                    rows = []
                    for name, store in stores.items():
                        log(f"relay at rest, {name}: {args.rest:.0f} s ...")
                        r = results[f"rest/{name}"] = at_rest(store, server.url, args.rest)
                        rows.append([name, r["seconds"], r["calls"], f"{r['rate']:.2f}"])
                    emit("rest", table(["store", "seconds", "store round trips", "per second"], rows))
        finally:
            server.stop()
    finally:
        cleanup(args.redis_url, prefix)
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.intents", description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=2000, help="delay() calls per block (default 2000)")
    p.add_argument("--reps", type=int, default=6, help="blocks per system and path (default 6)")
    p.add_argument("--tasks", type=int, default=1000, help="tasks of the worker count (default 1000)")
    p.add_argument("--relay-redis", type=int, default=5000)
    p.add_argument("--relay-pg", type=int, default=2000)
    p.add_argument("--relay-reps", type=int, default=3)
    p.add_argument("--rest", type=float, default=10.0, help="seconds of the at-rest count")
    p.add_argument("--e2e-tasks", type=int, default=1000, help="messages per end-to-end batch")
    p.add_argument("--e2e-reps", type=int, default=3)
    p.add_argument("--only", default="enqueue,worker,relay,rest,e2e",
                   help="the parts to run (default: all of enqueue,worker,relay,rest,e2e)")
    p.add_argument("--write-docs", action="store_true",
                   help="write the section 'Intents (measured <date>)' of docs/benchmarks.md")
    p.add_argument("--profile", action="store_true", help="cProfile a second relay round")
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    p.add_argument("--pg-url", default=DEFAULT_PG)
    p.add_argument("--no-pg", dest="pg", action="store_false")
    args = p.parse_args(argv)
    args.only = {x.strip() for x in args.only.split(",")}

    tables: dict[str, str] = {}

    def emit(name: str, text: str) -> None:
        tables[name] = text
        print(f"\n[{name}]\n{text}", flush=True)

    from bench.intents_doc import section, write_docs

    load0, started = os.getloadavg()[0], time.monotonic()
    results = run(args, emit)
    text = section(results, tables, args, (load0, os.getloadavg()[0]), time.monotonic() - started)
    print("\n" + text)
    if args.write_docs:
        log(f"wrote {write_docs(text)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
