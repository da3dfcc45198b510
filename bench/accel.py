"""Each fast path alone against its plain twin, on the work it targets: ``python -m bench.accel``.

* the enqueue check within the Redis publish (:mod:`celery_idem.enqueue_redis`) against reading
  first (:class:`celery_idem.enqueue.ReadFirst`): ``delay()`` of a unique derived key through a
  real Redis broker, beside plain Celery's ``delay()``;
* the Redis store's wire (:mod:`celery_idem.stores.redis_wire`) against redis-py's scripts, and
  the result fold (:mod:`celery_idem.results_redis`) against Celery's own write: the worker's
  side of one task (Celery's tracer, Redis backend and store, unique keys).

The in-flight memory (``WithinPublish.mine``) is measured on the duplicates workload by the
end-to-end run (``python -m bench``: "copies ask the store").
"""

from __future__ import annotations

import argparse
import uuid

import redis

from bench import micro, tracer
from bench.app import Settings
from celery_idem.stores.redis import Scripts


def worker_paths(redis_url: str, prefix: str, n: int) -> dict[str, micro.Timing]:
    """The tracer per task: plain Celery; idem with every fast path; wire off; fold off."""
    runs, apps = {}, []
    for name, fold, wire in (("idem", True, True), ("idem, wire off", True, False),
                             ("idem, fold off", False, True)):
        t = uuid.uuid4().hex[:6]
        s = Settings(prefix=f"{prefix}{t}:", queue=f"{prefix}{t}", redis_url=redis_url)
        app, plain, idem = tracer._tracer(s, fold)
        task = app.tasks["bench.idem"]
        store = task._gate.store
        if not wire:
            store._scripts = Scripts(store.client)
        if not fold:  # as idempotency_fold_results = False: Celery writes the result
            task.__dict__["_result_writer"] = None
        apps.append((app, s.prefix))
        if not runs:
            runs["plain Celery"] = tracer._runner(plain, "bench.plain", None, t + "p")
        runs[name] = tracer._runner(idem, "bench.idem", task, t)
    try:
        return micro.time_interleaved(runs, n, warm=50)
    finally:
        client = redis.Redis.from_url(redis_url)
        for app, pfx in apps:
            for key in client.scan_iter(match=f"{pfx}*", count=1000):
                client.delete(key)
            app.backend.client.close()
        client.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=2000)
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    args = parser.parse_args()
    prefix = f"bench-accel-{uuid.uuid4().hex[:8]}:"
    rows = {**micro.publish_timings(args.redis_url, prefix, args.n, "pub"),
            **worker_paths(args.redis_url, prefix, args.n)}
    width = max(map(len, rows))
    for name, t in rows.items():
        print(f"{name:<{width}}  median {t.median_us:8.1f} us  p90 {t.p90_us:8.1f} us  "
              f"cpu {t.cpu_us:8.1f} us")


if __name__ == "__main__":
    main()
