"""Item 6 and 7: PostgreSQL bytes per record, and claim latency as the store grows.

* Redis growth runs on a PRIVATE ``redis-server`` on a free port (never the shared one: 1M keys),
  killed at the end. Done records are written server-side in the record's own format (one string,
  see ``celery_idem/stores/redis.py``: marker, state, token, updated ms, task id, empty payload
  hash, the JSON content type's code and the result; and a TTL), 20,000 per EVAL.
* PostgreSQL growth runs on a private table, filled with ``INSERT ... SELECT generate_series``,
  dropped at the end.

At each size, a claim of a new key and a claim of a done key (the duplicate) are timed in turn.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from .micro import OWNER, Timing, time_interleaved

# A raw string: the Lua escapes (\193 the format marker, \0 the separator, \1 the code of
# application/json;utf-8) reach the script as written.
FILL_LUA = r"""
local now = tonumber(redis.call('TIME')[1]) * 1000
local value = '\193d1\0' .. now .. '\0' .. ARGV[3] .. '\0\0\1\0' .. ARGV[4]
for i = tonumber(ARGV[1]), tonumber(ARGV[2]) do
  redis.call('SET', KEYS[1] .. string.format('%08x%024x', i, i), value, 'PX', 86400000)
end
return 1
"""
RESULT_JSON = '{"order_id": "ord_12345", "ok": true}'


@dataclass
class GrowthRow:
    store: str
    keys: int
    new: Timing
    duplicate: Timing
    fill_seconds: float
    used_memory: int | None = None  # Redis used_memory, or the PostgreSQL table + indexes, bytes
    shared_buffers: str | None = None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PrivateRedis:
    """A private ``redis-server`` (no persistence) on a free port; ``stop()`` kills it."""

    def __init__(self) -> None:
        self.port = _free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="celery-idem-bench-redis-"))
        exe = shutil.which("redis-server") or "/usr/bin/redis-server"
        self.proc = subprocess.Popen(
            [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.dir)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, socket_connect_timeout=0.5)
        deadline = time.monotonic() + 20
        while True:
            try:
                client.ping()
                break
            except redis.RedisError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.stop()
                    raise RuntimeError("the private redis-server did not start") from None
                time.sleep(0.05)
        client.close()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(20)
        shutil.rmtree(self.dir, ignore_errors=True)


def redis_growth(sizes: list[int], n: int, log: Callable[[str], None]) -> list[GrowthRow]:
    from celery_idem.stores.redis import RedisStore

    from .micro import _bench_task

    server = PrivateRedis()
    rows: list[GrowthRow] = []
    try:
        prefix = "celery-idem:"
        store = RedisStore.from_url(server.url, prefix=prefix)
        _, task, _ = _bench_task(store, prefix)
        cfg = task.idempotency_config
        key0 = task.idempotency_key_for(("x",))
        fill_prefix = prefix + key0[: key0.rindex(":") + 1]  # <prefix><task name>:
        fill = store.client.register_script(FILL_LUA)
        tid = str(uuid.uuid4())
        have = 0
        for size in sizes:
            t0 = time.perf_counter()
            while have < size:
                upto = min(size, have + 20000)
                fill(keys=[fill_prefix], args=[have, upto - 1, tid, RESULT_JSON])
                have = upto
            fill_s = time.perf_counter() - t0
            dup_key = f"{fill_prefix[len(prefix):]}{0:08x}{0:024x}"
            keys = {i: task.idempotency_key_for((f"grow:{size}:{i}",)) for i in range(-50, n)}

            def new(i: int, keys: dict[int, str] = keys) -> None:
                store.claim(keys[i], owner=OWNER, task_id=tid, attempt=0, lease=cfg.lease, ttl=cfg.ttl)

            def dup(i: int, k: str = dup_key) -> None:
                c = store.claim(k, owner=OWNER, task_id=tid, attempt=0, lease=cfg.lease, ttl=cfg.ttl)
                assert c.record is not None and c.record.state.value == "done", c

            t = time_interleaved({"new": new, "dup": dup}, n, warm=50)
            dbsize = int(store.client.dbsize())
            mem = int(store.client.info("memory")["used_memory"])
            rows.append(GrowthRow("redis", dbsize, t["new"], t["dup"], fill_s, mem))
            log(f"  redis growth {dbsize:>9,} keys: new {t['new'].median_us:.0f} µs, "
                f"duplicate {t['dup'].median_us:.0f} µs (filled in {fill_s:.1f} s)")
            have += n + 50  # the new claims added keys
        store.close()
    finally:
        server.stop()
    return rows


def _engine(url: str) -> Any:
    import sqlalchemy as sa

    return sa.create_engine(url[3:] if url.startswith("db+") else url)


def pg_record_size(pg_url: str, table: str, n: int) -> dict[str, float]:
    """``n`` real done records written by the gate's verbs; bytes per row from the catalog."""
    import sqlalchemy as sa

    from celery_idem.records import State
    from celery_idem.stores.sql import SQLStore

    store = SQLStore.from_url(pg_url, prefix="celery-idem:", table_name=table)
    try:
        from .micro import _bench_task

        _, task, _ = _bench_task("memory://", "celery-idem:")
        cfg = task.idempotency_config
        for i in range(n):
            k = task.idempotency_key_for((f"size:{i}",))
            c = store.claim(k, owner=OWNER, task_id=str(uuid.uuid4()), attempt=0, lease=cfg.lease,
                            ttl=cfg.ttl)
            store.record(k, c.token, state=State.DONE, content_type="application/json",
                         data=RESULT_JSON.encode(), ttl=cfg.ttl)
    finally:
        store.close()
    engine = _engine(pg_url)
    try:
        with engine.begin() as conn:
            q = conn.execute(sa.text(
                f"SELECT count(*), pg_total_relation_size('\"{table}\"'), pg_relation_size('\"{table}\"'), "
                f"pg_indexes_size('\"{table}\"'), avg(pg_column_size(t.*)) FROM \"{table}\" t")).one()
    finally:
        engine.dispose()
    rows, total, heap, idx, tuple_b = q
    return {"rows": int(rows), "total": total / rows, "heap": heap / rows, "indexes": idx / rows,
            "tuple": float(tuple_b), "result": len(RESULT_JSON)}


