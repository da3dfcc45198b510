"""Sizing figures for docs/scaling.md, measured on real servers: ``python -m tests.scale.measure``.

* Redis: ``used_memory`` growth per done record, written by the store's own verbs (claim, then
  record) in a private ``redis-server``.
* PostgreSQL: table + index bytes per done record written by the verbs, dead tuples and HOT
  updates they leave, and the same at ``--big`` rows (filled with rows of the same shape).
* The purge ``DELETE`` on the big table: with the clock inside the statement and bound as a
  value (as the store does), as EXPLAIN ANALYZE sees them.
* Store round trips per task, counted at the SQL driver: a first ``delay()`` and a duplicate.
* The store's verbs through a private PgBouncer in transaction pooling mode (when installed),
  with psycopg's defaults and with ``prepare_threshold=None``.

Options: ``--redis-records N`` (20000), ``--pg-records N`` (10000), ``--big N`` (1000000),
``--pgbouncer-only``.
Everything is made under unique names and dropped afterwards.
"""

from __future__ import annotations

import argparse
import json
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import sqlalchemy as sa

from celery_idem.records import State
from celery_idem.stores.sql import SQLStore, db_now

PG = "postgresql+psycopg://root@127.0.0.1:5432/test"
RESULT = json.dumps({"order_id": "ord_8891", "charged": 4200}, separators=(",", ":")).encode()
OPERATION = "proj.tasks.charge_card"


def _key(i: int) -> str:
    return f"{OPERATION}:{uuid.UUID(int=i).hex}"  # 55 characters, like a derived key


def _write(store: Any, keys: list[str], threads: int = 4) -> float:
    def one(key: str) -> None:
        got = store.claim(key, owner="worker-host-01:12345", task_id=str(uuid.uuid4()),
                          attempt=0, lease=60, ttl=86400)
        store.record(key, got.token, state=State.DONE, content_type="application/json",
                     data=RESULT, ttl=86400)

    started = time.monotonic()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, keys))
    return time.monotonic() - started


def redis_sizes(n: int) -> dict[str, Any]:
    from celery_idem.stores.redis import RedisStore
    from tests.chaos.support import ChaosRedis

    server = ChaosRedis("--appendonly", "no")
    try:
        client = server.client()
        store = RedisStore.from_url(server.url, prefix="celery-idem:")
        before = int(client.info("memory")["used_memory"])
        took = _write(store, [_key(i) for i in range(n)])
        after = int(client.info("memory")["used_memory"])
        sample = int(client.memory_usage("celery-idem:" + _key(0), samples=0) or 0)
        store.close()
        per = (after - before) / n
        return {"records": n, "used_memory_bytes_per_record": round(per),
                "memory_usage_one_record": sample, "records_per_gib": int(2**30 / per),
                "write_seconds": round(took, 1)}
    finally:
        server.cleanup()


def _pg_stats(conn: sa.Connection, table: str) -> dict[str, int]:
    row = conn.exec_driver_sql(
        f"SELECT pg_total_relation_size('{table}'), pg_relation_size('{table}'), "
        f"pg_indexes_size('{table}'), (SELECT count(*) FROM {table})").one()
    stat = conn.exec_driver_sql(
        "SELECT n_tup_ins, n_tup_upd, n_tup_hot_upd, n_dead_tup FROM pg_stat_user_tables "
        f"WHERE relname = '{table}'").one()
    return {"total": row[0], "heap": row[1], "indexes": row[2], "rows": row[3],
            "inserts": stat[0], "updates": stat[1], "hot_updates": stat[2], "dead": stat[3]}


