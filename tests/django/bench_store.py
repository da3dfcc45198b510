"""Side-by-side latency of the Django store and the SQL store on the same PostgreSQL database.

    PYTHONPATH=. .venv/bin/python -m tests.django.bench_store [--rounds 7] [--ops 200]

Per round, each store runs ``ops`` actions (a first claim, then its record) and ``ops``
duplicate claims of a done key, on one table; the rounds alternate the stores so machine
noise hits both. Prints the median per-operation time of each and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid

from celery_idem.records import State
from celery_idem.stores.base import Store


def _round(store: Store, ops: int) -> tuple[float, float]:
    tag = uuid.uuid4().hex[:8]
    start = time.perf_counter()
    for i in range(ops):
        c = store.claim(f"{tag}:{i}", owner="bench:1", task_id=f"t{i}", attempt=0, lease=30, ttl=600)
        store.record(f"{tag}:{i}", c.token, state=State.DONE, content_type="application/json",
                     data=b"[42]", ttl=600, claim_id=c.claim_id)
    first = (time.perf_counter() - start) / ops
    start = time.perf_counter()
    for i in range(ops):
        store.claim(f"{tag}:{i}", owner="bench:2", task_id=f"d{i}", attempt=0, lease=30, ttl=600)
    duplicate = (time.perf_counter() - start) / ops
    return first, duplicate


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--ops", type=int, default=200)
    args = parser.parse_args()
    from celery_idem.contrib.django.store import DjangoStore
    from celery_idem.stores import store_from_url
    from tests.conftest import PG_URL
    from tests.django.support import configure, teardown

    state = configure()
    try:
        django = DjangoStore("pg", prefix="bench:")
        sql_url = "db+" + PG_URL.rsplit("/", 1)[0] + "/" + state["pg"]
        sql = store_from_url(sql_url, prefix="bench:")
        results: dict[str, list[tuple[float, float]]] = {"django": [], "sqlalchemy": []}
        _round(django, 20), _round(sql, 20)  # warm up: connections, prepared statements
        for _ in range(args.rounds):
            results["django"].append(_round(django, args.ops))
            results["sqlalchemy"].append(_round(sql, args.ops))
        med = {name: (statistics.median(r[0] for r in rs), statistics.median(r[1] for r in rs))
               for name, rs in results.items()}
        for name, (first, dup) in med.items():
            print(f"{name:<11} claim+record {first * 1e3:.3f} ms   duplicate claim {dup * 1e3:.3f} ms")
        print(f"ratio django/sqlalchemy: claim+record {med['django'][0] / med['sqlalchemy'][0]:.2f}  "
              f"duplicate {med['django'][1] / med['sqlalchemy'][1]:.2f}  "
              f"(median of {args.rounds} rounds x {args.ops} ops)")
        sql.close()
    finally:
        teardown()


if __name__ == "__main__":
    main()
