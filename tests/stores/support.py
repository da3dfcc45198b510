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


def drop_table(store: Any) -> None:
    """Drop a SQLStore's table (each test has its own), if the test created it."""
    import sqlalchemy as sa

    sa.Table(store._table.name, sa.MetaData()).drop(store._engine, checkfirst=True)