def pg_sizes(n: int, big: int) -> dict[str, Any]:
    table = f"measure_{uuid.uuid4().hex[:8]}_records"
    store = SQLStore("db+" + PG, prefix="celery-idem:", table_name=table)
    out: dict[str, Any] = {}
    try:
        store.get("warm-up")
        took = _write(store, [_key(i) for i in range(n)])
        engine = store._engine
        engine.dispose()  # the writers' backends exit, which flushes their pg_stat counters
        time.sleep(1)
        with engine.connect() as conn:
            s = _pg_stats(conn, table)
            out["verbs"] = {**s, "bytes_per_record": round(s["total"] / s["rows"]),
                            "write_seconds": round(took, 1)}
            conn.exec_driver_sql(f"VACUUM ANALYZE {table}")
            s = _pg_stats(conn, table)
            out["after_vacuum"] = {**s, "bytes_per_record": round(s["total"] / s["rows"])}
            # Fill to `big` rows of the same shape (2% expired), for size and purge at scale.
            conn.exec_driver_sql(
                f"INSERT INTO {table} (key, state, token, owner, task_id, attempt, content_type, "
                f"data, updated, expires) SELECT 'celery-idem:{OPERATION}:' || md5(i::text), "
                f"'done', 1, 'worker-host-01:12345', gen_random_uuid()::text, 0, "
                f"'application/json', decode('{RESULT.hex()}', 'hex'), extract(epoch from now()), "
                f"extract(epoch from now()) + CASE WHEN mod(i, 50) = 0 THEN -60 ELSE 86400 END "
                f"FROM generate_series(1, {big - n}) AS i")
            conn.exec_driver_sql(f"VACUUM ANALYZE {table}")
            s = _pg_stats(conn, table)
            out["big"] = {"rows": s["rows"], "total": s["total"], "heap": s["heap"],
                          "indexes": s["indexes"],
                          "bytes_per_record": round(s["total"] / s["rows"]),
                          "records_per_gib": int(2**30 / (s["total"] / s["rows"]))}
            out["purge"] = _purge_plans(conn, store, table)
    finally:
        with store._engine.connect() as conn:
            conn.exec_driver_sql(f"DROP TABLE IF EXISTS {table}")
        store.close()
    return out


def _purge_plans(conn: sa.Connection, store: SQLStore, table: str) -> dict[str, Any]:
    import psycopg

    t = store._table
    plans: dict[str, Any] = {}
    now = float(conn.execute(sa.select(db_now())).scalar_one())
    # EXPLAIN ANALYZE really deletes: run it in a transaction of our own, rolled back.
    with psycopg.connect(PG.replace("+psycopg", "")) as pg:
        for label, clock in (("clock_in_statement", db_now()),
                             ("clock_bound", sa.literal(now, sa.Double))):
            expired = sa.and_(store._own_rows(), t.c.expires <= clock)
            batch = sa.select(t.c.key).where(expired).limit(1000).scalar_subquery()
            delete = sa.delete(t).where(t.c.key.in_(batch), expired)
            sql = str(delete.compile(dialect=conn.dialect, compile_kwargs={"literal_binds": True}))
            for case, clear in (("expired_rows_present", False), ("no_expired_rows_left", True)):
                if clear:
                    pg.execute(f"DELETE FROM {table} WHERE expires <= {now}")
                lines = [r[0] for r in pg.execute("EXPLAIN (ANALYZE) " + sql.replace("%", "%%"))]
                pg.rollback()
                scan = next((ln.strip() for ln in lines
                             if "Seq Scan" in ln or "_expires on" in ln), "")
                ms = next(ln for ln in lines if ln.startswith("Execution Time"))
                plans[f"{label}/{case}"] = {"scan": scan.split("  (")[0], "time": ms}
    return plans


def statements_per_task() -> dict[str, int]:
    from celery import Celery

    from celery_idem import IdempotentTask
    from celery_idem.task import get_store

    table = f"measure_{uuid.uuid4().hex[:8]}_records"
    app = Celery("measure", set_as_current=False)
    app.conf.update(task_always_eager=True, idempotency_store="db+" + PG,
                    idempotency_store_options={"table_name": table})

    @app.task(base=IdempotentTask, bind=True)  # type: ignore[untyped-decorator]
    def charge(self: Any, order_id: str) -> str:
        return order_id

    store = get_store(app)
    store.get("warm-up")  # create the table outside the count
    count = {"n": 0}

    def seen(*_: Any) -> None:
        count["n"] += 1

    sa.event.listen(store._engine, "before_cursor_execute", seen)  # type: ignore[attr-defined]
    out: dict[str, int] = {}
    try:
        charge.delay("ord_1").get()
        out["first_delay"] = count["n"]
        count["n"] = 0
        charge.delay("ord_1").get()
        out["duplicate_delay"] = count["n"]
    finally:
        with store._engine.connect() as conn:  # type: ignore[attr-defined]
            conn.exec_driver_sql(f"DROP TABLE IF EXISTS {table}")
        store.close()
    return out


