"""``python -m bench.recovery``: how long a SIGKILLed worker's message takes to run again.

One measurement: two ``celery worker`` processes (prefork, one child each, ``acks_late``,
``reject_on_worker_lost``, prefetch 1) consume one queue; a plain task (the broker alone, no
gate: ``tests.integration.app.recovery_probe``) starts on one of them, and that whole worker
(main process and child) is SIGKILLed about a second later. The figure is the time from the
kill until the other worker starts the task again.

The Redis broker runs on a private ``redis-server`` (a short visibility timeout restores
*every* old unacknowledged message of the broker database, so it must not be a shared one);
RabbitMQ is the one at ``--amqp-url`` (a queue of its own, deleted afterwards).

    python -m bench.recovery                  # the table of docs/configuration.md
    python -m bench.recovery --only redis-vt5-1x1 --reps 5
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import celery
import kombu
from celery import Celery

from tests.integration.harness import RedisServer, Worker, wait_for

TASK = "tests.integration.app.recovery_probe"
DEFAULT_AMQP = "amqp://guest:guest@127.0.0.1:5672//"


@dataclasses.dataclass(frozen=True)
class Scenario:
    name: str
    broker: str  # "redis" or "amqp"
    visibility: float = 3600.0  # kombu's default is 3600
    interval: float = 10.0  # kombu's default unacked_restore_interval
    throttle: int = 10  # kombu's default unacked_restore_throttle
    wait: float = 60.0  # bounded wait for the re-run, from the kill
    max_reps: int = 0  # cap on --reps for the slow ones (0: none)


SCENARIOS = [
    Scenario("amqp", "amqp"),
    Scenario("redis-vt5-1x1", "redis", visibility=5, interval=1, throttle=1),
    Scenario("redis-vt30-1x1", "redis", visibility=30, interval=1, throttle=1, wait=90),
    Scenario("redis-vt5-10x10", "redis", visibility=5, wait=150),
    Scenario("redis-vt3600-1x1", "redis", interval=1, throttle=1, wait=120, max_reps=1),
]


@dataclasses.dataclass
class Run:
    sent: float  # wall clock (time.time()) when the message was published
    first: float  # first start of the body
    kill: float  # SIGKILL of the worker running it
    second: float | None  # start of the re-run on the other worker (None: not within the wait)
    redelivered: bool

    @property
    def after_kill(self) -> float | None:
        return None if self.second is None else self.second - self.kill

    @property
    def after_send(self) -> float | None:
        return None if self.second is None else self.second - self.sent


def starts(marker: Path) -> list[tuple[int, float, bool]]:
    """The body's start lines: (pid, time, redelivered)."""
    if not marker.exists():
        return []
    out = []
    for line in marker.read_text().splitlines():
        parts = line.split()
        if len(parts) == 3:
            out.append((int(parts[0]), float(parts[1]), parts[2] == "1"))
    return out


