"""A real worker's result writes on the backend's server (celery_idem/results_redis.py).

The meta each write makes, and when Celery writes it itself, are tests/unit/test_results_redis.py's;
here a worker runs 20 tasks and the server's command counts say how many round trips each result
took: folded into the record's script, written directly (the store elsewhere), or Celery's own.
"""

from __future__ import annotations

import gc
from typing import Any

import pytest
import redis

from celery_idem.config import accelerate_switch
from tests.integration import app as app_module
from tests.integration.conftest import Cluster
from tests.integration.harness import RedisServer


def _stats(client: redis.Redis) -> dict[str, int]:
    # failed_calls: a first EVALSHA on a fresh server answers NOSCRIPT (then the script is loaded)
    return {name: int(v["calls"]) - int(v.get("failed_calls", 0))
            for name, v in client.info("commandstats").items()}


@pytest.mark.worker
@pytest.mark.parametrize("mode", ["folded", "direct", "off"])
def test_a_real_worker_stores_each_result_in_one_round_trip(make_cluster: Any, mode: str) -> None:
    """Backend on a private server (the store too, or on a second one): count what it is sent."""
    if mode != "off" and not accelerate_switch():
        pytest.skip("the result fold is an acceleration (CELERY_IDEM_ACCELERATE off)")
    server = RedisServer()
    elsewhere = RedisServer() if mode == "direct" else None
    results: list[Any] = []
    try:
        env = {"IDEM_BACKEND": server.url, "IDEM_FOLD": "0" if mode == "off" else "1"}
        if elsewhere is not None:
            env["IDEM_STORE"] = elsewhere.url
        cluster: Cluster = make_cluster(**env)
        cluster.worker(pool="solo")
        client = redis.Redis.from_url(server.url)
        before = _stats(client)
        results.extend(app_module.charge.delay(f"fold-{mode}-{i}", 100) for i in range(20))
        values = [r.get(timeout=30) for r in results]
        assert [v["order_id"] for v in values] == [f"fold-{mode}-{i}" for i in range(20)]
        after = _stats(client)
        calls = {name: after.get(name, 0) - before.get(name, 0) for name in after}
        # With the store on this server: 20 enqueue checks from the producer (the reserve
        # script: GET the record, GET the reservation, SET it; the broker is elsewhere, so the
        # check is read first), claim + record per task (EVALSHA) from the worker. Commands a
        # script runs count too: the claim and the record scripts each GET and SET the record
        # (one string), and the folded meta shows as one more SET and a PUBLISH.
        scripts, producer = (0, 0) if mode == "direct" else (2 * 20, 20)
        assert calls.get("cmdstat_evalsha", 0) == scripts + producer, calls
        # The client's AsyncResult.get reads each result at most once (GET) after subscribing;
        # Celery's own write adds a GET (the old meta) and a SETEX per task.
        gets = calls.get("cmdstat_get", 0) - scripts - 2 * producer
        sets = scripts + producer  # the record's writes and the reservations
        if mode == "folded":
            assert calls.get("cmdstat_setex", 0) == 0 and gets <= 20, calls
            assert calls.get("cmdstat_set", 0) == sets + 20, calls
        elif mode == "direct":
            assert calls.get("cmdstat_setex", 0) == 20 and gets <= 20, calls
        else:
            assert calls.get("cmdstat_setex", 0) == 20 and gets >= 20, calls
            assert calls.get("cmdstat_set", 0) == sets, calls
        assert all(len(cluster.effects(f"charge:fold-{mode}-{i}")) == 1 for i in range(20))
        client.close()
    finally:
        # Celery < 5.7 unsubscribes a collected AsyncResult on its backend and retries without
        # end once that server is gone (the next test would hang): let them go while it answers.
        results.clear()
        gc.collect()
        server.cleanup()
        if elsewhere is not None:
            elsewhere.cleanup()
