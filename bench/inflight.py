"""Copies of a running action and an unrelated quick task, through a real worker.

``celery worker -P prefork -c 2`` on Redis (broker, backend and store on one server). One action's
body runs ``hold`` seconds; ``copies`` copies of it are enqueued; then an unrelated quick task
(``bench.plain``, a no-op) is enqueued and its latency (``delay()`` to ``get()``) measured: the
first one right behind the copies (the median over the reps is reported), then four more while
the body still runs (reported apart). Three
paths, side by side in one run, ``reps`` times each:

* **attach** (the default): the copies publish nothing and follow the running action;
* **check off** (``idempotency_check_on_enqueue=False``): every copy is published; a delivered
  copy finds the key busy and goes back with a countdown at once;
* **waiting in the worker** (emulated: check off, ``idempotency_wait=10``): each delivered copy
  holds a pool process up to 10 s, then re-queues.

The quick task's idle latency (no action running) is measured the same way, as the baseline.
``python -m bench.inflight`` runs it alone; ``python -m bench`` includes it.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

from bench.app import Settings, build_app
from bench.e2e import Worker, wait_for

#: (label, task) of the three paths.
PATHS = (
    ("attach (default)", "bench.hold"),
    ("check off: copies re-queue with a countdown", "bench.hold_nocheck"),
    ("waiting in the worker (emulated: check off, idempotency_wait=10)", "bench.hold_oldpath"),
)


def _in_progress(store: Any, key: str) -> bool:
    rec = store.get(key)
    return rec is not None and rec.state.value == "in_progress"


def _latency(app: Any) -> float:
    t0 = time.perf_counter()
    app.tasks["bench.plain"].delay("quick").get(timeout=120)
    return time.perf_counter() - t0


def measure(redis_url: str, prefix: str, log: Callable[[str], None], *, hold: float = 15.0,
            copies: int = 4, reps: int = 3, idle_samples: int = 15,
            samples: int = 5) -> dict[str, Any]:
    """Run the three paths; returns the medians (seconds) and the published message counts."""
    settings = Settings(prefix, f"{prefix}q-inflight", redis_url)
    client = redis.Redis.from_url(redis_url)
    log_dir = Path(tempfile.mkdtemp(prefix="celery-idem-inflight-"))
    worker = Worker(settings, "prefork", log_dir)
    app = build_app(settings)
    out: dict[str, Any] = {"hold": hold, "copies": copies, "reps": reps, "paths": {}}
    try:
        worker.wait_ready(client)
        for _ in range(3):
            _latency(app)  # connections, imports
        idle = [_latency(app) for _ in range(idle_samples)]
        out["idle"] = statistics.median(idle)
        log(f"  inflight: quick task idle latency {out['idle'] * 1000:.1f} ms (median of {idle_samples})")
        for label, name in PATHS:
            task = app.tasks[name]
            store = task._gate.store
            lat: list[float] = []
            later: list[float] = []
            finish: list[float] = []
            for rep in range(reps):
                action = f"{prefix}inflight:{name}:{rep}"
                holder = task.delay(action, hold)
                key = task.idempotency_key_for((action, hold))
                wait_for(lambda s=store, k=key: _in_progress(s, k), 60, "the holder's claim")
                t_copies = time.perf_counter()
                handles = [task.delay(action, hold) for _ in range(copies)]
                # The quick task right behind the copies (the one the issue timed: it waits
                # for whatever the copies hold), then a few more while the body still runs.
                lat.append(_latency(app))
                later.extend(_latency(app) for _ in range(samples - 1))
                client.set(f"{action}:release", 1, ex=600)
                value = holder.get(timeout=120)
                assert all(h.get(timeout=120) == value for h in handles)
                finish.append(time.perf_counter() - t_copies)
            row = {"latency": statistics.median(lat), "latencies": lat,
                   "later": statistics.median(later) if later else None,
                   "copies_done": statistics.median(finish)}
            out["paths"][label] = row
            log(f"  inflight: {label}: quick task {row['latency'] * 1000:.1f} ms "
                f"({row['latency'] / out['idle']:.1f}x idle)")
        return out
    finally:
        worker.stop()
        app.close()
        for key in client.scan_iter(f"{prefix}*"):
            client.delete(key)
        client.close()
        for p in log_dir.iterdir():
            p.unlink()
        log_dir.rmdir()


def main() -> int:
    import secrets
    import sys

    prefix = f"bench{secrets.token_hex(3)}:"
    result = measure("redis://127.0.0.1:6379/0", prefix, lambda s: print(s, file=sys.stderr))
    idle = result["idle"]
    print(f"| path | quick task latency, median ms | x idle |\n|---|---:|---:|\n"
          f"| idle (no action running) | {idle * 1000:.1f} | 1.0 |")
    for label, row in result["paths"].items():
        print(f"| {label} | {row['latency'] * 1000:.1f} | {row['latency'] / idle:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