def pgbouncer_check(actions: int = 400) -> dict[str, Any]:
    """Store verbs through a private PgBouncer in transaction pooling mode, from 4 threads.

    Needs the ``pgbouncer`` binary (Debian: ``apt-get install pgbouncer``); as root it runs as
    the ``postgres`` user. Each action: claim, renew, record, get, a duplicate claim.
    """
    import os
    import shutil
    import signal
    import subprocess
    import tempfile

    from tests.integration.harness import free_port, wait_for

    exe = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"
    if not os.path.exists(exe):
        return {"skipped": "pgbouncer is not installed"}
    work = tempfile.mkdtemp(prefix="celery-idem-pgbouncer-")
    port = free_port()
    with open(f"{work}/users.txt", "w") as fh:
        fh.write('"root" ""\n')
    with open(f"{work}/pgbouncer.ini", "w") as fh:
        fh.write(f"[databases]\ntest = host=127.0.0.1 port=5432 dbname=test\n[pgbouncer]\n"
                 f"listen_addr = 127.0.0.1\nlisten_port = {port}\nauth_type = trust\n"
                 f"auth_file = {work}/users.txt\npool_mode = transaction\n"
                 f"default_pool_size = 4\nmax_client_conn = 200\nunix_socket_dir =\n")
    as_user = ["-u", "postgres"] if os.geteuid() == 0 else []
    if as_user:
        shutil.chown(work, "postgres")
        os.chmod(work, 0o755)
    proc = subprocess.Popen([exe, *as_user, f"{work}/pgbouncer.ini"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    table = f"measure_{uuid.uuid4().hex[:8]}_records"
    version = subprocess.run([exe, "--version"], capture_output=True, text=True).stdout.split()
    out: dict[str, Any] = {"pgbouncer": " ".join(version[:2]), "pool_mode": "transaction"}
    try:
        import socket

        def up() -> bool:
            with socket.socket() as sock:
                return sock.connect_ex(("127.0.0.1", port)) == 0

        wait_for(up, timeout=20, what="pgbouncer")
        for label, options in (("psycopg defaults", {}),
                               ("prepare_threshold=None",
                                {"connect_args": {"prepare_threshold": None}})):
            store = SQLStore(f"db+postgresql+psycopg://root@127.0.0.1:{port}/test",
                             prefix=f"{uuid.uuid4().hex[:6]}:", table_name=table,
                             engine_options=options)
            errors: dict[str, int] = {}

            def one(i: int, store: SQLStore = store, errors: dict[str, int] = errors) -> None:
                try:
                    key = f"op:{i}"
                    got = store.claim(key, owner="h:1", task_id=f"t{i}", attempt=0, lease=60,
                                      ttl=600)
                    store.renew(key, got.token, 60)
                    store.record(key, got.token, state=State.DONE,
                                 content_type="application/json", data=b"1", ttl=600)
                    rec = store.get(key)
                    assert rec is not None and rec.state is State.DONE
                    again = store.claim(key, owner="h:1", task_id=f"u{i}", attempt=0, lease=60,
                                        ttl=600)
                    assert again.status.value == "done"
                except Exception as exc:  # counted, by kind
                    reason = str(getattr(exc, "orig", None) or exc).splitlines()[0][:60]
                    name = f"{type(exc).__name__}: {reason}"
                    errors[name] = errors.get(name, 0) + 1

            with ThreadPoolExecutor(4) as pool:
                list(pool.map(one, range(actions)))
            store.close()
            top = sorted(errors.items(), key=lambda kv: -kv[1])[:3]
            out[label] = {"actions": actions, "failed": sum(errors.values()),
                          "most_common_errors": dict(top)}
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(20)
        engine = sa.create_engine(PG)
        with engine.begin() as conn:
            conn.exec_driver_sql(f"DROP TABLE IF EXISTS {table}")
        engine.dispose()
        shutil.rmtree(work, ignore_errors=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis-records", type=int, default=20000)
    parser.add_argument("--pg-records", type=int, default=10000)
    parser.add_argument("--big", type=int, default=1_000_000)
    parser.add_argument("--pgbouncer-only", action="store_true",
                        help="only the PgBouncer (transaction pooling) check")
    args = parser.parse_args()
    if args.pgbouncer_only:
        print(json.dumps({"pgbouncer_transaction_mode": pgbouncer_check()}, indent=2))
        return
    report = {
        "statements_per_task_postgresql": statements_per_task(),
        "redis": redis_sizes(args.redis_records),
        "postgresql": pg_sizes(args.pg_records, args.big),
        "pgbouncer_transaction_mode": pgbouncer_check(),
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
