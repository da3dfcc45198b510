"""Helpers shared by the store tests: a short claim call, bounded polls, table clean-up.

Nothing here sleeps to synchronise: every wait polls a condition against a deadline, and the
deadline is on the store's own clock (the clock every lease and TTL is computed on).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

from celery_idem.records import Claim
from celery_idem.stores.base import Store

LONG = 60.0  # a lease or TTL that never runs out during a test
DEADLINE = 15.0  # upper bound, in seconds of store time, for every poll loop
INTERVAL = 0.02  # pause between two polls

T = TypeVar("T")


def claim(
    store: Store,
    key: str = "k",
    *,
    who: str = "a",
    attempt: int = 0,
    lease: float = LONG,
    ttl: float = LONG,
    payload_hash: str | None = None,
) -> Claim:
    """Claim ``key`` as worker ``who`` (owner ``host:<who>``, task id ``task-<who>``)."""
    return store.claim(
        key,
        owner=f"host:{who}",
        task_id=f"task-{who}",
        attempt=attempt,
        lease=lease,
        ttl=ttl,
        payload_hash=payload_hash,
    )


def poll(store: Store, check: Callable[[], T], what: str, timeout: float = DEADLINE) -> T:
    """Call ``check`` until it returns something truthy, within ``timeout`` s of store time."""
    deadline = store.now() + timeout
    while True:
        result = check()
        if result:
            return result
        if store.now() >= deadline:
            raise AssertionError(f"timed out after {timeout:g} s of store time waiting for {what}")
        time.sleep(INTERVAL)


def _django_sql(store: Any, sql: str, params: list[Any]) -> None:
    """Run one statement on a DjangoStore's table (``{t}`` in ``sql``) through its connection."""
    q = store.connection.ops.quote_name
    with store.connection.cursor() as cursor:
        cursor.execute(sql.format(t=q(store.table_name), key=q("key"), token=q("token")), params)


def drop_table(store: Any) -> None:
    """Drop a SQLStore's tables (each test has its own), if the test created them.

    A DjangoStore's table is the migrated one, shared by the session: only this store's
    prefix's rows go (its intents and watermarks too).
    """
    if hasattr(store, "using"):
        q = store.connection.ops.quote_name
        for table, column in ((store.table_name, "key"), (f"{store.table_name}_intents", "key"),
                              (f"{store.table_name}_watermarks", "queue")):
            with store.connection.cursor() as cursor:
                cursor.execute(f"DELETE FROM {q(table)} WHERE substr({q(column)}, 1, %s) = %s",
                               [len(store.prefix), store.prefix])
        return
    import sqlalchemy as sa

    for name in (f"{store._table.name}_intents", f"{store._table.name}_watermarks", store._table.name):
        sa.Table(name, sa.MetaData()).drop(store._engine, checkfirst=True)


def lose(store: Any, key: str) -> None:
    """Make the store lose ``key``'s record behind the gate's back, as a FLUSHALL, a restart
    without persistence, a failover that dropped the last writes, or a deleted row would."""
    from celery_idem.stores.memory import MemoryStore
    from celery_idem.stores.redis import RedisStore

    if isinstance(store, MemoryStore):
        with store._lock:
            store._records.pop(key, None)
    elif isinstance(store, RedisStore):
        store.client.delete(store.name_of(key))
    elif hasattr(store, "using"):  # DjangoStore
        _django_sql(store, "DELETE FROM {t} WHERE {key} = %s", [store._stored(key)])
    else:
        import sqlalchemy as sa

        t = store._table
        with store._engine.begin() as conn:
            conn.execute(sa.delete(t).where(t.c.key == store._stored(key)))


def set_token(store: Any, key: str, token: int) -> None:
    """Rewrite the token of ``key``'s record, keeping the rest (its claim id too).

    Simulates a token issued twice: a loss followed by a store clock that stepped back, the one
    case where the clock term of the token cannot keep it above the lost one.
    """
    import dataclasses

    from celery_idem.stores.memory import MemoryStore
    from celery_idem.stores.redis import RedisStore

    if isinstance(store, MemoryStore):
        with store._lock:
            rec, expires = store._records[key]
            store._records[key] = (dataclasses.replace(rec, token=token), expires)
    elif isinstance(store, RedisStore):
        name = store.name_of(key)
        value = store.client.get(name)
        assert value is not None
        head, sep, rest = value.partition(b"\0")
        digits = head[2:].partition(b".")
        head = head[:2] + str(token).encode() + digits[1] + digits[2]
        store.client.set(name, head + sep + rest, keepttl=True)
    elif hasattr(store, "using"):  # DjangoStore
        _django_sql(store, "UPDATE {t} SET {token} = %s WHERE {key} = %s", [token, store._stored(key)])
    else:
        import sqlalchemy as sa

        t = store._table
        with store._engine.begin() as conn:
            conn.execute(sa.update(t).where(t.c.key == store._stored(key)).values(token=token))
