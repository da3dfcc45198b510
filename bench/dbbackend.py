"""PostgreSQL store against plain Celery with Celery's own database result backend.

``python -m bench.dbbackend`` (see ``--help``). The base a user of ``result_backend =
"db+postgresql://..."`` compares with is plain Celery with that backend, whose result write is
itself a transaction; the idempotency store is then that database (derived from the backend).
Three systems, interleaved (A B C A B C ...), each a batch of unique no-op tasks:

* ``plain``: ``@app.task``, Celery writes the result row through its ORM session;
* ``idem``: ``IdempotentTask``, the record's statement writes Celery's row too (the fold, see
  celery_idem/results_db.py);
* ``idem, not folded``: the same with ``idempotency_fold_results = False`` (the record, then
  Celery's own write: what IdempotentTask did before the fold).

Two measurements:

* ``tracer``: the worker's side in process, Celery's own tracer (``build_tracer``, what a pool
  child runs per message) on each task, no broker; wall time per task, timed in turn, plus a
  cProfile of each (``--profile``).
* ``e2e``: real ``celery worker -P prefork -c 2`` subprocesses (one per system, Redis broker),
  a batch timed from the first ``delay`` to the last result row committed (polled in
  ``celery_taskmeta``, the same query for every system), throughput as a ratio to ``plain``
  in the same repetition, and the median over repetitions.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import sqlalchemy as sa

ROOT = Path(__file__).resolve().parents[1]
ENV = "BENCH_DB_SETTINGS"
PG = "db+postgresql+psycopg://root@127.0.0.1:5432/test"
REDIS = "redis://127.0.0.1:6379/0"
SYSTEMS = ("plain", "idem", "idem, not folded")
#: The second comparison (``--second-row``): the PostgreSQL store beside a Redis result backend,
#: against plain Celery with that Redis backend (the row docs/benchmarks.md had before).
SECOND = ("plain, redis backend", "idem, redis backend + pg store")


def build_app(prefix: str, queue: str, pg_url: str, redis_url: str, fold: bool,
              redis_backend: bool = False) -> Any:
    """The benchmark's app: Redis broker, Celery's database backend, the store derived from it.

    With ``redis_backend``: Celery's Redis backend, and the store on ``pg_url`` all the same.
    """
    from celery import Celery

    from celery_idem import IdempotentTask

    backend = redis_url if redis_backend else pg_url
    app = Celery(f"dbbench-{queue}", broker=redis_url, backend=backend, set_as_current=False)
    app.conf.update(
        task_default_queue=queue,
        broker_transport_options={"global_keyprefix": prefix},
        broker_connection_retry_on_startup=True,
        worker_enable_remote_control=False,
        idempotency_key_prefix=prefix + "idem:",
        idempotency_store_options={"table_name": "dbbench_records"},
    )
    if redis_backend:
        app.conf.idempotency_store = pg_url
        app.conf.result_backend_transport_options = {"global_keyprefix": prefix}
    if not fold:
        app.conf.idempotency_fold_results = False

    @app.task(shared=False, name="dbbench.plain")
    def plain(action: str) -> str:
        return action

    @app.task(shared=False, name="dbbench.idem", base=IdempotentTask, idempotency_fields=("action",))
    def idem(action: str) -> str:
        return action

    return app


def worker_app() -> Any:
    """The app of a worker subprocess, from ``BENCH_DB_SETTINGS``."""
    s = json.loads(os.environ[ENV])
    app = build_app(s["prefix"], s["queue"], s["pg_url"], s["redis_url"], s["fold"], s["redis_backend"])
    from celery.signals import worker_ready

    @worker_ready.connect(weak=False)
    def ready(**_: Any) -> None:
        import redis

        redis.Redis.from_url(s["redis_url"]).set(s["prefix"] + "ready:" + s["queue"], 1, ex=3600)

    return app


_worker_app: Any = None


def __getattr__(name: str) -> Any:
    """``bench.dbbackend:app``, the worker subprocess's app, built on first access."""
    global _worker_app
    if name != "app":
        raise AttributeError(name)
    if _worker_app is None:
        _worker_app = worker_app()
    return _worker_app


# -- in process: the worker's tracer ------------------------------------------------------------

def _request(task_id: str, name: str, key: str | None) -> dict[str, Any]:
    return {"id": task_id, "task": name, "retries": 0, "hostname": "bench@host", "is_eager": False,
            "headers": {"idempotency_key": key} if key else {},
            "delivery_info": {"routing_key": "bench", "exchange": "", "redelivered": False}}


