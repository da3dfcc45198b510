"""Kill-after-commit runs: every action's first attempt SIGKILLs its worker process right
after committing its order and receipt, before the record and the ack.

    python -m tests.receipts.kills --kills 200 --store both

One kill per action (a redelivery finds the receipt, so it never commits again): ``--kills N``
sends N actions. Real ``celery worker`` processes (prefork), a private ``redis-server`` as
broker and result backend, the business database on PostgreSQL (``--db mariadb`` or ``sqlite``
for the others); the idempotency store on that Redis (``--store redis``), on the business
database itself (``--store sql``), or one run on each (``both``). Exit status 1 when any check fails.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
import sqlalchemy as sa
from celery import Celery

from celery_idem.contrib.receipts import receipts_table
from tests.conftest import MYSQL_URL, PG_URL
from tests.integration.harness import RedisServer, Worker
from tests.receipts.app import orders_table

TASK = "tests.receipts.app.place_order"


@dataclass
class Report:
    """What one run saw; ``ok`` when every check held."""

    store: str
    db: str
    actions: int
    kills: int = 0
    receipts_found: int = 0
    orders: int = 0
    duplicate_rows: int = 0
    missing: list[str] = field(default_factory=list)
    wrong_results: list[str] = field(default_factory=list)
    wall: float = 0.0

    @property
    def ok(self) -> bool:
        return (self.kills == self.actions and self.duplicate_rows == 0 and not self.missing
                and not self.wrong_results and self.orders == self.actions)

    def line(self) -> str:
        return (f"db={self.db:<10} store={self.store:<11} actions={self.actions} kills={self.kills} "
                f"receipts_found={self.receipts_found} order_rows={self.orders} "
                f"duplicate_rows={self.duplicate_rows} missing={len(self.missing)} "
                f"wrong_results={len(self.wrong_results)} wall={self.wall:.1f}s "
                f"{'OK' if self.ok else 'FAILED'}")


def run(kills: int, store: str = "redis", *, db: str = "postgresql", concurrency: int = 4,
        lease: float = 2.0, timeout: float | None = None, plain: bool = False) -> Report:
    """Send ``kills`` actions, each killed once after its commit; check the database after.

    Args:
        kills: Number of actions (= kills).
        store: ``redis`` (the private Redis) or ``sql`` (the business database itself).
        db: The business database: ``postgresql``, ``mariadb`` or ``sqlite`` (a file).
        concurrency: Prefork processes of the one worker.
        lease: ``idempotency_lease`` seconds (a takeover waits this out after each kill).
        timeout: Seconds to wait for all results (default: generous, from ``kills``).
        plain: The control: the body commits without a receipt (duplicates are expected).
    """
    if store not in ("redis", "sql"):
        raise ValueError(f"store must be 'redis' or 'sql', got {store!r}")
    tag = uuid.uuid4().hex[:10]
    db_url = {"postgresql": PG_URL, "mariadb": MYSQL_URL,
              "sqlite": f"sqlite:///{tempfile.gettempdir()}/rcpt-{tag}.db"}[db]
    server = RedisServer()
    engine = sa.create_engine(db_url, pool_pre_ping=True)
    orders = orders_table(f"rcpt_orders_{tag}")
    receipts = f"rcpt_receipts_{tag}"
    store_table = f"rcpt_records_{tag}"
    prefix = f"rcpt-{tag}:"
    env = {
        "RCPT_REDIS": server.url, "RCPT_PREFIX": prefix, "RCPT_QUEUE": f"rcpt-{tag}",
        "RCPT_DB": db_url, "RCPT_ORDERS": orders.name, "RCPT_RECEIPTS": receipts,
        "RCPT_LEASE": str(lease), "RCPT_PLAIN": "1" if plain else "0",
        "RCPT_STORE": server.url if store == "redis" else "db+" + db_url,
    }
    if store == "sql":
        env["RCPT_STORE_TABLE"] = store_table
    report = Report(store=store + ("/plain" if plain else ""), db=db, actions=kills)
    client = Celery("rcpt-client", broker=server.url, backend=server.url, set_as_current=False)
    flags = redis.Redis.from_url(server.url)
    worker: Worker | None = None
    started = time.monotonic()
    try:  # everything after the private server starts is undone in the finally
        orders.metadata.create_all(engine)
        worker = Worker(env, f"rcpt-{store}-{tag}", concurrency=concurrency,
                        app="tests.receipts.app")
        sent = {
            f"act-{i}": client.send_task(TASK, args=(f"act-{i}", 100 + i), queue=env["RCPT_QUEUE"])
            for i in range(kills)
        }
        deadline = time.monotonic() + (timeout or 120 + kills * 4 * lease / concurrency * 3)
        results: dict[str, Any] = {}
        for action, res in sent.items():
            results[action] = res.get(timeout=max(1.0, deadline - time.monotonic()))
        report.wall = time.monotonic() - started
        # The database and the flags, after every result is in.
        with engine.connect() as conn:
            rows = list(conn.execute(sa.select(orders)).mappings())
            rcpts = [] if plain else list(conn.execute(sa.select(receipts_table(receipts))))
        report.orders = len(rows)
        per_action = Counter(r["action"] for r in rows)
        report.duplicate_rows = sum(n - 1 for n in per_action.values() if n > 1)
        report.missing = [a for a in sent if per_action[a] == 0]
        report.kills = sum(1 for a in sent if flags.get(f"{prefix}killed:{a}") is not None)
        report.receipts_found = worker.text().count("celery_idem receipt key=")
        by_action = {r["action"]: r for r in rows}
        for action, out in results.items():
            row = by_action.get(action)
            killed = flags.get(f"{prefix}killed:{action}")
            expected = row and {"action": action, "amount": row["amount"], "task_id": row["task_id"],
                                "token": row["token"], "pid": row["pid"]}
            # The result is the committed attempt's, and that attempt is the one that was killed.
            if out != expected or killed is None or int(killed) != row["pid"]:
                report.wrong_results.append(f"{action}: result {out} row {expected} killed {killed}")
        if not plain and len(rcpts) != kills:
            report.wrong_results.append(f"{len(rcpts)} receipts for {kills} actions")
        return report
    finally:
        if worker is not None:
            worker.stop()
        flags.close()
        with engine.begin() as conn:
            orders.drop(conn, checkfirst=True)
            receipts_table(receipts).drop(conn, checkfirst=True)
            conn.execute(sa.text(f"DROP TABLE IF EXISTS {store_table}"))
        engine.dispose()
        if db == "sqlite":
            Path(db_url.removeprefix("sqlite:///")).unlink(missing_ok=True)
        server.cleanup()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=200, help="actions, each killed once (200)")
    parser.add_argument("--store", choices=("redis", "sql", "both"), default="both")
    parser.add_argument("--db", choices=("postgresql", "mariadb", "sqlite"), default="postgresql",
                        help="the business database (default postgresql)")
    parser.add_argument("--plain", action="store_true",
                        help="the control: no receipt (expect one duplicate row per kill)")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--lease", type=float, default=2.0)
    args = parser.parse_args(argv)
    stores = ("redis", "sql") if args.store == "both" else (args.store,)
    print(f"kill after commit: {args.kills} actions per store, worker -c {args.concurrency}, "
          f"lease {args.lease:g} s, business database {args.db}, {os.cpu_count()} CPUs")
    ok = True
    for store in stores:
        report = run(args.kills, store, db=args.db, concurrency=args.concurrency,
                     lease=args.lease, plain=args.plain)
        print(report.line(), flush=True)
        for problem in (report.missing + report.wrong_results)[:10]:
            print("   ", problem)
        ok = ok and report.ok
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
