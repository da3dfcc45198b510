"""End-to-end throughput through real ``celery worker`` subprocesses.

For each pool, one worker per store configuration is started (each on its own queue), warmed
up, and then every system is measured in turn, interleaved (A B C A B C ...), once per
repetition. A batch is timed from the first ``delay`` to the last result: all messages are
enqueued first, then every result is awaited (``ResultSet.get``, native join through the
Redis result backend's pub/sub).
"""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
from celery import Celery
from celery.result import ResultSet

from celery_idem import CachedResult

from .app import Settings, build_app

ROOT = Path(__file__).resolve().parents[1]

#: The peers (bench/requirements.txt), measured when their tasks exist on the app.
PEERS = {"celery_once": "bench.once", "celery-singleton": "bench.singleton", "powertools": "bench.powertools"}

POOLS: dict[str, tuple[str, int]] = {"solo": ("solo", 1), "prefork": ("prefork", 2)}


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.05) -> Any:
    """Poll ``predicate`` until truthy; fail after ``timeout`` seconds (never a bare sleep)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


_TICK = os.sysconf("SC_CLK_TCK")


def session_cpu(sid: int) -> float:
    """CPU seconds (user + system, reaped children included) of the processes in session ``sid``."""
    total = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as fh:
                stat = fh.read()
        except OSError:
            continue  # exited meanwhile
        fields = stat[stat.rindex(")") + 2:].split()
        # fields[0] is field 3 of proc(5): state; session is field 6, utime..cstime 14..17.
        if int(fields[3]) == sid:
            total += sum(int(x) for x in fields[11:15])
    return total / _TICK


class Worker:
    """One ``celery worker`` subprocess (its own session, so it is stopped as a group)."""

    def __init__(self, settings: Settings, pool: str, log_dir: Path) -> None:
        self.settings = settings
        self.pool = pool
        pool_name, concurrency = POOLS[pool]
        self.log = log_dir / f"{settings.queue}.log"
        cmd = [
            sys.executable, "-m", "celery", "-A", "bench.worker_app", "worker",
            "-P", pool_name, "-c", str(concurrency), "-Q", settings.queue,
            "-n", f"{settings.queue}@%h", "-l", "WARNING",
            "--without-gossip", "--without-mingle", "--without-heartbeat",
        ]
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
        env = {**os.environ, **settings.to_env(), "PYTHONPATH": path}
        self._fh = self.log.open("w")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self._fh,
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, client: redis.Redis, timeout: float = 90) -> None:
        def ready() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker {self.settings.queue} exited:\n{self.tail()}")
            return bool(client.exists(self.settings.ready_key))

        wait_for(ready, timeout, f"worker {self.settings.queue} to be ready")

    def cpu_seconds(self) -> float:
        """User + system CPU of every process of the worker (its session: main and pool children)."""
        return session_cpu(self.proc.pid)

    def tail(self, chars: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._fh.close()


@dataclass
class Batch:
    workload: str
    pool: str
    system: str
    rep: int
    messages: int
    seconds: float
    enqueue_seconds: float
    published: int
    cached: int
    bodies: int | None = None
    failed: int = 0  # results that are errors (peers only: e.g. Powertools' "already in progress")
    rejected: int = 0  # delay() returned None (celery_once graceful: a duplicate while queued)
    load: float = 0.0
    worker_cpu: float = 0.0  # seconds, the worker's processes
    producer_cpu: float = 0.0  # seconds, this process while it enqueues (delay() calls)

    @property
    def rate(self) -> float:
        return self.messages / self.seconds


@dataclass
class System:
    """One thing measured: a task on a producer app whose worker consumes its queue."""

    name: str
    app: Celery
    task_name: str
    worker: Worker
    counted: bool = False
    peer: bool = False  # a peer: its errors and rejections are counted, not fatal

    @property
    def task(self) -> Any:
        return self.app.tasks[self.task_name]


#: Seconds ``ResultSet.get`` sleeps after its first read when a result is not ready (see
#: :func:`run_batch`); Celery's default is 0.5.
COLLECT_INTERVAL = 0.01
#: IdempotentTask on the Redis store with ``idempotency_check_on_enqueue=False``.
NOCHECK = "idem/redis-nocheck"
#: IdempotentTask on the Redis store whose copies always ask the store (no memory of this
#: process's own recent messages, ``WithinPublish.RECENT = 0``): the path before it, beside it.
ASKSTORE = "idem/redis (copies ask the store)"
#: IdempotentTask on the Redis store with ``idempotency_intent=True`` (its message kept in the
#: store until its outcome; the worker runs a relay).
INTENTS = "idem/redis (intents)"
#: Suffix of the systems whose apps set ``idempotency_accelerate = False``: the plain paths
#: measured beside the accelerated ones, interleaved in the same run.
ACCEL_OFF = " (accel off)"


@dataclass
class Plan:
    tasks: int
    reps: int
    pools: Sequence[str]
    stores: Sequence[str]  # "redis", "postgres"
    copies: int = 4
    warmup: int = 100
    peers: bool = True
    io_tasks: int = 0  # messages per batch of the realistic row (0: not measured)
    notes: list[str] = field(default_factory=list)


def run_batch(system: System, calls: list[tuple[Any, ...]],
              timeout: float) -> tuple[float, float, int, int, float, int, int]:
    """Enqueue every call with ``delay``, then wait for every result.

    Returns:
        (seconds first enqueue -> last result, seconds spent enqueueing, published (distinct task
        ids), cached, CPU seconds of this process while enqueueing, failed results, rejected)
    """
    task = system.task
    cpu0 = time.process_time()
    t0 = time.perf_counter()
    # celery_once (graceful) answers a duplicate with EagerResult(None, None, REJECTED): no id.
    results = [None if getattr(r, "id", "") is None else r for r in (task.delay(*args) for args in calls)]
    t_enq = time.perf_counter()
    enqueue_cpu = time.process_time() - cpu0
    # celery-singleton answers a duplicate with the AsyncResult of the queued original: the same
    # id several times; ResultSet's native join needs each id once.
    distinct: dict[str, Any] = {}
    for r in results:
        if r is not None and not isinstance(r, CachedResult):
            distinct.setdefault(r.id, r)
    rs = ResultSet(list(distinct.values()), app=system.app)
    # interval: ResultSet.get first reads every result once and, when any is not ready yet,
    # sleeps one whole ``interval`` (0.5 s by default) before it listens for the rest, even on
    # the Redis backend, whose docs say interval has no effect there (Celery 5.4-5.7,
    # ``Backend.get_many``). A batch whose last results land just after its enqueue ends paid
    # that fixed 0.5 s; a batch still running at that point (plain's) hid it.
    values = rs.get(timeout=timeout, propagate=not system.peer, interval=COLLECT_INTERVAL) \
        if distinct else []
    t1 = time.perf_counter()
    by_id = dict(zip(distinct, values, strict=True))
    failed = sum(1 for v in by_id.values() if isinstance(v, BaseException))
    rejected = sum(1 for r in results if r is None)
    if not system.peer and rejected:
        raise AssertionError(f"{system.name}: delay() returned None {rejected} times")
    # Honesty check: every result is the action it was called with.
    bad = 0
    for args, r in zip(calls, results, strict=True):
        if r is None:
            continue
        value = r.result if isinstance(r, CachedResult) else by_id[r.id]
        if value != args[0] and not isinstance(value, BaseException):
            bad += 1
    if bad or (failed and not system.peer):
        raise AssertionError(f"{system.name}: {bad} results differ from their actions, {failed} failed")
    cached = sum(1 for r in results if isinstance(r, CachedResult))
    return t1 - t0, t_enq - t0, len(distinct), cached, enqueue_cpu, failed, rejected


def _calls(system: System, workload: str, tag: str, n: int, copies: int,
           counter: str | None) -> list[tuple[Any, ...]]:
    if workload in ("unique", "io"):
        return [(f"{tag}:{i}",) for i in range(n)]
    actions = [f"{tag}:{i}" for i in range(max(1, n // copies))]
    # Duplicates in rounds: every action once, then every action again, ... (copies rounds).
    return [(a, counter) for _ in range(copies) for a in actions]


def measure(plan: Plan, redis_url: str, pg_url: str | None, prefix: str,
            log: Callable[[str], None]) -> list[Batch]:
    """Run the end-to-end workloads; returns every measured batch."""
    client = redis.Redis.from_url(redis_url)
    batches: list[Batch] = []
    log_dir = Path(tempfile.mkdtemp(prefix="celery-idem-bench-"))
    failed = False
    try:
        for pool in plan.pools:
            batches += _measure_pool(plan, pool, redis_url, pg_url, prefix, client, log_dir, log)
    except BaseException:
        failed = True
        raise
    finally:
        if failed:
            log(f"worker logs kept in {log_dir}")
        else:
            for p in log_dir.iterdir():
                p.unlink()
            log_dir.rmdir()
        client.close()
    return batches


def _measure_pool(plan: Plan, pool: str, redis_url: str, pg_url: str | None, prefix: str,
                  client: redis.Redis, log_dir: Path, log: Callable[[str], None]) -> list[Batch]:
    configs: dict[str, Settings] = {}
    if "redis" in plan.stores:
        configs["redis"] = Settings(prefix, f"{prefix}q-{pool}-redis", redis_url)
    if "postgres" in plan.stores and pg_url:
        configs["postgres"] = Settings(
            prefix, f"{prefix}q-{pool}-pg", redis_url, store_url=pg_url,
            store_options={"table_name": sql_table(prefix)},
        )
    for store in ("redis", "postgres"):
        if store in configs:  # the same store, its own queue and worker, accelerations off
            on = configs[store]
            configs[store + ACCEL_OFF] = Settings(prefix, on.queue + "-off", redis_url, on.store_url,
                                                  dict(on.store_options), accelerate=False)
    if "redis" not in configs:
        # The plain baselines run on a Redis-configured worker (they never touch the store).
        configs["base"] = Settings(prefix, f"{prefix}q-{pool}-base", redis_url)
    workers = {name: Worker(s, pool, log_dir) for name, s in configs.items()}
    apps = {name: build_app(s) for name, s in configs.items()}
    try:
        for w in workers.values():
            w.wait_ready(client)
        base_app = apps["redis" if "redis" in apps else "base"]
        base_worker = workers["redis" if "redis" in workers else "base"]
        unique = [System("plain", base_app, "bench.plain", base_worker),
                  System("plain+acks_late", base_app, "bench.plain_late", base_worker)]
        dup = [System("plain", base_app, "bench.plain_count", base_worker, counted=True)]
        for store in ("redis", "postgres"):
            if store in apps:
                unique.append(System(f"idem/{store}", apps[store], "bench.idem", workers[store]))
                dup.append(System(f"idem/{store}", apps[store], "bench.idem_count", workers[store],
                                  counted=True))
                off = store + ACCEL_OFF
                unique.append(System(f"idem/{off}", apps[off], "bench.idem", workers[off]))
                dup.append(System(f"idem/{off}", apps[off], "bench.idem_count", workers[off], counted=True))
                if store == "redis":
                    unique.append(System(NOCHECK, apps[store], "bench.idem_nocheck", workers[store]))
                    dup.append(System(NOCHECK, apps[store], "bench.idem_nocheck_count", workers[store],
                                      counted=True))
                    unique.append(System(INTENTS, apps[store], "bench.idem_intent", workers[store]))
                    dup.append(System(INTENTS, apps[store], "bench.idem_intent_count", workers[store],
                                      counted=True))
                    dup.append(System(ASKSTORE, apps[store], "bench.idem_askstore_count", workers[store],
                                      counted=True))
        for peer, task_name in PEERS.items():
            if plan.peers and task_name in base_app.tasks:
                unique.append(System(peer, base_app, task_name, base_worker, peer=True))
                dup.append(System(peer, base_app, task_name + "_count", base_worker, counted=True, peer=True))
        # The realistic row: the unique systems again, each body sleeping IO_SECONDS.
        io = [System(x.name, x.app, x.task_name + "_io", x.worker, peer=x.peer) for x in unique
              if x.task_name + "_io" in x.app.tasks]
        timeout = 120 + plan.tasks / 10
        out: list[Batch] = []
        workloads = [("unique", unique), ("duplicates", dup)]
        if plan.io_tasks:
            workloads.append(("io", io))
        for workload, systems in workloads:
            for s in systems:  # warm-up: connections, scripts, imports, the SQL table
                tag = f"{prefix}{workload}:{pool}:{s.name}:warm"
                counter = f"{tag}:bodies" if s.counted else None
                warm = min(plan.warmup, plan.io_tasks) if workload == "io" else plan.warmup
                run_batch(s, _calls(s, workload, tag, warm, plan.copies, counter), timeout)
            for rep in range(plan.reps):
                for s in systems:
                    tag = f"{prefix}{workload}:{pool}:{s.name}:{rep}"
                    counter = f"{tag}:bodies" if s.counted else None
                    n = plan.io_tasks if workload == "io" else plan.tasks
                    calls = _calls(s, workload, tag, n, plan.copies, counter)
                    wcpu = s.worker.cpu_seconds()
                    secs, enq, published, cached, pcpu, failed, rejected = run_batch(s, calls, timeout)
                    wcpu = s.worker.cpu_seconds() - wcpu
                    bodies = int(client.get(counter) or 0) if counter else None
                    b = Batch(workload, pool, s.name, rep, len(calls), secs, enq, published, cached,
                              bodies, failed, rejected, os.getloadavg()[0], wcpu, pcpu)
                    out.append(b)
                    extra = f" bodies={bodies}" if bodies is not None else ""
                    extra += f" failed={failed}" if failed else ""
                    extra += f" rejected={rejected}" if rejected else ""
                    log(f"  {pool:8} {workload:10} {s.name:26} rep {rep + 1}: {b.rate:8.0f} tasks/s "
                        f"({secs:.2f} s, enqueue {enq:.2f} s, cached {cached}){extra}")
        return out
    except BaseException:
        for name, w in workers.items():
            log(f"--- worker {name} log tail ---\n{w.tail()}")
        raise
    finally:
        for w in workers.values():
            w.stop()
        for a in apps.values():
            a.close()


def sql_table(prefix: str) -> str:
    return "bench_" + "".join(c for c in prefix if c.isalnum()).lower()


@dataclass
class Summary:
    workload: str
    pool: str
    system: str
    rate: float  # median tasks/s
    rates: list[float]
    seconds: float  # median batch seconds
    enqueue: float  # median enqueue seconds
    bodies: int | None
    cached: int
    messages: int
    published: int = 0
    failed: int = 0
    rejected: int = 0
    worker_cpu_us: float = 0.0  # median worker CPU per message
    producer_cpu_us: float = 0.0  # median producer CPU per message, enqueueing
    load: tuple[float, float] = (0.0, 0.0)  # min, max 1-minute load average after its batches
    ratio: float | None = None  # median over repetitions of idem/plain measured side by side
    ratios: list[float] = field(default_factory=list)  # per repetition
    cpu_ratio: float | None = None  # total CPU per message, idem / plain (medians)


def summarize(batches: list[Batch]) -> list[Summary]:
    groups: dict[tuple[str, str, str], list[Batch]] = {}
    for b in batches:
        groups.setdefault((b.workload, b.pool, b.system), []).append(b)
    out = []
    for (workload, pool, system), bs in groups.items():
        rates = [b.rate for b in bs]
        bodies = [b.bodies for b in bs if b.bodies is not None]
        out.append(Summary(
            workload, pool, system, statistics.median(rates), rates,
            statistics.median(b.seconds for b in bs), statistics.median(b.enqueue_seconds for b in bs),
            int(statistics.median(bodies)) if bodies else None, int(statistics.median(b.cached for b in bs)),
            bs[0].messages, int(statistics.median(b.published for b in bs)),
            int(statistics.median(b.failed for b in bs)), int(statistics.median(b.rejected for b in bs)),
            statistics.median(b.worker_cpu / b.messages * 1e6 for b in bs),
            statistics.median(b.producer_cpu / b.messages * 1e6 for b in bs),
            (min(b.load for b in bs), max(b.load for b in bs)),
        ))
    by_key = {(s.workload, s.pool, s.system): s for s in out}
    for s in out:
        base = by_key.get((s.workload, s.pool, "plain"))
        if base and s.system != "plain":
            # Paired: each repetition's idem batch ran right after its plain batch, so the ratio
            # of the pair cancels slow drift of the machine (other load comes and goes).
            s.ratios = [a / b for a, b in zip(s.rates, base.rates, strict=False)]
            s.ratio = statistics.median(s.ratios)
            s.cpu_ratio = (s.worker_cpu_us + s.producer_cpu_us) / (base.worker_cpu_us + base.producer_cpu_us)
    return out
