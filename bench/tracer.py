"""The worker's side of one task, in process: Celery's own tracer (``build_tracer``, what a pool
child runs for each message) on a plain task and on an ``IdempotentTask``, Redis result backend
and store, no broker.

Four systems, timed in turn (``micro.time_interleaved``): ``plain``; ``idem`` with the result
written by the record's script (the default, see celery_idem/results_redis.py);
``idem, store elsewhere`` (the store on another database of the server, so nothing is folded: the record, then
the task's own SET + PUBLISH of the meta, no GET); ``idem, result not folded``
(``idempotency_fold_results = False``: the record, then Celery's GET + SET). Every Redis
request sent by the backend and the store is counted (a pipeline is one), so the table shows the
round trips per task.
"""

from __future__ import annotations

import uuid
from typing import Any

import redis
from celery.app.trace import build_tracer

from bench import micro
from bench.app import Settings, build_app
from celery_idem.app import forget_store

PLAIN, FOLDED, UNFOLDED = "plain task", "IdempotentTask", "IdempotentTask, result not folded"
DIRECT = "IdempotentTask, store elsewhere"


class Sends:
    count = 0


class SendCounting(micro.CountingConnection):
    """Counts requests sent: one per round trip (a pipeline goes out as one send)."""

    def send_packed_command(self, *args: Any, **kwargs: Any) -> None:
        Sends.count += 1
        super().send_packed_command(*args, **kwargs)  # type: ignore[no-untyped-call]


def _tracer(settings: Settings, fold: bool, elsewhere: str | None = None) -> tuple[Any, Any, Any]:
    app = build_app(settings)
    if elsewhere:
        app.conf.idempotency_store = elsewhere
    if not fold:
        app.conf.idempotency_fold_results = False
    # Count the backend's and the store's replies: same connection class on both (the fold
    # requires the store to be the backend's server, database, user and connection class).
    app.conf.idempotency_store_options = {"connection_class": SendCounting}
    app.backend.client.connection_pool.connection_class = SendCounting
    forget_store(app)  # build_app read the settings: read them again, with the lines above
    plain = app.tasks["bench.plain"]
    idem = app.tasks["bench.idem"]
    return (app,
            build_tracer(plain.name, plain, app.loader, "bench@host", app=app, eager=False),
            build_tracer(idem.name, idem, app.loader, "bench@host", app=app, eager=False))


def _request(task_id: str, name: str, key: str | None) -> dict[str, Any]:
    return {"id": task_id, "task": name, "retries": 0, "hostname": "bench@host", "is_eager": False,
            "headers": {"idempotency_key": key} if key else {},
            "delivery_info": {"routing_key": "bench", "exchange": "", "redelivered": False}}


def tracer_timings(redis_url: str, prefix: str, n: int, tag: str) -> dict[str, micro.Timing]:
    """Per-task wall, CPU and round trips of the worker's tracer; every key deleted after."""
    runs = {}
    apps = []
    base, _, db = redis_url.rpartition("/")
    other = f"{base}/{int(db or 0) + 1}" if db.isdigit() or not db else None
    systems = [(FOLDED, True, None), (DIRECT, True, other), (UNFOLDED, False, None)]
    for name, fold, elsewhere in systems:
        if name == DIRECT and other is None:
            continue  # a URL without a database number: no second database to put the store in
        t = f"{tag}{int(fold)}{'e' if elsewhere else ''}"
        s = Settings(prefix=f"{prefix}{t}:", queue=f"{prefix}{t}", redis_url=redis_url)
        app, plain, idem = _tracer(s, fold, elsewhere)
        apps.append((app, s.prefix, elsewhere))
        if name == FOLDED:
            runs[PLAIN] = _runner(plain, "bench.plain", None, tag + "p")
        runs[name] = _runner(idem, "bench.idem", app.tasks["bench.idem"], t)
    try:
        return micro.time_interleaved(runs, n, warm=50, count=lambda: Sends.count)
    finally:
        for app, pfx, elsewhere in apps:
            for url in {redis_url, elsewhere or redis_url}:
                client = redis.Redis.from_url(url)
                for key in client.scan_iter(match=f"{pfx}*", count=1000):
                    client.delete(key)
                client.close()
            app.backend.client.close()


def _runner(trace: Any, name: str, task: Any, tag: str) -> Any:
    def run(i: int) -> None:
        action = f"{tag}-{i}-{uuid.uuid4().hex[:8]}"
        key = task.idempotency_key_for((action,), {}) if task is not None else None
        task_id = uuid.uuid4().hex
        out = trace(task_id, (action,), {}, _request(task_id, name, key))
        if out.retval != action:
            detail = getattr(out.retval, "traceback", None) or repr(out.retval)
            raise AssertionError(f"{name} returned {detail} for {action!r}")

    return run