def tracer(args: argparse.Namespace) -> None:
    from celery.app.trace import build_tracer

    prefix = f"dbb{uuid.uuid4().hex[:6]}:"
    runners = {}
    made: list[str] = []
    for system in SYSTEMS:
        app = build_app(prefix, "dbbench", args.pg_url, args.redis_url, fold=system != "idem, not folded")
        # As in a pool child: Celery's session manager keeps a pooled engine only after a fork
        # (before it, every result write opens a new connection).
        app.backend.session_manager._after_fork()
        name = "dbbench.plain" if system == "plain" else "dbbench.idem"
        task = app.tasks[name]
        trace = build_tracer(name, task, app.loader, "bench@host", app=app, eager=False)

        def run(i: int, task: Any = task, trace: Any = trace, name: str = name, system: str = system) -> None:
            action = f"{prefix}{system}:{i}"
            key = task.idempotency_key_for((action,), {}) if name != "dbbench.plain" else None
            task_id = uuid.uuid4().hex
            made.append(task_id)
            out = trace(task_id, (action,), {}, _request(task_id, name, key))
            assert out.retval == action, out

        run(-1)  # warm: connections, tables, statements
        runners[system] = run
    times: dict[str, list[float]] = {s: [] for s in SYSTEMS}
    for i in range(args.n):
        for system, run in runners.items():
            t0 = time.perf_counter()
            run(i)
            times[system].append(time.perf_counter() - t0)
    print(f"worker tracer, in process, {args.n} tasks each, timed in turn (median / mean µs):")
    for system, ts in times.items():
        print(f"  {system:18} {statistics.median(ts) * 1e6:8.0f} {statistics.fmean(ts) * 1e6:8.0f}")
    if args.profile:
        for system, run in runners.items():
            prof = cProfile.Profile()
            prof.enable()
            for i in range(args.profile):
                run(args.n + i)
            prof.disable()
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(14)
            print(f"--- cProfile, {system}, {args.profile} tasks, by own time ---")
            print("\n".join(out.getvalue().splitlines()[6:24]))
    _cleanup(args.pg_url, prefix, made)


# -- end to end: real workers ----------------------------------------------------------------

class Worker:
    def __init__(self, settings: dict[str, Any], log_dir: Path, concurrency: int) -> None:
        self.settings = settings
        self.log = log_dir / f"{settings['queue']}.log"
        cmd = [sys.executable, "-m", "celery", "-A", "bench.dbbackend:app", "worker",
               "-P", "prefork", "-c", str(concurrency), "-Q", settings["queue"],
               "-n", f"{settings['queue']}@%h", "-l", "WARNING",
               "--without-gossip", "--without-mingle", "--without-heartbeat"]
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
        env = {**os.environ, ENV: json.dumps(settings), "PYTHONPATH": path}
        self._fh = self.log.open("w")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self._fh, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def stop(self) -> None:
        from bench.e2e import Worker as E2EWorker

        E2EWorker.stop(self)  # type: ignore[arg-type]