def measure_once(broker_url: str, backend_url: str, *, visibility: float, interval: float,
                 throttle: int, wait: float, kill_after: float = 1.0, hold: float = 600.0,
                 ledger_url: str | None = None) -> Run:
    """Start two workers, run the probe on one, SIGKILL that worker, time the re-run."""
    tag = uuid.uuid4().hex[:10]
    queue = f"recovery-{tag}"
    env = {
        "IDEM_BROKER": broker_url,
        "IDEM_BACKEND": backend_url,
        "IDEM_LEDGER": ledger_url or backend_url,
        "IDEM_PREFIX": f"recovery-{tag}:",
        "IDEM_QUEUE": queue,
        "IDEM_VISIBILITY": str(visibility),
        "IDEM_RESTORE_INTERVAL": str(interval),
        "IDEM_RESTORE_THROTTLE": str(throttle),
    }
    marker = Path(tempfile.mkdtemp(prefix="celery-idem-recovery-")) / "starts"
    workers: list[Worker] = []
    client = Celery("recovery-client", broker=broker_url)
    client.conf.broker_transport_options = {"visibility_timeout": visibility}
    try:
        workers.append(Worker(env, f"ra-{tag}", concurrency=1))
        workers.append(Worker(env, f"rb-{tag}", concurrency=1))
        sent = time.time()
        client.send_task(TASK, args=[str(marker), hold], queue=queue)
        pid, first, _ = wait_for(lambda: starts(marker), timeout=60, what="the body to start")[0]
        holder = next(w for w in workers if pid in w.children())
        time.sleep(max(0.0, first + kill_after - time.time()))
        kill = time.time()
        holder.kill()
        try:
            wait_for(lambda: len(starts(marker)) >= 2, timeout=wait, interval=0.02,
                     what="the re-run")
        except AssertionError:
            return Run(sent, first, kill, None, False)
        _, second, redelivered = starts(marker)[1]
        return Run(sent, first, kill, second, redelivered)
    finally:
        for w in workers:
            w.kill()  # the survivor is running the 600 s body: no warm shutdown
            w._fh.close()
            w.log.unlink(missing_ok=True)
        if broker_url.startswith("amqp"):
            with client.connection_for_write() as conn:
                conn.default_channel.queue_delete(queue)
        client.close()
        marker.unlink(missing_ok=True)
        marker.parent.rmdir()


def run_scenario(s: Scenario, reps: int, amqp_url: str) -> list[Run]:
    runs = []
    for _ in range(min(reps, s.max_reps or reps)):
        redis = RedisServer()
        try:
            broker = redis.url if s.broker == "redis" else amqp_url
            runs.append(measure_once(broker, redis.url, visibility=s.visibility,
                                     interval=s.interval, throttle=s.throttle, wait=s.wait))
        finally:
            redis.cleanup()
        r = runs[-1]
        shown = f"{r.after_kill:.2f} s" if r.after_kill is not None else f"not within {s.wait:g} s"
        print(f"  {s.name}: re-run {shown} after the kill", file=sys.stderr, flush=True)
    return runs


def describe(s: Scenario, runs: list[Run]) -> str:
    settings = ("(channel closes)" if s.broker == "amqp" else
                f"vt {s.visibility:g} s, interval {s.interval:g} s x throttle {s.throttle}")
    got = [r.after_kill for r in runs if r.after_kill is not None]
    missing = len(runs) - len(got)
    if got:
        span = f"{min(got):.2f}-{max(got):.2f} s (median {statistics.median(got):.2f} s)"
        age = [r.after_send for r in runs if r.after_send is not None]
        span += f"; {min(age):.2f}-{max(age):.2f} s after the publish"
    else:
        span = "-"
    if missing:
        span += f"; {missing} of {len(runs)} not back within {s.wait:g} s"
    redelivered = sum(r.redelivered for r in runs if r.second is not None)
    return f"| {s.broker} | {settings} | {len(runs)} | {span} | {redelivered}/{len(got)} |"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.recovery", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=3, help="runs per scenario (default 3)")
    p.add_argument("--only", default="", help="comma-separated scenario names: " +
                   ", ".join(s.name for s in SCENARIOS))
    p.add_argument("--wait", type=float, default=0,
                   help="seconds to wait for the re-run, for every scenario (default: each its own)")
    p.add_argument("--amqp-url", default=os.environ.get("CELERY_IDEM_TEST_AMQP", DEFAULT_AMQP))
    args = p.parse_args(argv)
    chosen = [s for s in SCENARIOS if not args.only or s.name in args.only.split(",")]
    if args.wait:
        chosen = [dataclasses.replace(s, wait=args.wait) for s in chosen]
    print(f"celery {celery.__version__}, kombu {kombu.__version__}; the body starts, its whole "
          f"worker is SIGKILLed about 1 s later, a second worker is running")
    lines = ["| broker | settings | runs | re-run after the kill | redelivered flag |",
             "|---|---|---:|---|---:|"]
    for s in chosen:
        print(f"== {s.name}", file=sys.stderr, flush=True)
        lines.append(describe(s, run_scenario(s, args.reps, args.amqp_url)))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
