"""``python -m bench``: run the benchmarks, print the tables, optionally rewrite docs/benchmarks.md."""

from __future__ import annotations

import argparse
import os
import re
import secrets
import sys
import time
from typing import Any

import redis

from . import chart, growth, inflight, micro, tracer
from .app import peer_status
from .e2e import ACCEL_OFF, ASKSTORE, NOCHECK, PEERS, Plan, Summary, measure, sql_table, summarize
from .report import REFERENCE_MS, ROOT, cpu_reference_ms, machine, table

DOCS = ROOT / "docs" / "benchmarks.md"
CHART = ROOT / "docs" / "img" / "throughput.png"
DEFAULT_PG = "db+postgresql+psycopg://root@127.0.0.1:5432/test"


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    p.add_argument("--tasks", type=int, default=2000, help="messages per batch (default 2000)")
    p.add_argument("--reps", type=int, default=3, help="repetitions per system (default 3)")
    p.add_argument("--io-tasks", type=int, default=None,
                   help="messages per batch of the realistic row, each body sleeping 10 ms "
                        "(default: tasks / 5; 0 leaves the row out)")
    p.add_argument("--pools", default="prefork,solo", help="worker pools: prefork (-c 2), solo")
    p.add_argument("--store", choices=("redis", "postgres", "both"), default="both")
    p.add_argument("--quick", action="store_true",
                   help="a ~1-minute run (500 tasks, 1 rep, short loops)")
    p.add_argument("--write-docs", action="store_true",
                   help=f"overwrite {DOCS.relative_to(ROOT)}")
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    p.add_argument("--pg-url", default=DEFAULT_PG, help="the SQL store's URL (db+postgresql+psycopg://...)")
    p.add_argument("--no-e2e", action="store_true", help="only the in-process measurements")
    p.add_argument("--no-peers", action="store_true",
                   help="leave out celery_once, celery-singleton, Powertools")
    p.add_argument("--no-growth", action="store_true",
                   help="leave out the growth test (private redis-server)")
    args = p.parse_args(argv)
    args.pools = [x.strip() for x in args.pools.split(",") if x.strip()]
    for pool in args.pools:
        if pool not in ("prefork", "solo"):
            p.error(f"unknown pool {pool!r} (prefork, solo)")
    if args.quick:
        if "--tasks" not in (argv or sys.argv):
            args.tasks = 500
        if "--reps" not in (argv or sys.argv):
            args.reps = 1
    if args.tasks < 8 or args.reps < 1:
        p.error("--tasks must be >= 8 and --reps >= 1")
    if args.io_tasks is None:
        args.io_tasks = max(8, args.tasks // 5)
    return args


class Out:
    """Collects Markdown sections; prints each as it is added."""

    def __init__(self) -> None:
        self.sections: list[str] = []

    def add(self, heading: str, body: str) -> None:
        text = f"## {heading}\n\n{body.strip()}\n"
        self.sections.append(text)
        print("\n" + text, flush=True)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def probe_pg(url: str, prefix: str, table_name: str) -> tuple[bool, str]:
    """Whether the SQL store works on PostgreSQL (claim, record, get on the private table)."""
    try:
        from celery_idem.records import State
        from celery_idem.stores.sql import SQLStore

        store = SQLStore.from_url(url, prefix=prefix, table_name=table_name)
        try:
            c = store.claim("probe", owner="bench", task_id="probe", attempt=0, lease=60, ttl=600)
            store.record("probe", c.token, state=State.DONE, content_type="application/json;utf-8",
                         data=b"1", ttl=600)
            rec = store.get("probe")
            if rec is None or rec.state is not State.DONE:
                return False, f"the probe record reads back as {rec!r}"
            import sqlalchemy as sa

            with store._engine.connect() as conn:
                version = str(conn.execute(sa.text("SHOW server_version")).scalar_one())
                # Every verb is its own transaction: what a commit costs is part of its latency.
                durable = ", ".join(f"{name}={conn.execute(sa.text(f'SHOW {name}')).scalar_one()}"
                                    for name in ("synchronous_commit", "fsync"))
                version = f"{version}; {durable}"
        finally:
            store.close()
        return True, version
    except Exception as exc:  # report, skip the SQL store
        return False, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def drop_table(url: str, table_name: str) -> None:
    try:
        import sqlalchemy as sa
    except ImportError:
        return
    engine = sa.create_engine(url[3:] if url.startswith("db+") else url)
    try:
        with engine.begin() as conn:
            conn.execute(sa.text(f'DROP TABLE IF EXISTS "{table_name}"'))
    except Exception as exc:
        log(f"could not drop the table {table_name}: {exc}")
    finally:
        engine.dispose()


def cleanup(client: redis.Redis, prefix: str) -> int:
    """Delete every key under the run's prefix; returns how many are left (should be 0)."""
    deleted = 0
    for _ in range(3):
        # celery_once's locks are qo_<task>_<args>: the run's prefix is inside the action.
        names = list(client.scan_iter(match=prefix + "*", count=1000))
        names += list(client.scan_iter(match="qo_*" + prefix + "*", count=1000))
        for i in range(0, len(names), 500):
            deleted += int(client.unlink(*names[i:i + 500]))
        if not names:
            break
    left = sum(1 for _ in client.scan_iter(match=prefix + "*", count=1000))
    left += sum(1 for _ in client.scan_iter(match="qo_*" + prefix + "*", count=1000))
    log(f"cleanup: deleted {deleted} keys under {prefix!r}; {left} left")
    return left


def fmt_us(t: micro.Timing) -> list[Any]:
    return [t.median_us, t.p90_us, t.cpu_us, t.server_us]


PEER_ROWS = [
    ["celery_once (`QueueOnce`, graceful)", "`apply_async`: `SET NX EX` lock; worker: `DEL` after the body",
     "2 (producer 1, worker 1)", "no",
     "no: it refuses a duplicate only while the original is queued or running; a later one runs again"],
    ["celery-singleton (`Singleton`)", "`apply_async`: `SET NX` lock holding the task id; worker: `DEL` "
     "after the body", "2 (producer 1, worker 1); a duplicate 2 (`SET NX` + `GET`)", "no",
     "no: the same lock-while-queued semantics (a duplicate gets the original's AsyncResult)"],
    ["powertools (`idempotent_function`, `RedisCachePersistenceLayer`, in a plain task)",
     "worker only: `SET NX` an in-progress record, then `SET` the result", "2 (worker); a duplicate 2 "
     "(`SET NX` fails + `GET`)", "yes (JSON, 1 h)",
     "yes on unique tasks; on duplicates a copy arriving while the original runs fails"],
    ["IdempotentTask (Redis store)", "producer: `GET` of the record (answers a done key without "
     "publishing); worker: claim + record scripts, the record also writing Celery's result",
     "3 (producer 1, worker 2, the result included); a duplicate 1 (producer)", "yes", "-"],
]
PEER_NOTES = table(["system", "where it acts", "round trips per first run", "caches results",
                    "comparable work"], PEER_ROWS) + (
    "\n\nThe peers run on the same worker as `plain` (Redis broker, backend and their locks on the "
    "shared Redis, under the run's prefix), wrapping the same no-op body.")


US_HEADERS = ["median µs", "p90 µs", "client CPU µs", "server µs"]
SERVER_NOTE = (
    "\n\n*client CPU* is the median CPU time of the calling thread per call. *server µs* is "
    "Redis's own time per EVALSHA (`INFO commandstats` deltas), shown only when no other client ran "
    "a script during the loop (the server is shared).")


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    started = time.monotonic()
    prefix = f"bench{secrets.token_hex(3)}:"  # 12 characters, as long as the default "celery-idem:"
    table_name = sql_table(prefix)
    client = redis.Redis.from_url(args.redis_url)
    client.ping()
    stores = ["redis", "postgres"] if args.store == "both" else [args.store]
    notes: list[str] = []
    pg_ok, pg_info = False, "not requested"
    if "postgres" in stores:
        pg_ok, pg_info = probe_pg(args.pg_url, prefix + "probe:", table_name)
        if not pg_ok:
            note = f"SQL store skipped: it failed on PostgreSQL ({pg_info})."
            notes.append(note)
            log(note)
            stores.remove("postgres")
    if not stores:
        log("nothing to measure: no store works")
        drop_table(args.pg_url, table_name)
        return 1
    q = args.quick
    n_floor, n_mem, n_redis, n_sql, n_comp, n_eager, n_prof = (
        (500, 5000, 500, 100, 300, 200, 300) if q else (3000, 20000, 3000, 500, 2000, 1000, 2000))
    out = Out()
    results: dict[str, Any] = {"notes": notes}
    if not args.no_peers:
        for name, why in peer_status().items():
            if why:
                notes.append(f"peer {name} left out: it does not import ({why}).")
    load0 = os.getloadavg()
    try:
        _micro(out, results, client, args, prefix, table_name, pg_ok and "postgres" in stores,
               (n_floor, n_mem, n_redis, n_sql, n_comp, n_eager, n_prof))
        if not args.no_e2e:
            plan = Plan(args.tasks, args.reps, args.pools, stores, warmup=30 if q else 100,
                        peers=not args.no_peers, io_tasks=args.io_tasks)
            log(f"end to end: {args.tasks} messages per batch, {args.reps} rep(s), pools {args.pools}, "
                f"stores {stores}")
            pg_url = args.pg_url if "postgres" in stores else None
            batches = measure(plan, args.redis_url, pg_url, prefix, log)
            results["e2e"] = summarize(batches)
            _e2e_tables(out, results["e2e"], plan)
        if not args.no_e2e:
            _inflight(out, results, args, prefix)
        load1 = os.getloadavg()
        if not args.no_growth:
            _growth(out, results, args, table_name, pg_ok and "postgres" in stores)
        if results.get("e2e") and args.write_docs:  # the chart belongs to the page's figures
            results["chart"] = chart.throughput(results["e2e"], CHART)
            log(f"wrote {CHART}")
        results["cpu_ref_ms"] = cpu_reference_ms()
        results["kept"] = kept_sections(DOCS.read_text()) if DOCS.exists() else {}
        # After the unique-task table, where the page had it (at the end without one).
        at = next((i + 1 for i, sec in enumerate(out.sections)
                   if sec.startswith("## End to end: unique")), len(out.sections))
        out.sections[at:at] = list(results["kept"].values())
        _targets(out, results)
        _profile_section(out, results)
        results["machine"] = machine(client, pg_info if pg_ok else None, results["cpu_ref_ms"])
        results["load"] = (load0, load1)
        results["elapsed"] = time.monotonic() - started
        results["args"] = args
        if args.write_docs:
            DOCS.write_text(_docs(out, results))
            log(f"wrote {DOCS}")
    finally:
        left = cleanup(client, prefix)
        if "postgres" in (["redis", "postgres"] if args.store == "both" else [args.store]):
            drop_table(args.pg_url, table_name)
        client.close()
    log(f"done in {time.monotonic() - started:.0f} s")
    return 1 if left else 0


# -- the in-process measurements ---------------------------------------------------------------


def _micro(out: Out, results: dict[str, Any], client: redis.Redis, args: argparse.Namespace, prefix: str,
           table_name: str, pg: bool, sizes: tuple[int, ...]) -> None:
    from celery_idem.stores.memory import MemoryStore
    from celery_idem.stores.redis import RedisStore

    n_floor, n_mem, n_redis, n_sql, n_comp, n_eager, n_prof = sizes
    log("Redis floor ...")
    floor = micro.redis_floor(client, prefix, n_floor)
    results["floor"] = floor
    sql_floor = micro.sql_floor(args.pg_url, max(100, n_floor // 5)) if pg else {}
    results["sql_floor"] = sql_floor
    rows = [[name, *fmt_us(t)] for name, t in {**floor, **sql_floor}.items()]
    out.add("Round-trip floor (loopback)", table(["operation", *US_HEADERS], rows) + SERVER_NOTE)

    log("gate ...")
    gate: dict[str, dict[str, micro.Timing]] = {
        "memory": micro.gate_timings(MemoryStore(prefix), prefix, n_mem, "m")}
    counting = RedisStore.from_url(args.redis_url, prefix=prefix, connection_class=micro.CountingConnection)
    trivial = counting.client.register_script("return 1")
    raw = micro.RawRedis(client)
    gate["redis"] = micro.gate_timings(counting, prefix, n_redis, "r", count=lambda: micro.Counter.replies,
                                       floor=lambda i: trivial(), raw_floor=raw.evalsha)
    raw.close()
    if pg:
        gate["postgres"] = micro.sql_gate(args.pg_url, prefix, table_name, n_sql, "s")
        log("SQL store: fast path and SQLAlchemy path ...")
        paths = micro.sql_paths(args.pg_url, prefix, table_name, n_sql, "sp")
        results["sql_paths"] = paths
        out.add("The SQL store's paths (PostgreSQL, `Gate.run`, timed in turn)", table(
            ["path / run", "median µs", "p90 µs", "client CPU µs", "round trips / call"],
            [[k, t.median_us, t.p90_us, t.cpu_us, t.round_trips] for k, t in paths.items()]) +
            "\n\nThe same store class on the same table: the *fast path* runs each verb's pre-built "
            "statement on the pooled psycopg connection as a prepared statement (the default with "
            "psycopg 3); the *SQLAlchemy path* is the same store with it turned off, executing the same "
            "pre-built statements through a SQLAlchemy `Connection` (what every other driver and "
            "dialect does); *synchronous_commit=off* is the fast path without waiting for the WAL "
            "flush of each commit, measured to show what durability costs (not a recommendation). "
            "Round trips: psycopg's network exchanges per call.")
    results["gate"] = gate
    rows = []
    for store, ts in gate.items():
        for kind in ("first", "duplicate"):
            t = ts[kind]
            ev = ts.get(f"floor/{kind}")
            rw = ts.get(f"raw/{kind}")
            cpu_beyond = wall_beyond = raw_beyond = None
            if ev is not None and t.round_trips is not None:
                cpu_beyond = t.cpu_us - t.round_trips * ev.cpu_us
                wall_beyond = t.median_us - t.round_trips * ev.median_us
            if rw is not None and t.round_trips is not None:
                raw_beyond = t.cpu_us - t.round_trips * rw.cpu_us
            trips = t.round_trips
            if t.split is not None:
                trips_s = f"{trips:g} ({t.split:g} of them through SQLAlchemy)"
            else:
                trips_s = "0 (in process)" if store == "memory" else f"{trips:g}"
            rows.append([store, kind, t.median_us, t.p90_us, t.cpu_us, trips_s,
                         None if ev is None else f"{ev.median_us:.0f} / {ev.cpu_us:.0f}",
                         None if rw is None else f"{rw.median_us:.0f} / {rw.cpu_us:.0f}",
                         cpu_beyond, raw_beyond, wall_beyond])
    out.add("The gate in process (`Gate.run`, no-op body)", table(
        ["store", "run", "median µs", "p90 µs", "client CPU µs", "round trips / call",
         "trivial EVALSHA in turn (redis-py), µs wall / CPU",
         "the same on a raw socket, µs wall / CPU", "CPU µs beyond round trips (redis-py)",
         "CPU µs beyond round trips (raw socket)", "wall µs beyond round trips (redis-py)"],
        rows) + (
        "\n\nEach Redis gate call is timed in turn with a trivial EVALSHA (`return 1`) on the same "
        "client, and on a raw socket (RESP by hand: the floor of a round trip here). "
        "*CPU beyond round trips* = client CPU - round trips x that EVALSHA's client CPU; "
        "*wall beyond* = median - round trips x its median. *client CPU* is the median CPU time of "
        "the calling thread per call."))

    log("per-task CPU budget: keys, enqueue check ...")
    keys = micro.key_timings(n_comp)
    results["keys"] = keys
    check = micro.enqueue_check_timings(counting, client, prefix, n_comp, "q")
    results["enqueue_check"] = check
    rows = [[f"key derivation (`idempotency_key_for`), {k} scalar arguments", t.median_us, t.p90_us,
             t.cpu_us, None] for k, t in keys.items()]
    rows.append(["enqueue check (`answer_from_record` on a new key: one `GET`)", check["check"].median_us,
                 check["check"].p90_us, check["check"].cpu_us, check["check"].server_us])
    rows.append(["raw-socket EVALSHA `return 1`, in turn with the check (the floor)",
                 check["raw"].median_us, check["raw"].p90_us, check["raw"].cpu_us, None])
    publish = micro.publish_timings(args.redis_url, prefix, n_comp, "pub")
    results["publish"] = publish
    rows += [[name, t.median_us, t.p90_us, t.cpu_us, None] for name, t in publish.items()]
    out.add("Per-task CPU budget (producer side)", table(["what", *US_HEADERS], rows) + (
        "\n\nKey derivation binds the call to the task's signature, writes the canonical JSON and "
        "hashes it (celery_idem/keys.py); the arguments are str, int and float in turn. The enqueue "
        "check is `answer_from_record` for a key never used: one `GET` through the store's wire "
        "(celery_idem/stores/redis_wire.py), answered None, so `delay()` publishes. The `delay()` "
        "rows publish to a real Redis broker (nothing consumes the queue), the store and the result "
        "backend on the same server, unique keys, timed in turn: with the check within the publish "
        "one script (celery_idem/enqueue_redis.py) reads the record and pushes the message; "
        "read first, the check is its own round trip before kombu's push (what happens with another "
        "broker, or when many of a task's enqueues are answered from the record: "
        "`celery_idem.enqueue_redis.WithinPublish`)."))

    log("lease renewals ...")
    results["lease"] = _lease_trips(counting, prefix)
    out.add("Round trips with long bodies (lease renewals)", table(
        ["lease s", "body s", "body / lease", "store round trips", "renewals (trips - 2)"],
        [[lease, body, f"{body / lease:.2f}", trips, trips - 2] for lease, body, trips in results["lease"]]) +
        "\n\n`Gate.run` on the Redis store with a sleeping body and a short lease; every store reply read is "
        "counted (the lease keeper's renewals run on its own thread, on the same client).")

    log("components ...")
    comp = micro.component_timings(counting, client, prefix, n_comp, "c")
    results["components"] = comp
    out.add("Hot-path components, each timed alone", table(
        ["component", *US_HEADERS], [[k, *fmt_us(t)] for k, t in comp.items()]) + SERVER_NOTE)

    log("task layer (eager) ...")
    eager = micro.eager_timings(args.redis_url, prefix, n_eager, "e")
    results["eager"] = eager
    rows = [[k, t.median_us, t.p90_us, t.cpu_us, t.round_trips] for k, t in eager.items()]
    out.add("The whole task layer in process (`task_always_eager`, Redis store)", table(
        ["call", "median µs", "p90 µs", "client CPU µs", "store round trips / call"], rows) +
        "\n\nA first `delay()` of an `IdempotentTask` costs one more store round trip than the gate's "
        "two: `apply_async` reads the record (`store.get`) to answer a done key without running it "
        "(eager mode reads first; through a Redis broker on the store's server the read rides on the "
        "publish, see the producer-side budget).")

    log("worker tracer ...")
    traced = tracer.tracer_timings(args.redis_url, prefix, n_eager, "tr")
    results["tracer"] = traced
    rows = [[k, t.median_us, t.p90_us, t.cpu_us, t.round_trips] for k, t in traced.items()]
    out.add("The worker's side in process (Celery's tracer, Redis backend and store)", table(
        ["task", "median µs", "p90 µs", "client CPU µs", "Redis round trips / task"], rows) +
        "\n\nWhat a pool child runs per message (`celery.app.trace.build_tracer`, not eager), without "
        "the broker: the body, then the result written to the Redis backend. A plain task's result "
        "costs two round trips (the backend's `GET` of the old meta, then `SET` + `PUBLISH` in one "
        "pipeline). An `IdempotentTask` claims, then records with a script that also writes that meta "
        "(celery_idem/results_redis.py): two round trips as well. *store elsewhere* has its "
        "store on another "
        "database of the server, so the record cannot carry the meta: the record, then the task's own "
        "`SET` + `PUBLISH` of the meta without the `GET`, three round trips. *result not folded* is the "
        "same task with `idempotency_fold_results = False`: the record, then Celery's own two. Timed "
        "in turn; every "
        "request the backend and the store send is counted (a pipeline is one).")

    log("record size ...")
    sizes_ = micro.record_sizes(client, counting, prefix, "m")
    results["record"] = sizes_
    rows = [[r.result_bytes, r.key_chars, r.fields, r.payload_bytes, r.encoding, r.memory_usage, r.overhead]
            for r in sizes_]
    out.add("Memory per done record (Redis `MEMORY USAGE ... SAMPLES 0`)", table(
        ["encoded result bytes", "key chars", "packed fields", "value bytes", "encoding",
         "MEMORY USAGE bytes", "bytes beyond the result"], rows) +
        f"\n\nThe key is `<12-character prefix><task name>:<32 hex>` ({sizes_[0].key_chars} characters, the "
        "prefix as long as the default `celery-idem:`). A record is one string (a marker, the state, "
        "token, updated time, task id, payload hash, content type code and the result; "
        "see docs/stores.md), so a larger result adds its own bytes and nothing else.")

    log("profiles ...")
    results["profiles"] = micro.profiles(args.redis_url, prefix, n_prof, "p",
                                         pg=(args.pg_url, table_name) if pg else None)
    results["pyinstrument"] = micro.pyinstrument_text(args.redis_url, prefix, n_prof, "pi")
    if pg:
        results["pyinstrument_pg"] = micro.pyinstrument_text(
            args.redis_url, prefix, max(200, n_prof // 4), "pq", pg=(args.pg_url, table_name))
    counting.close()


def _lease_trips(store: Any, prefix: str) -> list[tuple[float, float, int]]:
    import dataclasses
    import uuid

    from celery_idem.codec import KombuCodec
    from celery_idem.gate import Attempt, Gate

    _, task, _ = micro._bench_task(store, prefix)
    out = []
    for lease, body in ((0.9, 0.2), (0.9, 0.4), (0.9, 0.7)):
        cfg = dataclasses.replace(task.idempotency_config, lease=lease)
        gate = Gate(store, cfg, KombuCodec("json", ["json"]))
        att = Attempt(key=task.idempotency_key_for((f"lease:{lease}:{body}",)), task_id=str(uuid.uuid4()),
                      owner=micro.OWNER)
        before = micro.Counter.replies
        def sleeper(_token: int, b: float = body) -> dict[str, Any]:
            time.sleep(b)
            return micro.RESULT

        gate.run(att, sleeper)
        time.sleep(0.05)
        out.append((lease, body, micro.Counter.replies - before))
    return out


# -- end to end --------------------------------------------------------------------------------


def _e2e_tables(out: Out, summary: list[Summary], plan: Plan) -> None:
    def rates(s: Summary) -> str:
        return " / ".join(f"{r:.0f}" for r in s.rates)

    def ratios(s: Summary) -> str:
        return " / ".join(f"{r:.2f}" for r in s.ratios) or "n/a"

    def load(s: Summary) -> str:
        return f"{s.load[0]:.1f}-{s.load[1]:.1f}"

    uniq = [s for s in summary if s.workload == "unique"]
    rows = [[s.pool, s.system, s.rate, rates(s), s.ratio, ratios(s), s.worker_cpu_us, s.producer_cpu_us,
             s.cpu_ratio, s.enqueue, load(s)] for s in uniq]
    out.add(f"End to end: unique no-op tasks ({plan.tasks} per batch, {plan.reps} repetitions)", table(
        ["pool", "system", "tasks/s (median)", "per rep", "ratio vs plain", "per-rep ratio",
         "worker CPU µs/task", "delay() CPU µs/task", "CPU ratio", "enqueue s", "load"], rows) +
        "\n\nFrom the first `delay()` to the last result. *ratio vs plain* is the median of the "
        "per-repetition ratios, each idempotent batch against the plain batch measured just before it "
        "(pairing cancels slow drift of a shared machine). *worker CPU* is the user + system CPU of the "
        "worker's processes per message; *delay() CPU* is this process's CPU while enqueueing, per "
        "message (the wait for results is left out: it grows with the wait); *CPU ratio* compares their sums "
        "(less sensitive to other load than tasks/s). *enqueue s* is the time spent publishing (the worker "
        f"consumes meanwhile); *load* is the 1-minute load average after the batches "
        f"({os.cpu_count()} CPUs). "
        "`plain+acks_late` is the plain task with the ack mode `IdempotentTask` sets (`acks_late=True`).")
    io = [s for s in summary if s.workload == "io"]
    if io:
        rows = [[s.pool, s.system, s.rate, rates(s), s.ratio, ratios(s), s.worker_cpu_us,
                 s.producer_cpu_us, s.cpu_ratio, load(s)] for s in io]
        out.add(f"End to end, the realistic row: unique tasks whose body waits 10 ms "
                f"({plan.io_tasks} per batch, {plan.reps} repetitions)", table(
            ["pool", "system", "tasks/s (median)", "per rep", "ratio vs plain", "per-rep ratio",
             "worker CPU µs/task", "delay() CPU µs/task", "CPU ratio", "load"], rows) +
            "\n\nThe same systems and method as the unique no-op table, each body sleeping 10 ms first "
            "(`time.sleep`, a stand-in for an HTTP call). With `-P prefork -c 2` the ceiling is about "
            "200 tasks/s; what each system adds per task shows as its distance from it.")
    dup = [s for s in summary if s.workload == "duplicates"]
    rows = []
    for s in dup:
        rows.append([s.pool, s.system, s.messages, s.rate, rates(s), s.ratio,
                     f"{s.bodies} (once each: {s.messages // plan.copies})", s.cached, s.rejected,
                     s.published, s.failed, s.worker_cpu_us, s.producer_cpu_us])
    out.add(f"End to end: duplicate-heavy ({plan.tasks // plan.copies} actions x {plan.copies} copies)",
            table(["pool", "system", "messages", "tasks/s (median)", "per rep", "ratio vs plain",
                   "bodies run (median)", "answered at enqueue", "refused at enqueue", "published",
                   "failed", "worker CPU µs/msg", "delay() CPU µs/msg"], rows) +
            f"\n\nThe copies are enqueued in rounds (every action once, then again, {plan.copies} rounds). "
            "The body does `INCR` on a per-batch counter, so *bodies run* counts executions. A copy whose "
            "action is already done when it is enqueued is answered by `delay()` itself "
            "(a `CachedResult`, nothing published): that is why the idempotent system can beat plain here. "
            "*refused at enqueue*: celery_once (graceful) returns None for a copy whose original is still "
            "queued or running; celery-singleton returns the queued original's AsyncResult (not published, "
            "waits for it); both drop their lock when the body ends, so a later copy runs the body again. "
            "Powertools publishes every copy; the worker answers a done copy from its Redis record, and a "
            "copy arriving while the original runs *fails* (`IdempotencyAlreadyInProgressError`).")
    peers = [s for s in summary if s.system in PEERS]
    if peers:
        out.add("Peers: what each one does", PEER_NOTES)


# -- growth and SQL size -----------------------------------------------------------------------


def _inflight(out: Out, results: dict[str, Any], args: argparse.Namespace, prefix: str) -> None:
    q = args.quick
    log("in-flight copies: a running action, its copies, and a quick task ...")
    r = inflight.measure(args.redis_url, prefix, log, hold=4.0 if q else 15.0, reps=1 if q else 3)
    results["inflight"] = r
    idle = r["idle"]
    rows = [["idle (no action running)", f"{idle * 1000:.1f}", "1.0", "-", "-"]]
    rows += [[label, f"{row['latency'] * 1000:.1f}", f"{row['latency'] / idle:.1f}",
              "-" if row["later"] is None else f"{row['later'] * 1000:.1f}",
              f"{row['copies_done']:.1f}"] for label, row in r["paths"].items()]
    body = table(["path", "quick task right behind the copies, median ms", "x idle",
                  "the next quick tasks, median ms", "copies enqueued -> all results, median s"],
                 rows)
    body += (f"\n\n`celery worker -P prefork -c 2` on Redis. One action's body runs up to "
             f"{r['hold']:g} s (it is let go once the quick tasks are timed); {r['copies']} copies of "
             f"it are enqueued back to back, then an unrelated no-op task is enqueued and waited "
             f"for (then 4 more, one after the other), {r['reps']} rep(s) per path "
             f"(`bench/inflight.py`). The old "
             f"path is emulated on this version: the check off (every copy published) and "
             f"`idempotency_wait=10` (each delivered copy holds a pool process up to 10 s).")
    out.add("In-flight copies: a quick task beside a running action's copies", body)


def _growth(out: Out, results: dict[str, Any], args: argparse.Namespace, table_name: str, pg: bool) -> None:
    q = args.quick
    sizes = [1000, 100_000] if q else [1000, 100_000, 1_000_000]
    n = 300 if q else 1500
    log(f"growth (private redis-server): {sizes} done keys ...")
    rows = growth.redis_growth(sizes, n, log)
    if pg:
        log("PostgreSQL bytes per record ...")
        results["pg_size"] = growth.pg_record_size(args.pg_url, table_name + "_size", 300 if q else 1000)
        drop_table(args.pg_url, table_name + "_size")
        log(f"growth (PostgreSQL, private table): {sizes} rows ...")
        rows += growth.pg_growth(args.pg_url, table_name + "_grow", sizes, 200 if q else 800, log)
    results["growth"] = rows
    body = table(["store", "records in the store", "claim, new key: median µs", "p90 µs",
                  "claim, done key (duplicate): median µs", "p90 µs", "fill s",
                  "MB (Redis used_memory / table + indexes)"],
                 [[r.store, f"{r.keys:,}", r.new.median_us, r.new.p90_us, r.duplicate.median_us,
                   r.duplicate.p90_us, r.fill_seconds, None if r.used_memory is None else
                   f"{r.used_memory / 1e6:.0f}"] for r in rows])
    body += ("\n\nRedis: a private `redis-server` (started on a free port, killed afterwards), filled "
             "server-side with done records in the store's own packed format (a 37-byte JSON result, "
             "a 1-day TTL). PostgreSQL: a private table filled with `INSERT ... SELECT "
             "generate_series`, then `ANALYZE`. At each size a claim of a new key and a claim of a done key "
             "are timed in turn (`RedisStore.claim` / `SQLStore.claim` called directly).")
    shared = next((x.shared_buffers for x in rows if x.shared_buffers), None)
    if shared:
        body += f" The PostgreSQL server's `shared_buffers` is {shared}."
    out.add("Growth: claim latency as the store fills", body)
    ps = results.get("pg_size")
    if ps:
        out.add("Memory per done record (PostgreSQL)", table(
            ["rows", "total bytes/row (pg_total_relation_size)", "heap bytes/row", "index bytes/row",
             "tuple bytes (avg pg_column_size)", "encoded result bytes"],
            [[ps["rows"], ps["total"], ps["heap"], ps["indexes"], ps["tuple"], ps["result"]]]) +
            "\n\nReal done records written by `SQLStore.claim` + `SQLStore.record` (a UUID task id, the "
            "owner `host:pid`, a 61-character key) in a private table; sizes from the catalog after the "
            "inserts (no VACUUM). The three indexes (primary key, `state`, `expires`) take more than "
            "the rows.")


# -- targets -----------------------------------------------------------------------------------


#: Sections of docs/benchmarks.md that another command writes (``python -m bench.dbbackend e2e``
#: takes its own half hour; ``python -m bench.revisions`` compares git revisions, ``python -m
#: bench.accel`` and ``python -m bench.intents --write-docs`` measure on their own) or that record
#: a feature's measured runs: ``--write-docs`` carries them over from the page as they are. Each
#: entry is the start of a heading (a dated heading keeps its date).
KEPT_SECTIONS = (
    "End to end: PostgreSQL store against plain Celery with the database backend",
    "In-flight copies (",
    "Accelerations on and off (",
    "Trust at the edge (",
    "Each fast path alone against its plain twin",
    "Intents (",
)


def kept_sections(page: str) -> dict[str, str]:
    """The :data:`KEPT_SECTIONS` found in ``page`` (the entry it starts with -> its Markdown)."""
    found: dict[str, str] = {}
    for part in re.split(r"(?m)^(?=## )", page):
        heading = part[3:].split("\n", 1)[0].strip() if part.startswith("## ") else ""
        entry = next((k for k in KEPT_SECTIONS if heading.startswith(k)), None)
        if entry is not None:
            found[entry] = part.rstrip() + "\n"
    return found


def _db_backend_row(section: str) -> list[Any] | None:
    """The PostgreSQL target's row, read from the kept section's bold (folded) ratio."""
    m = re.search(r"\*\*(\d+\.\d+)\*\* \(([\d.]+)-([\d.]+)\)", section)
    if m is None:
        return None
    v = float(m.group(1))
    return ["throughput ratio vs plain Celery with the db+postgresql backend, PostgreSQL store "
            "(`python -m bench.dbbackend e2e`, section above)", ">= 0.95",
            f"{v:.2f} ({m.group(2)}-{m.group(3)})", "met" if v >= 0.95 else "**MISSED**"]


def _targets(out: Out, r: dict[str, Any]) -> None:
    rows: list[list[Any]] = []

    def ratio(pool: str, system: str) -> float | None:
        for s in r.get("e2e", []):
            if s.workload == "unique" and s.pool == pool and s.system == system:
                return s.ratio  # type: ignore[no-any-return]
        return None

    def verdict(ok: bool | None) -> str:
        return "n/a" if ok is None else ("met" if ok else "**MISSED**")

    for system, goal in (("idem/redis", 0.95), (NOCHECK, 0.98), ("idem/postgres", 0.90)):
        v = ratio("prefork", system)
        if v is None and system != "idem/redis":
            continue
        rows.append([f"throughput ratio vs plain, prefork, {_label(system)}", f">= {goal:.2f}",
                     "n/a" if v is None else f"{v:.3f}", verdict(None if v is None else v >= goal)])
    for s in r.get("e2e", []):
        # The goals are for the default settings; accelerations off is reported on its own row.
        if (s.workload == "unique" and s.pool == "prefork" and s.system.startswith("idem/") and s.cpu_ratio
                and not s.system.endswith(ACCEL_OFF)):
            goal = 0.90 if s.system.startswith("idem/postgres") else 0.98 if s.system == NOCHECK else 0.95
            est = 1 / s.cpu_ratio
            rows.append([f"cross-check: plain / idempotent CPU per task, prefork, {_label(s.system)}",
                         f">= {goal:.2f}", f"{est:.3f}", verdict(est >= goal)])
    by = {(s.workload, s.pool, s.system): s for s in r.get("e2e", [])}
    rows += accel_rows(by)
    late = by.get(("unique", "prefork", "plain+acks_late"))
    for system in ("idem/redis", NOCHECK):
        s = by.get(("unique", "prefork", system))
        if s is not None and s.ratio is not None and late is not None and late.ratio:
            # IdempotentTask acks late (a killed worker's message is redelivered): plain Celery
            # with the same delivery guarantee is plain+acks_late, measured in the same run.
            rows.append([f"throughput vs plain with the same ack mode (acks_late), prefork, "
                         f"{_label(system)}: ratio / plain+acks_late's ratio", "reported",
                         f"{s.ratio / late.ratio:.3f} ({s.ratio:.3f} / {late.ratio:.3f})", "reported"])
    # Ahead of every peer on unique tasks in the same run (prefork), by the paired ratios.
    idem_u = by.get(("unique", "prefork", "idem/redis"))
    for peer in PEERS:
        p = by.get(("unique", "prefork", peer))
        if idem_u is None or p is None or idem_u.ratio is None or p.ratio is None:
            continue
        tie = " (within 5%: a tie on this machine)" if abs(idem_u.ratio / p.ratio - 1) < 0.05 else ""
        rows.append([f"ahead of {peer}, unique, prefork (ratio vs plain in the same run)",
                     "idem/redis > peer", f"{idem_u.ratio:.3f} vs {p.ratio:.3f}{tie}",
                     verdict(idem_u.ratio > p.ratio)])
    for (workload, pool, system), s in by.items():
        if workload != "duplicates" or not system.startswith("idem/") or s.ratio is None:
            continue
        actions = s.messages // 4
        if system == "idem/redis":  # the target is for the default settings (enqueue check on)
            rows.append([f"duplicates x4, {pool}, {_label(system)}: throughput vs plain", ">= 3x",
                         f"{s.ratio:.2f}x", verdict(s.ratio >= 3)])
        rows.append([f"duplicates x4, {pool}, {_label(system)}: bodies run", f"{actions} (one per action)",
                     f"{s.bodies}", verdict(s.bodies == actions)])
    inflight = r.get("inflight")
    if inflight:
        idle = inflight["idle"]
        for label, row in inflight["paths"].items():
            x = row["latency"] / idle
            default = label.startswith("attach")
            rows.append([f"quick task latency with {inflight['copies']} copies of a running action "
                         f"in flight, {label}: x its idle latency", "<= 2x" if default else "reported",
                         f"{x:.1f}x ({row['latency'] * 1000:.1f} ms vs {idle * 1000:.1f} ms)",
                         verdict(x <= 2) if default else "reported"])
    io_rows = [s for s in r.get("e2e", []) if s.workload == "io" and s.ratio is not None]
    for s in io_rows:
        rows.append([f"realistic row (10 ms body), {s.pool}, {s.system}: ratio vs plain", "reported",
                     f"{s.ratio:.3f} ({s.rate:.0f} tasks/s)", "reported"])
    for count, t in sorted(r.get("keys", {}).items()):
        goal = 40.0
        rows.append([f"key derivation CPU µs, {count} scalar arguments",
                     "<= 40" if count <= 8 else "reported (<= 40 is for a handful)", f"{t.cpu_us:.1f}",
                     verdict(t.cpu_us <= goal) if count <= 8 else
                     ("met" if t.cpu_us <= goal else "reported")])
    check = r.get("enqueue_check")
    if check:
        c, raw = check["check"], check["raw"]
        rows.append(["enqueue check client CPU µs (one GET; client CPU excludes the server's time)",
                     "<= 60", f"{c.cpu_us:.0f}", verdict(c.cpu_us <= 60)])
        rows.append(["enqueue check client CPU µs beyond a raw-socket round trip (stricter reading)",
                     "<= 60", f"{c.cpu_us - raw.cpu_us:.0f}", verdict(c.cpu_us - raw.cpu_us <= 60)])
        rows.append(["raw-socket round trip (trivial EVALSHA), client CPU µs / wall µs: the floor",
                     "reported", f"{raw.cpu_us:.0f} / {raw.median_us:.0f}", "reported"])
    pub = r.get("publish")
    if pub:
        within = pub[micro.PUBLISH_WITHIN].cpu_us - pub[micro.PUBLISH_OFF].cpu_us
        rows.append(["enqueue check within the publish: delay() client CPU µs beyond the check off "
                     "(the default with a Redis broker on the store's server)", "<= 60",
                     f"{within:.0f}", verdict(within <= 60)])
        first = pub[micro.PUBLISH_FIRST].cpu_us - pub[micro.PUBLISH_OFF].cpu_us
        rows.append(["enqueue check read first: delay() client CPU µs beyond the check off",
                     "reported", f"{first:.0f}", "reported"])
    g = r["gate"]["redis"]
    for kind, goal in (("first", 2), ("duplicate", 1)):
        v = g[kind].round_trips
        rows.append([f"Redis round trips per gate call, {kind}", f"{goal}", f"{v:g}", verdict(v == goal)])
    for kind in ("first", "duplicate"):
        t, ev = g[kind], g[f"floor/{kind}"]
        beyond = t.cpu_us - (t.round_trips or 0) * ev.cpu_us
        rows.append([f"worker-side gate client CPU µs beyond its round trips (redis-py), {kind}", "<= 60",
                     f"{beyond:.0f}", verdict(beyond <= 60)])
        rw = g.get(f"raw/{kind}")
        if rw is not None:
            raw_beyond = t.cpu_us - (t.round_trips or 0) * rw.cpu_us
            rows.append([f"worker-side gate client CPU µs beyond its round trips (raw socket; "
                         f"stricter reading), {kind}", "<= 60", f"{raw_beyond:.0f}",
                         verdict(raw_beyond <= 60)])
        wall = t.median_us - (t.round_trips or 0) * ev.median_us
        rows.append([f"gate wall µs beyond its round trips, {kind} (Redis; stricter reading)", "<= 60",
                     f"{wall:.0f}", verdict(wall <= 60)])
    mem = r["gate"]["memory"]["first"].median_us
    rows.append(["gate µs with the in-process store, first (cross-check)", "<= 50", f"{mem:.0f}",
                 verdict(mem <= 50)])
    small = r["record"][0]
    rows.append([f"done record bytes beyond the encoded result ({small.result_bytes} B JSON)", "<= 200",
                 f"{small.overhead}", verdict(small.overhead <= 200)])
    big = r["record"][1]
    rows.append([f"the same, {big.result_bytes} B result ({big.encoding})", "<= 200", f"{big.overhead}",
                 verdict(big.overhead <= 200)])
    for lease, body, trips in r.get("lease", []):
        goal = 2 if body < lease / 3 else 2 + int(body / (lease / 3))
        rows.append([f"round trips, body {body:g} s with a {lease:g} s lease (renewals only past lease/3)",
                     f"{goal}", f"{trips}", verdict(trips == goal)])
    for store in ("redis", "postgres"):
        g = [x for x in r.get("growth", []) if x.store == store]
        if len(g) >= 2:
            lo, hi = g[0], g[-1]
            rows.append([f"claim latency flat, {store}, {lo.keys:,} -> {hi.keys:,} records (new / duplicate)",
                         "within 25%", f"{lo.new.median_us:.0f} -> {hi.new.median_us:.0f} / "
                         f"{lo.duplicate.median_us:.0f} -> {hi.duplicate.median_us:.0f} µs",
                         verdict(_flat(lo, hi))])
    db_row = _db_backend_row(r.get("kept", {}).get(KEPT_SECTIONS[0], ""))
    if db_row is not None:
        rows.append(db_row)
    for row in rows:
        row.append(_why(row[0], row[-1], r) if "MISSED" in row[-1] else "")
    r["targets"] = rows
    out.add("Targets", table(["target", "goal", "measured", "verdict", "why (for a miss)"], rows))


def accel_rows(by: dict[tuple[str, str, str], Summary]) -> list[list[Any]]:
    """What the accelerations buy: each store's unique-task ratio vs plain with them on
    and off, measured interleaved in the same run (prefork)."""
    rows: list[list[Any]] = []
    for store in ("redis", "postgres"):
        on = by.get(("unique", "prefork", f"idem/{store}"))
        off = by.get(("unique", "prefork", f"idem/{store}{ACCEL_OFF}"))
        if on is None or off is None or on.ratio is None or off.ratio is None:
            continue
        per_rep = " / ".join(" ".join(f"{x:.2f}" for x in s.ratios) for s in (on, off))
        rows.append([f"throughput ratio vs plain, prefork, {store} store: accelerations on / off",
                     "reported", f"{on.ratio:.3f} / {off.ratio:.3f} (per rep: {per_rep})", "reported"])
    return rows


def _label(system: str) -> str:
    """``idem/redis`` -> "redis store"; the no-enqueue-check variant says so."""
    if system == NOCHECK:
        return "redis store, `idempotency_check_on_enqueue=False`"
    if system == ASKSTORE:
        return "redis store, copies ask the store"
    if system.endswith(ACCEL_OFF):
        return f"{system[5:-len(ACCEL_OFF)]} store, accelerations off"
    return f"{system[5:]} store"


def _why(target: str, verdict: str, r: dict[str, Any]) -> str:
    by = {(s.workload, s.pool, s.system): s for s in r.get("e2e", [])}
    plain = by.get(("unique", "prefork", "plain"))
    if target.startswith(("throughput ratio", "cross-check: plain")):
        store = "redis" if "redis" in target else "postgres"
        system = NOCHECK if "check_on_enqueue" in target else f"idem/{store}"
        s = by.get(("unique", "prefork", system))
        if s is None or plain is None:
            return ""
        dw, dp = s.worker_cpu_us - plain.worker_cpu_us, s.producer_cpu_us - plain.producer_cpu_us
        base = plain.worker_cpu_us + plain.producer_cpu_us
        share = 0.10 if store == "postgres" else 0.05
        ncpu = os.cpu_count() or 1
        text = (f"IdempotentTask adds {dw:.0f} µs worker CPU and {dp:.0f} µs in delay() on a {base:.0f} µs "
                f"plain task (CPU per task x{(base + dw + dp) / base:.2f}); ")
        if max(s.load[1], plain.load[1]) >= ncpu:
            # Saturated: every µs of CPU anywhere (producer, worker, Redis) delays the batch.
            text += (f"the run is CPU-bound (1-minute load up to {max(s.load[1], plain.load[1]):.1f} on "
                     f"{ncpu} shared CPUs), so throughput follows total CPU per task; {share:.0%} would "
                     f"allow {share * base / (1 - share):.0f} µs in all. ")
        else:
            # Not saturated: the batch time is the critical path (the single producer's loop, then
            # the workers), so added latency costs more than the CPU figure says.
            text += (f"the machine was not saturated (load {s.load[0]:.1f}-{s.load[1]:.1f} on {ncpu} CPUs), "
                     "so the batch time follows its critical path, not the CPU total: the single "
                     "producer's delay() loop, which the workers wait on, then the workers. ")
        late = by.get(("unique", "prefork", "plain+acks_late"))
        if system == NOCHECK:
            text += ("Without the enqueue check, delay() costs what plain's does; the worker pays 2 store "
                     "round trips per task (the claim, and the record that also writes Celery's result, "
                     "in place of the backend's GET and SET) and acks late")
            text += (f" (the ack mode alone, plain+acks_late in the same run: {late.ratio:.2f})."
                     if late is not None and late.ratio is not None else ".")
        elif store == "redis":
            nocheck = by.get(("unique", "prefork", NOCHECK))
            extra = ""
            if nocheck is not None and s.messages:
                extra = (f": enqueueing took {(s.enqueue - nocheck.enqueue) / s.messages * 1e6:.0f} µs "
                         f"more per task than without the check, and the run without it reached "
                         f"{nocheck.ratio:.2f}" if nocheck.ratio is not None else "")
            late = by.get(("unique", "prefork", "plain+acks_late"))
            text += ("The enqueue check rides on the publish here (one script reads the record and "
                     "pushes the message, no round trip of its own)" + extra + "; what is left is "
                     "the worker's 2 store round trips per task and the late ack")
            text += (f" (the ack mode alone, plain+acks_late in the same run: {late.ratio:.2f})."
                     if late is not None and late.ratio is not None else ".")
        else:
            paths = r.get("sql_paths")
            if paths:
                fast = paths["fast path/first"]
                text += (f"A first run's two statements cost {fast.cpu_us:.0f} µs of client CPU on the "
                         f"psycopg fast path but {fast.median_us:.0f} µs of wall time: each is its own "
                         "transaction and waits for a durable commit (WAL flush)")
                nd = paths.get(f"{micro.NOT_DURABLE}/first")
                if nd is not None:
                    text += f" ({nd.median_us:.0f} µs with synchronous_commit=off, measured only to show it)"
                text += (", and `-P prefork -c 2` has two children to overlap those waits. The worker CPU "
                         "figure grows with the wait too (the pool's parent loops more per task when "
                         "tasks are slower); PostgreSQL's own CPU per statement runs on the same 2 CPUs. "
                         "The Redis result backend's GET + SET cannot ride on a PostgreSQL record.")
        return text
    if target.startswith("duplicates x4") and "throughput" in target:
        pool = target.split(", ")[1]  # "duplicates x4, <pool>, redis store: throughput vs plain"
        d, dp = by.get(("duplicates", pool, "idem/redis")), by.get(("duplicates", pool, "plain"))
        if d is None or dp is None or not d.messages:
            return ""
        first = d.messages // 4
        copies, published = d.messages - first, d.published - first
        attached = copies - d.cached - published
        return (f"Of the {copies} copies, {d.cached} were answered from the record by delay() (a "
                f"CachedResult) and {attached} attached to their action's message (an "
                f"AttachedResult; a copy of this process's own message of the last second needs no "
                f"round trip); {published} were published: {d.published} messages for {first} "
                f"actions. What is left is the workers' pace: {first} gated bodies (a claim and a "
                f"record each; worker CPU {d.worker_cpu_us * 4:.0f} µs per body) against plain's "
                f"{d.messages} no-op bodies ({dp.worker_cpu_us:.0f} µs each), on the same two CPUs "
                f"as the producer.")
    if target.startswith("ahead of"):
        peer = target.split(",")[0][len("ahead of "):]
        mine, theirs = by.get(("unique", "prefork", "idem/redis")), by.get(("unique", "prefork", peer))
        cpu = ""
        if mine is not None and theirs is not None:
            a = mine.worker_cpu_us + mine.producer_cpu_us
            b = theirs.worker_cpu_us + theirs.producer_cpu_us
            cpu = (f"CPU per task (worker + delay(), less sensitive to other load): IdempotentTask "
                   f"{a:.0f} µs, {peer} {b:.0f} µs"
                   + (" (IdempotentTask uses less: the gap is not CPU but waiting). " if a < b
                      else " (IdempotentTask uses more). "))
        return (cpu + "the peers act in the worker only or hold a lock only (see \"Peers: what each one "
                "does\"); IdempotentTask also reads the record in delay() (within the publish: no "
                "round trip of its own) and acks late. Differences of a few per cent are within this "
                "machine's noise (see the per-repetition ratios).")
    if target.startswith("enqueue check") and verdict != "met":
        ref = r.get("cpu_ref_ms")
        c = r["enqueue_check"]["check"]
        if not ref:
            return ""
        return (f"on a core that runs the reference loop in {REFERENCE_MS:.0f} ms (this one: {ref:.0f} "
                f"ms) it would be about {c.cpu_us * REFERENCE_MS / ref:.0f} µs; the raw-socket floor of "
                f"the same round trip is {r['enqueue_check']['raw'].cpu_us:.0f} µs here.")
    if target.startswith(("worker-side gate client CPU", "gate µs with the in-process")) and verdict != "met":
        ref = r.get("cpu_ref_ms")
        if not ref:
            return ""
        kind = "first" if target.endswith("first") or ", first " in target else "duplicate"
        g = r["gate"]["redis"]
        if target.startswith("gate µs"):
            value = r["gate"]["memory"]["first"].median_us
        else:
            t = g[kind]
            ev = g[f"raw/{kind}"] if "raw socket" in target else g[f"floor/{kind}"]
            value = t.cpu_us - (t.round_trips or 0) * ev.cpu_us
        scaled = value * REFERENCE_MS / ref
        detail = ""
        if "raw socket" in target:
            comp = r["components"]
            mem = r["gate"]["memory"][kind].cpu_us
            verbs = ("store.claim (claimed)", "store.record") if kind == "first" else (
                "store.claim (done, duplicate)",)
            verb_cpu = sum(comp[v].cpu_us for v in verbs)
            detail = (f"What is left beyond the raw round trips: the gate's own work ({mem:.0f} µs with "
                      f"the in-process store: result encoding, the lease keeper's hold, events) and the "
                      f"store verbs' own client CPU ({verb_cpu:.0f} µs for {' + '.join(verbs)}, of which "
                      "redis-py's Connection send/read and parser, the arguments and the reply). ")
        return detail + (f"absolute CPU figures scale with the machine: this one runs the reference loop "
                f"(machine table) in {ref:.0f} ms; on a core that runs it in {REFERENCE_MS:.0f} ms this "
                f"figure would be about {scaled:.0f} µs, {'within' if scaled <= 60 else 'still over'} "
                "the target.")
    if target.startswith("gate wall"):
        kind = "first" if ", first " in target else "duplicate"
        t, ev = r["gate"]["redis"][kind], r["gate"]["redis"][f"floor/{kind}"]
        cpu_met = t.cpu_us - (t.round_trips or 0) * ev.cpu_us <= 60
        return ("wall time includes waiting for a shared server on a loaded machine; the CPU reading of "
                f"the same target is {'met' if cpu_met else 'missed too (see the row above)'}.")
    if target.startswith("done record bytes"):
        rec = r["record"][0]
        return (f"`MEMORY USAGE` counts the key itself ({rec.key_chars} characters) and Redis's per-key "
                f"overhead: beyond the result and the key the record takes {rec.overhead - rec.key_chars} "
                "bytes (a packed header with a 23-character task id and a ms timestamp, and Redis's "
                "allocation rounding).")
    if target.startswith("the same"):
        return ("Redis's allocator rounds a value up to its size class, so the overhead varies by a "
                "few bytes with the result's size; the header itself is the same.")
    if target.startswith("claim latency flat, postgres"):
        g = [x for x in r.get("growth", []) if x.store == "postgres"]
        return (f"a B-tree lookup is O(log n) and at {g[-1].keys:,} rows the table and its three "
                f"indexes ({(g[-1].used_memory or 0) / 1e6:.0f} MB) outgrow `shared_buffers` "
                f"({g[-1].shared_buffers}): index pages come from the OS cache; measured right after the "
                "bulk insert (autovacuum may run).")
    if target.startswith("claim latency flat, redis"):
        return ("a 1M-key keyspace dict no longer fits the CPU caches (one more cache miss per lookup); "
                "the claim stays O(1).")
    return ""


# -- profile -----------------------------------------------------------------------------------


def _profile_section(out: Out, r: dict[str, Any]) -> None:
    parts = []
    for p in r["profiles"]:
        cats = ", ".join(f"{k} {v:.0%}" for k, v in p.categories.items() if v >= 0.01)
        parts.append(f"### {p.label}\n\n{p.calls} calls, {p.seconds / p.calls * 1e6:.0f} µs per call under "
                     f"cProfile. Self time by where it is spent: {cats}.\n")
        parts.append("Top functions by self time (µs per call of the loop):\n\n" + table(
            ["function", "calls", "self µs", "cumulative µs"],
            [[f"`{f}`", n, tt, ct] for f, n, tt, ct in p.top[:12]]) + "\n")
        parts.append("celery_idem functions by cumulative time (µs per call of the loop):\n\n" + table(
            ["function", "calls", "self µs", "cumulative µs"],
            [[f"`{f}`", n, tt, ct] for f, n, tt, ct in p.own[:10]]) + "\n")
    out.add("Profile of the hot path (cProfile)", "\n".join(parts))
    r["profile_text"] = "\n".join(parts)


# -- docs --------------------------------------------------------------------------------------


def _flat(lo: Any, hi: Any) -> bool:
    return bool(hi.new.median_us < 1.25 * lo.new.median_us
                and hi.duplicate.median_us < 1.25 * lo.duplicate.median_us)


def _findings(r: dict[str, Any]) -> list[str]:
    """What the figures say, computed from them (so a re-run rewrites it)."""
    f: list[str] = []
    floor = r["floor"]
    raw, py = floor["EVALSHA return 1 (raw socket)"], floor["EVALSHA return 1 (redis-py)"]
    gr = r["gate"]["redis"]
    g, ev = gr["first"], gr["floor/first"]
    gd = gr["duplicate"]
    rw, rwd = gr.get("raw/first", raw), gr.get("raw/duplicate", raw)
    beyond, beyond_d = g.cpu_us - 2 * rw.cpu_us, gd.cpu_us - rwd.cpu_us
    mem = r["gate"]["memory"]
    f.append(
        f"**Redis gate: the round trips, then the gate's own work.** A first run takes "
        f"{g.median_us:.0f} µs ({g.cpu_us:.0f} µs CPU) for {g.round_trips:g} round trips; a trivial "
        f"EVALSHA timed in turn with it costs {rw.cpu_us:.0f} µs of client CPU on a raw socket (the "
        f"floor) and {ev.cpu_us:.0f} µs through redis-py. The store's verbs do not take redis-py's "
        f"command path (celery_idem/stores/redis_wire.py: a pooled connection kept per verb, the "
        f"command packed by hiredis, the reply read by the connection's parser). Beyond two raw-socket "
        f"round trips the gate costs {beyond:.0f} µs CPU per first run and {beyond_d:.0f} µs per "
        f"duplicate; with the in-process store the whole gate takes {mem['first'].cpu_us:.0f} µs "
        f"(first) and {mem['duplicate'].cpu_us:.0f} µs (duplicate) of CPU.")
    c = r["components"]
    claim, record = c["store.claim (claimed)"], c["store.record"]
    dclaim = c["store.claim (done, duplicate)"]
    xc, xr = claim.cpu_us - raw.cpu_us, record.cpu_us - raw.cpu_us
    text = (f"**Where the CPU beyond the round trips goes** (first run): the two verbs cost more client "
            f"CPU than a raw-socket trivial EVALSHA, `store.claim` +{xc:.0f} µs and `store.record` "
            f"+{xr:.0f} µs (redis-py's Connection send and read, the arguments packed, a larger command "
            f"and reply, the `Claim` built from it); the gate itself (result encoding, lease hold, "
            f"events, decisions) is the in-process store's figure above. A duplicate's `store.claim` on "
            f"a done key costs +{dclaim.cpu_us - raw.cpu_us:.0f} µs CPU over the floor (the record "
            f"decoded, the result with it)")
    srv = [(name, t.server_us) for name, t in (("claim.lua", claim), ("record.lua", record),
                                               ("claim.lua on a done key", dclaim), ("`return 1`", py))]
    shown = [f"{name} {v:.1f} µs" for name, v in srv if v is not None]
    if shown:
        text += ". Redis's own time per script: " + ", ".join(shown)
    f.append(text + ".")
    prof = {p.label: p for p in r["profiles"]}
    p = prof.get("Gate.run, Redis store, first run")
    if p:
        io_share = p.categories.get("socket I/O (waiting for the server)", 0)
        f.append(f"Under cProfile, {io_share:.0%} of a Redis first run is socket I/O, "
                 f"{p.categories.get('redis-py', 0):.0%} redis-py (command packing, RESP parsing), "
                 f"{p.categories.get('celery_idem', 0):.0%} celery_idem's own code and "
                 f"{p.categories.get('kombu (codec)', 0):.0%} kombu's JSON codec.")
    e = r["eager"]
    first = e["IdempotentTask delay() (eager), first"]
    plain = e["plain task delay() (eager)"]
    f.append(
        f"**The task layer: the key, and the record's read.** In eager mode a first `delay()` costs "
        f"{first.median_us:.0f} µs and {first.round_trips:g} store round trips against "
        f"{plain.median_us:.0f} µs "
        f"for the plain task: `IdempotentTask.apply_async` derives the key and reads the record "
        f"(`store.get`) before running it, then the gate claims and records.")
    pub = r.get("publish")
    if pub:
        base, off = pub[micro.PUBLISH_PLAIN], pub[micro.PUBLISH_OFF]
        within, rfirst = pub[micro.PUBLISH_WITHIN], pub[micro.PUBLISH_FIRST]
        f.append(
            f"**Through a Redis broker the read rides on the publish.** `delay()` of a unique key "
            f"costs {base.cpu_us:.0f} µs CPU for the plain task, {off.cpu_us:.0f} µs for an "
            f"`IdempotentTask` with the check off, {within.cpu_us:.0f} µs with the check within the "
            f"publish (one script reads the record and pushes the message, when the store is on the "
            f"broker's server and database) and {rfirst.cpu_us:.0f} µs with the check read first "
            f"(a `GET`, then the push: another broker, or a task whose enqueues are often answered "
            f"from the record); wall time {base.median_us:.0f} / {off.median_us:.0f} / "
            f"{within.median_us:.0f} / {rfirst.median_us:.0f} µs.")
    tr = r.get("tracer")
    if tr:
        pl, fo, un = tr[tracer.PLAIN], tr[tracer.FOLDED], tr[tracer.UNFOLDED]
        f.append(
            f"**In the worker, the result rides on the record.** Through Celery's tracer a plain task "
            f"takes {pl.median_us:.0f} µs ({pl.cpu_us:.0f} µs CPU, {pl.round_trips:g} round trips for "
            f"its result), an `IdempotentTask` {fo.median_us:.0f} µs ({fo.cpu_us:.0f} µs CPU, "
            f"{fo.round_trips:g} round trips: claim, and the record that writes the result), and "
            f"{un.median_us:.0f} µs ({un.cpu_us:.0f} µs CPU, {un.round_trips:g} round trips) when the "
            f"result is not folded into the record.")
        di = tr.get(tracer.DIRECT)
        if di:
            f.append(
                f"**With the store elsewhere** (another database, as with a PostgreSQL store) the task "
                f"writes the result meta itself without the backend's `GET`: {di.median_us:.0f} µs "
                f"({di.cpu_us:.0f} µs CPU, {di.round_trips:g} round trips) against "
                f"{un.median_us:.0f} µs ({un.round_trips:g}) with Celery's own write.")
    if "postgres" in r["gate"]:
        s = r["gate"]["postgres"]["first"]
        f.append("**PostgreSQL: waiting for the server dominates now.** Each verb is one statement in "
                 "its own transaction, so each claim and record waits for a durable commit (WAL flush; "
                 "see `synchronous_commit` and `fsync` in the machine table) and for the CTE upsert, on "
                 "the same 2 CPUs as everything else; the client side is psycopg (parameter dumping, "
                 "result parsing, the socket), see the pyinstrument tree at the end.")
        text = (f"**SQL store.** A first run on PostgreSQL costs "
                f"{s.median_us:.0f} µs ({s.cpu_us:.0f} µs client CPU) and {s.round_trips:g} round trips "
                f"({s.split:g} of them through SQLAlchemy)" if s.split is not None else "")
        sp = prof.get("Gate.run, SQL store (PostgreSQL), first run")
        if sp:
            text += (f". Under cProfile, SQLAlchemy is {sp.categories.get('SQLAlchemy', 0):.0%} of the time, "
                     f"psycopg {sp.categories.get('psycopg', 0):.0%}, waiting for the server "
                     f"{sp.categories.get('socket I/O (waiting for the server)', 0):.0%}")
        f.append(text + ".")
    paths = r.get("sql_paths")
    if paths:
        fast, slow = paths["fast path/first"], paths["SQLAlchemy path/first"]
        fd, sd = paths["fast path/duplicate"], paths["SQLAlchemy path/duplicate"]
        f.append(
            f"**The SQL store's psycopg fast path** (timed in turn with the SQLAlchemy path on the same "
            f"table): a first run (claim + record) {fast.median_us:.0f} µs wall / {fast.cpu_us:.0f} µs "
            f"client CPU against {slow.median_us:.0f} / {slow.cpu_us:.0f} µs through SQLAlchemy "
            f"({1 - fast.cpu_us / slow.cpu_us:.0%} less CPU); a duplicate {fd.median_us:.0f} / "
            f"{fd.cpu_us:.0f} µs against {sd.median_us:.0f} / {sd.cpu_us:.0f} µs. Round trips per call: "
            f"{fast.round_trips:g} and {fd.round_trips:g} on both paths.")
        nd = paths.get(f"{micro.NOT_DURABLE}/first")
        if nd is not None:
            f.append(
                f"**What the durable commits cost** (PostgreSQL): the same first run with "
                f"`synchronous_commit=off` takes {nd.median_us:.0f} µs instead of {fast.median_us:.0f} µs "
                f"(the two WAL flushes are the difference). Measured for the explanation only, not "
                f"recommended: with it a PostgreSQL crash can lose the last commits, a record among them, "
                f"and a lost record lets the body run again.")
    rec = r["record"]
    f.append(
        f"**Record size.** A done record with a {rec[0].result_bytes}-byte JSON result takes "
        f"{rec[0].memory_usage} bytes ({rec[0].encoding}), {rec[0].overhead} beyond the result; its "
        f"{rec[0].key_chars}-character key is part of that. With a {rec[1].result_bytes}-byte result "
        f"it takes {rec[1].memory_usage} bytes ({rec[1].overhead} beyond the result): one packed "
        f"string, no listpack-to-hashtable cliff.")
    by = {(s.workload, s.pool, s.system): s for s in r.get("e2e", [])}
    for (workload, pool, system), s in by.items():
        base = by.get((workload, pool, "plain"))
        if workload == "unique" and system.startswith("idem/") and base:
            f.append(
                f"End to end ({pool}, {_label(system)}): `IdempotentTask` adds "
                f"{s.worker_cpu_us - base.worker_cpu_us:.0f} µs of worker CPU and "
                f"{s.producer_cpu_us - base.producer_cpu_us:.0f} µs of producer CPU in `delay()` per task "
                f"(plain: {base.worker_cpu_us:.0f} + {base.producer_cpu_us:.0f} µs); throughput "
                f"ratio {s.ratio:.2f}.")
    for (workload, pool, system), s in by.items():
        checked = by.get((workload, pool, "idem/redis"))
        if system == NOCHECK and workload == "duplicates" and checked is not None:
            f.append(
                f"Duplicates ({pool}) with `idempotency_check_on_enqueue=False`: every copy is published "
                f"({s.published} of {s.messages}) and the worker answers the done ones from the record; "
                f"bodies run {s.bodies} (with the check: {checked.published} published, {checked.bodies} "
                f"bodies), "
                f"{s.rate:.0f} tasks/s against {checked.rate:.0f}.")
    e2e = r.get("e2e", [])
    if e2e:
        spread = max(max(s.rates) / min(s.rates) - 1 for s in e2e)
        lo, hi = min(s.load[0] for s in e2e), max(s.load[1] for s in e2e)
        f.append(f"**Noise.** The 1-minute load average during the batches was {lo:.1f}-{hi:.1f} on "
                 f"{os.cpu_count()} CPUs, and one system's tasks/s varied by up to {spread:.0%} between "
                 f"repetitions: read the ratios with their per-repetition values, and the CPU per task "
                 f"(less affected by other load) next to them.")
    for s in e2e:
        if s.system in PEERS and s.ratio is not None:
            idem = by.get((s.workload, s.pool, "idem/redis"))
            if idem is not None:
                extra = ""
                if s.workload == "duplicates":
                    extra = (f"; bodies run {s.bodies} of {s.messages} messages (IdempotentTask: "
                             f"{idem.bodies})" + (f", {s.failed} failed" if s.failed else ""))
                f.append(f"Peer {s.system} ({s.workload}, {s.pool}): {s.rate:.0f} tasks/s, {s.ratio:.2f} "
                         f"x plain, against IdempotentTask (Redis) {idem.rate:.0f} tasks/s{extra}.")
    rows = r.get("growth", [])
    for store in ("redis", "postgres"):
        g = [x for x in rows if x.store == store]
        if len(g) >= 2:
            lo, hi = g[0], g[-1]
            f.append(f"**Growth ({store}).** Claim of a new key {lo.new.median_us:.0f} µs at "
                     f"{lo.keys:,} records, {hi.new.median_us:.0f} µs at {hi.keys:,}; of a done key "
                     f"{lo.duplicate.median_us:.0f} -> {hi.duplicate.median_us:.0f} µs: "
                     f"{'flat' if _flat(lo, hi) else 'NOT flat'} (within 25%).")
    ps = r.get("pg_size")
    if ps:
        f.append(f"**PostgreSQL record size.** {ps['total']:.0f} bytes per done record on disk "
                 f"(heap {ps['heap']:.0f}, indexes {ps['indexes']:.0f}), a {ps['tuple']:.0f}-byte tuple "
                 f"for a {ps['result']}-byte result.")
    for s in e2e:
        if s.workload == "unique" and s.system == "plain+acks_late" and s.ratio is not None:
            f.append(f"Ack mode alone ({s.pool}): plain with `acks_late=True` runs at {s.ratio:.2f} x plain.")
    return f


def _docs(out: Out, r: dict[str, Any]) -> str:
    args = r["args"]
    m = r["machine"]
    cmd = "python -m bench --write-docs" + (" --quick" if args.quick else "") + (
        f" --tasks {args.tasks}" if args.tasks != (500 if args.quick else 2000) else "") + (
        f" --reps {args.reps}" if args.reps != (1 if args.quick else 3) else "")
    load0, load1 = r["load"]
    head = f"""# Benchmarks

What `IdempotentTask` costs, measured by `python -m bench` (the `bench/` package). This page is
written by `{cmd}` and is overwritten on every run with `--write-docs`; the figures
below are from one run on the machine described here, not a promise for yours. Run
`python -m bench --quick` for a one-minute check, `python -m bench` for the full run. The peers
and matplotlib are extras of the benchmark only, never dependencies of celery_idem:
`pip install -r bench/requirements.txt` (a peer that does not import is left out and named in the notes).

## Machine and run

{table(["item", "value"], [[k, v] for k, v in m.items()] + [
    ["load average (1 min) before / after", f"{load0[0]:.2f} / {load1[0]:.2f}"],
    ["run time", f"{r['elapsed']:.0f} s"],
    ["parameters", f"--tasks {args.tasks} --reps {args.reps} --pools {','.join(args.pools)} "
                   f"--store {args.store}"],
])}

Redis, PostgreSQL, the producer and the worker share the same {m['nproc']} CPUs, and the Redis
and PostgreSQL servers are shared with other users of the machine: treat differences of a few
per cent as noise (the per-repetition figures show the spread).

## Method

* **End to end**: a real `celery worker` subprocess (`-P solo`, and `-P prefork -c 2`), Redis
  broker and result backend, log level WARNING, events off. Each batch enqueues every message with
  `delay()`, then waits for every result (`ResultSet.get`, the Redis backend's native join); the
  time runs from the first `delay()` to the last result. The systems are measured interleaved
  (A B C, A B C, ...; plain, the IdempotentTask variants, and the peers celery_once,
  celery-singleton and Powertools on the same worker workload), after an unmeasured warm-up
  batch each; figures are medians over the repetitions, the ratio is the median of the paired
  per-repetition ratios (each system against the plain batch just before it). Every result is
  checked against its action (a peer's failed results are counted instead). Each
  `idem/<store> (accel off)` system is that store on its own worker whose app, producer and
  worker, sets `idempotency_accelerate = False` (every fast path off, the plain twins).
* **Gate**: `Gate.run` with a no-op body, each call timed on its own (median, p90), wall time and
  the calling thread's CPU time; what is compared (the gate and a trivial EVALSHA, a verb and the
  EVALSHA) is timed in turn in one loop, so both see the same machine conditions. Redis round
  trips are counted by a `redis.Connection` subclass that counts the replies read; SQL round
  trips by counting psycopg's network exchanges on the store's connections (after warm-up
  calls have prepared the statements), and SQLAlchemy's cursor events count the statements
  that went through SQLAlchemy. tests/stores/test_sql_psycopg.py checks the SQL counts at the
  wire (libpq's protocol trace).
* **Memory**: `MEMORY USAGE <key> SAMPLES 0` of a done record written by the gate, with a real
  task id (a UUID) and owner.
* **Isolation**: every Redis key of a run (queues, results, records, counters) is under one random
  12-character prefix and deleted at the end; the SQL store uses a private table, dropped at the
  end.
"""
    if r["notes"]:
        head += "\n## Notes\n\n" + "\n".join(f"* {n}" for n in r["notes"]) + "\n"
    findings = "\n## What dominates\n\n" + "\n".join(f"* {x}" for x in _findings(r)) + "\n"
    if r.get("chart"):
        findings += ("\n## Throughput per system\n\n"
                     "![End-to-end throughput per system, tasks/s](img/throughput.png)\n"
                     "\nMedian tasks/s per system and workload (the bars: min-max over the repetitions); the "
                     "idempotent systems are outlined.\n")
    body = "\n".join(out.sections)
    tree = ""
    if r.get("pyinstrument"):
        tree = ("\n## pyinstrument call tree (Gate.run, Redis store, first runs)\n\n```text\n"
                + r["pyinstrument"].strip() + "\n```\n")
    if r.get("pyinstrument_pg"):
        tree += ("\n## pyinstrument call tree (Gate.run, SQL store on PostgreSQL, first runs)\n\n```text\n"
                 + r["pyinstrument_pg"].strip() + "\n```\n")
    return head + findings + "\n" + body + tree
