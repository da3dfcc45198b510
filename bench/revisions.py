"""One package revision against another, side by side: a derived key's ``delay()`` and gate.

``python -m bench.revisions REV [REV ...]`` checks each revision out into a temporary git
worktree, then runs :func:`probe` in a fresh interpreter per revision and round, with that
worktree first on ``sys.path``. Rounds alternate the revisions (A B C, A B C, ...), so a shared
machine's drift falls on all of them alike; each figure is the median over rounds of the
per-round medians. The probe uses only names every revision has (``IdempotentTask``, the
``idempotency_*`` app settings, ``delay``), so it measures what a user's code would see.

What it measures, per call, this process's CPU (``thread_time``) and wall:

* ``delay() first``: a derived key, unique arguments, through a real Redis broker with the
  enqueue check on (the default): key, check, publish. Nothing consumes the queue.
* ``gate first`` / ``gate duplicate``: eager ``apply()`` of the same task on the Redis store
  (eager mode runs the gate in place): claim, body, record; then a call of a done key.

Namespaced, scoped and fingerprinted keys must cost a derived key's hot path no more than a few
µs: docs/benchmarks.md, "Trust at the edge", gives this module's figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def _time(fn: Callable[[int], Any], n: int) -> tuple[float, float]:
    """Median CPU and wall µs of ``fn(i)`` over ``n`` calls, each timed on its own."""
    cpu, wall = [], []
    for i in range(n):
        c0, w0 = time.thread_time_ns(), time.perf_counter_ns()
        fn(i)
        cpu.append(time.thread_time_ns() - c0)
        wall.append(time.perf_counter_ns() - w0)
    return statistics.median(cpu) / 1000, statistics.median(wall) / 1000


def probe(redis_url: str, n: int, prefix: str | None = None) -> dict[str, list[float]]:
    """Run in the revision's interpreter: the three timings, as ``{name: [cpu_us, wall_us]}``.

    Every key it writes (broker, results, records) is under ``prefix`` (default: a fresh one),
    deleted before it returns.
    """
    import redis
    from celery import Celery

    from celery_idem import IdempotentTask

    prefix = prefix or f"benchrev{uuid.uuid4().hex[:8]}:"
    out: dict[str, list[float]] = {}
    client = redis.Redis.from_url(redis_url)
    try:
        for eager in (False, True):
            app = Celery(f"rev-{eager}", broker=redis_url, backend=redis_url, set_as_current=False)
            app.conf.update(
                task_default_queue=prefix + "q", task_always_eager=eager,
                broker_transport_options={"global_keyprefix": prefix},
                result_backend_transport_options={"global_keyprefix": prefix},
                idempotency_key_prefix=prefix + "idem:",
            )

            @app.task(base=IdempotentTask, shared=False, name="rev.charge",
                      idempotency_fields=("order_id", "amount"))
            def charge(order_id: str, amount: int, note: str = "") -> dict[str, Any]:
                return {"order_id": order_id, "amount": amount}

            for i in range(50):  # warm-up: connections, scripts, imports
                charge.delay(f"warm-{eager}-{i}", 1)
            if eager:
                out["gate first"] = list(_time(lambda i: charge.apply((f"g{i}", 100)), n))
                out["gate duplicate"] = list(_time(lambda i: charge.apply((f"g{i}", 100)), n))
            else:
                out["delay() first"] = list(_time(lambda i: charge.delay(f"d{i}", 100), n))
            app.close()
    finally:
        for key in client.scan_iter(prefix + "*", count=1000):
            client.delete(key)
        client.close()
    return out


def _worktree(rev: str, base: Path) -> Path:
    path = base / rev.replace("/", "_")
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(path), rev],
                   check=True)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.revisions", description=__doc__.split("\n")[0])
    parser.add_argument("revs", nargs="+", help="git revisions (HEAD for the checkout as committed)")
    parser.add_argument("--calls", type=int, default=1000, help="calls per timing (default 1000)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds, revisions alternating (default 5)")
    parser.add_argument("--redis-url", default=os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/14"))
    parser.add_argument("--probe", help=argparse.SUPPRESS)  # internal: run the probe in this tree
    args = parser.parse_args(argv)
    if args.probe:
        import celery_idem

        print(f"probe: {celery_idem.__file__}", file=sys.stderr)
        print(json.dumps(probe(args.redis_url, args.calls)))
        return 0
    runs: dict[str, list[dict[str, list[float]]]] = {rev: [] for rev in args.revs}
    with tempfile.TemporaryDirectory(prefix="celery-idem-revs-") as tmp:
        trees = {rev: _worktree(rev, Path(tmp)) for rev in args.revs}
        try:
            for r in range(args.rounds):
                for rev, tree in trees.items():
                    env = {**os.environ, "PYTHONPATH": str(tree)}
                    done = subprocess.run(
                        # The script by path, not ``-m``: the checkout's own package must not come
                        # first on sys.path, the revision's (PYTHONPATH) must.
                        [sys.executable, str(Path(__file__).resolve()), "--probe", "1", "--calls",
                         str(args.calls), "--redis-url", args.redis_url, *args.revs],
                        cwd=ROOT, env=env, check=True, capture_output=True, text=True, timeout=600)
                    runs[rev].append(json.loads(done.stdout.splitlines()[-1]))
                    where = done.stderr.strip().splitlines()[-1]
                    print(f"round {r + 1}/{args.rounds} {rev}: {where}", file=sys.stderr)
        finally:
            for tree in trees.values():
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)],
                               check=False)
    names = list(runs[args.revs[0]][0])
    print(f"| timing (median of {args.rounds} rounds x {args.calls} calls) | "
          + " | ".join(f"{rev} CPU / wall µs" for rev in args.revs) + " |")
    print("|---|" + "---|" * len(args.revs))
    for name in names:
        cells = []
        for rev in args.revs:
            cpu = statistics.median(run[name][0] for run in runs[rev])
            wall = statistics.median(run[name][1] for run in runs[rev])
            cells.append(f"{cpu:.0f} / {wall:.0f}")
        print(f"| {name} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