def e2e(args: argparse.Namespace) -> None:
    import redis
    from celery.result import ResultSet

    from bench.e2e import session_cpu, wait_for

    prefix = f"dbb{uuid.uuid4().hex[:6]}:"
    client = redis.Redis.from_url(args.redis_url)
    engine = sa.create_engine(args.pg_url[3:])
    log_dir = Path(tempfile.mkdtemp(prefix="celery-idem-dbbench-"))
    apps, workers = {}, {}
    made: list[str] = []  # every task id, whose result rows are deleted at the end
    systems = SYSTEMS + (SECOND if args.second_row else ())
    try:
        for i, system in enumerate(systems):
            s = {"prefix": prefix, "queue": f"{prefix}q{i}", "pg_url": args.pg_url,
                 "redis_url": args.redis_url, "fold": system != "idem, not folded",
                 "redis_backend": system in SECOND}
            workers[system] = Worker(s, log_dir, args.concurrency)
            apps[system] = build_app(prefix, s["queue"], args.pg_url, args.redis_url, s["fold"],
                                     s["redis_backend"])
        for system, w in workers.items():
            wait_for(lambda w=w: client.exists(prefix + "ready:" + w.settings["queue"])
                     or (w.proc.poll() is not None and _fail(w)), 90, f"worker {system}")
        rates: dict[str, list[float]] = {s: [] for s in systems}
        enqueue: dict[str, list[float]] = {s: [] for s in systems}
        wcpu: dict[str, list[float]] = {s: [] for s in systems}
        for rep in range(-1, args.reps):  # rep -1: warm-up
            for system in systems:
                app = apps[system]
                task = app.tasks["dbbench.plain" if system.startswith("plain") else "dbbench.idem"]
                n = args.warmup if rep < 0 else args.tasks
                actions = [f"{prefix}{rep}:{system}:{i}" for i in range(n)]
                cpu0 = session_cpu(workers[system].proc.pid)
                t0 = time.perf_counter()
                ids = [task.delay(a).id for a in actions]
                t_enq = time.perf_counter() - t0
                made += ids
                if system in SECOND:
                    ResultSet([app.AsyncResult(i) for i in ids]).get(timeout=120 + n / 10)
                else:
                    _wait_rows(engine, ids, 120 + n / 10)
                secs = time.perf_counter() - t0
                if rep >= 0:
                    rates[system].append(n / secs)
                    enqueue[system].append(t_enq / n)
                    wcpu[system].append((session_cpu(workers[system].proc.pid) - cpu0) / n)
                    print(f"  rep {rep + 1} {system:18} {n / secs:7.0f} tasks/s "
                          f"(enqueue {t_enq / n * 1e6:5.0f} µs/task)", flush=True)
        print(f"\nprefork -c {args.concurrency}, {args.tasks} unique no-op tasks, {args.reps} interleaved "
              f"repetitions; ratios to plain in the same repetition (median, min-max):")
        for system in systems:
            base = "plain, redis backend" if system in SECOND else "plain"
            ratios = [r / p for r, p in zip(rates[system], rates[base], strict=True)]
            print(f"  {system:18} {statistics.median(rates[system]):7.0f} tasks/s  ratio "
                  f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})  enqueue "
                  f"{statistics.median(enqueue[system]) * 1e6:5.0f} µs  worker CPU "
                  f"{statistics.median(wcpu[system]) * 1e6:6.0f} µs/task")
    finally:
        for w in workers.values():
            w.stop()
        for a in apps.values():
            a.close()
        for name in client.scan_iter(match=prefix + "*", count=1000):
            client.delete(name)
        client.close()
        _cleanup(args.pg_url, prefix, made)
        engine.dispose()


def _fail(w: Worker) -> bool:
    raise RuntimeError(f"worker exited:\n{w.log.read_text()[-3000:]}")


def _wait_rows(engine: sa.Engine, ids: list[str], timeout: float) -> None:
    """Poll until every id has a SUCCESS row in celery_taskmeta (the same query for every system)."""
    query = sa.text("SELECT count(*) FROM celery_taskmeta WHERE task_id = ANY(:ids) AND status = 'SUCCESS'")
    deadline = time.monotonic() + timeout
    with engine.connect() as conn:
        while conn.execute(query, {"ids": ids}).scalar_one() < len(ids):
            conn.rollback()
            if time.monotonic() > deadline:
                raise TimeoutError(f"results not all stored after {timeout:g} s")
            time.sleep(0.005)


def _cleanup(pg_url: str, prefix: str, task_ids: list[str] | None = None) -> None:
    """Delete the run's records and result rows (the database is shared)."""
    engine = sa.create_engine(pg_url[3:])
    try:
        with engine.begin() as conn:
            if task_ids and sa.inspect(conn).has_table("celery_taskmeta"):
                conn.execute(sa.text("DELETE FROM celery_taskmeta WHERE task_id = ANY(:ids)"),
                             {"ids": task_ids})
            if sa.inspect(conn).has_table("dbbench_records"):
                conn.execute(sa.text("DELETE FROM dbbench_records WHERE key LIKE :p"), {"p": prefix + "%"})
    finally:
        engine.dispose()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.dbbackend", description=__doc__.split("\n\n")[0])
    p.add_argument("mode", choices=("tracer", "e2e"))
    p.add_argument("--pg-url", default=PG)
    p.add_argument("--redis-url", default=REDIS)
    p.add_argument("-n", type=int, default=300, help="tracer: tasks per system")
    p.add_argument("--profile", type=int, default=0, help="tracer: also cProfile this many tasks per system")
    p.add_argument("--tasks", type=int, default=400, help="e2e: tasks per batch")
    p.add_argument("--reps", type=int, default=9, help="e2e: interleaved repetitions")
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--second-row", action="store_true",
                   help="e2e: also the PostgreSQL store beside a Redis backend vs plain with that backend")
    args = p.parse_args(argv)
    (tracer if args.mode == "tracer" else e2e)(args)


if __name__ == "__main__":
    main()
