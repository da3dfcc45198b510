"""With accelerations switched off, the verbs never reach an acceleration's code (real servers).

The unit test (tests/unit/test_accel_switch.py) checks each store's seam; here every verb runs
with the accelerated paths made to fail, so a verb that still took one would fail the test, and
a kombu Redis channel is hooked for the enqueue check within the publish only when they are on.
"""

from __future__ import annotations

import uuid
from typing import Any, NoReturn

import pytest

from celery_idem.config import ACCELERATE_ENV
from celery_idem.records import State
from celery_idem.stores import redis_wire
from celery_idem.stores.base import Store
from celery_idem.stores.redis import RedisStore
from celery_idem.stores.sql import SQLStore
from celery_idem.stores.sql import psycopg as sql_psycopg

from .support import LONG, claim, drop_table


def _forbidden(*args: Any, **kwargs: Any) -> NoReturn:
    raise AssertionError("an acceleration ran with accelerations off")


def _every_verb(store: Store) -> None:
    c = claim(store, "k")
    assert store.renew("k", c.token, LONG, claim_id=c.claim_id) > 0
    store.record("k", c.token, state=State.DONE, content_type="c", data=b"x", ttl=LONG,
                 claim_id=c.claim_id)
    record = store.get("k")
    assert record is not None and record.state is State.DONE
    assert [r.key for r in store.scan()] == ["k"]
    store.forget("k", record.token)
    gone = store.get("k")
    assert gone is None or gone.state is State.RELEASED  # a tombstone keeps the token
    if store.reserves:
        assert store.reserve("r", "task-1", LONG) is None
        store.unreserve("r", "task-1")


def test_a_redis_store_switched_off_never_uses_the_wire(
    redis_url: str, prefix: str, redis_cleanup: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(redis_wire.Wire, "call", _forbidden)
    monkeypatch.setattr(redis_wire, "wire_for", _forbidden)
    store = RedisStore.from_url(redis_url, prefix=prefix, accelerate=False)
    try:
        _every_verb(store)
    finally:
        store.close()


def test_a_sql_store_switched_off_never_uses_psycopg_directly(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sql_psycopg.RawSession, "run", _forbidden)
    monkeypatch.setattr(sql_psycopg.PsycopgPath, "connection", _forbidden)
    store = SQLStore.from_url("db+" + pg_url, prefix="off:", table_name=f"t_{uuid.uuid4().hex[:12]}",
                              accelerate=False)
    try:
        _every_verb(store)
    finally:
        drop_table(store)
        store.close()


@pytest.mark.parametrize("accelerate", [True, False])
def test_the_enqueue_check_rides_on_the_publish_only_with_accelerations_on(
    redis_url: str, prefix: str, redis_cleanup: None, monkeypatch: pytest.MonkeyPatch,
    accelerate: bool,
) -> None:
    from kombu import Connection

    from celery_idem import enqueue_redis

    monkeypatch.delenv(ACCELERATE_ENV, raising=False)  # the setting decides here
    store = RedisStore.from_url(redis_url, prefix=prefix, accelerate=accelerate)
    try:
        with Connection(redis_url) as conn:
            channel = conn.default_channel
            assert (enqueue_redis.fuse(channel, store) is not None) is accelerate
            assert ("_put" in channel.__dict__) is accelerate  # kombu's own _put when off
    finally:
        store.close()