def pg_growth(pg_url: str, table: str, sizes: list[int], n: int,
              log: Callable[[str], None]) -> list[GrowthRow]:
    import sqlalchemy as sa

    from celery_idem.stores.sql import SQLStore

    from .micro import _bench_task

    prefix = "celery-idem:"
    store = SQLStore.from_url(pg_url, prefix=prefix, table_name=table)
    engine = _engine(pg_url)
    rows: list[GrowthRow] = []
    try:
        _, task, _ = _bench_task("memory://", prefix)
        cfg = task.idempotency_config
        key0 = task.idempotency_key_for(("x",))
        kp = prefix + key0[: key0.rindex(":") + 1]
        tid = str(uuid.uuid4())
        store.claim("create-table", owner=OWNER, task_id=tid, attempt=0, lease=1, ttl=60)
        have = 0
        for size in sizes:
            t0 = time.perf_counter()
            if have < size:
                with engine.begin() as conn:
                    conn.execute(sa.text(
                        f'INSERT INTO "{table}" (key, state, token, owner, task_id, attempt, lease_expires, '
                        "payload_hash, content_type, data, updated, expires) "
                        "SELECT :kp || lpad(to_hex(g), 32, '0'), 'done', 1, '', :tid, 0, NULL, NULL, "
                        "'application/json', convert_to(:res, 'UTF8'), extract(epoch from now()), "
                        "extract(epoch from now()) + 86400 "
                        "FROM generate_series(CAST(:a AS bigint), CAST(:b AS bigint)) g"),
                        {"kp": kp, "tid": tid, "res": RESULT_JSON, "a": have,
                         "b": size - 1})
                    conn.execute(sa.text(f'ANALYZE "{table}"'))
                have = size
            fill_s = time.perf_counter() - t0
            dup_key = f"{kp[len(prefix):]}{0:032x}"
            keys = {i: task.idempotency_key_for((f"grow:{size}:{i}",)) for i in range(-30, n)}

            def new(i: int, keys: dict[int, str] = keys) -> None:
                store.claim(keys[i], owner=OWNER, task_id=tid, attempt=0, lease=cfg.lease, ttl=cfg.ttl)

            def dup(i: int, k: str = dup_key) -> None:
                c = store.claim(k, owner=OWNER, task_id=tid, attempt=0, lease=cfg.lease, ttl=cfg.ttl)
                assert c.record is not None and c.record.state.value == "done", c

            t = time_interleaved({"new": new, "dup": dup}, n, warm=30)
            with engine.connect() as conn:
                count = int(conn.execute(sa.text(f'SELECT count(*) FROM "{table}"')).scalar_one())
                size_b = int(conn.execute(
                    sa.text(f"SELECT pg_total_relation_size('\"{table}\"')")).scalar_one())
                shared = str(conn.execute(sa.text("SHOW shared_buffers")).scalar_one())
            rows.append(GrowthRow("postgres", count, t["new"], t["dup"], fill_s, size_b, shared))
            log(f"  postgres growth {count:>9,} rows: new {t['new'].median_us:.0f} µs, "
                f"duplicate {t['dup'].median_us:.0f} µs (filled in {fill_s:.1f} s)")
    finally:
        store.close()
        with engine.begin() as conn:
            conn.execute(sa.text(f'DROP TABLE IF EXISTS "{table}"'))
        engine.dispose()
    return rows
