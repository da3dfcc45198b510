"""Fencing across data loss: the store loses a held claim while its body runs.

A body holds a real claim through the gate (with its lease keeper renewing it) when
the store loses the record: ``FLUSHALL`` on a private ``redis-server``, a ``DELETE`` of the row
on PostgreSQL, MariaDB and SQLite, the record dropped from the memory store. A duplicate then
claims the key afresh and records its result. Asserted, for every store:

* the duplicate's token is greater than the stale holder's (tokens never go backwards, even
  across the loss: ``max(previous + 1, store clock in µs)``);
* the stale holder's record is refused with ``LeaseLost`` when its body returns, so the key
  keeps one result, the duplicate's, and every later claim answers with it;
* the body did run twice: what stays true after a loss is the fence, not "at most once"
  (docs/reliability.md).

Every wait is bounded; the private Redis is this test's own, so FLUSHALL touches nothing else.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from celery_idem.codec import KombuCodec
from celery_idem.config import IdempotencyConfig
from celery_idem.events import Outcome
from celery_idem.exceptions import LeaseLost
from celery_idem.gate import Attempt, Gate
from celery_idem.records import ClaimStatus, State
from celery_idem.stores import store_from_url
from celery_idem.stores.base import Store
from tests.conftest import store_kinds
from tests.integration.harness import RedisServer, wait_for

from .support import DEADLINE, claim, drop_table, lose

KEY = "charge:loss"


@pytest.fixture(params=store_kinds("redis", "postgresql", "mysql", "sqlite", "memory"))
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def store(kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    """A store of ``kind``, on a private redis-server for Redis (the test runs FLUSHALL)."""
    server: RedisServer | None = None
    options: dict[str, Any] = {}
    if kind == "redis":
        server = RedisServer()
        url = server.url
    elif kind == "memory":
        url = "memory://"
    elif kind == "sqlite":
        url = f"db+sqlite:///{tmp_path / 'idem.db'}"
    else:
        url = "db+" + request.getfixturevalue("pg_url" if kind == "postgresql" else "mysql_url")
    if kind in ("postgresql", "mysql", "sqlite"):
        options["table_name"] = f"t_{uuid.uuid4().hex[:12]}"
    built = store_from_url(url, prefix="loss:", options=options)
    try:
        yield built
    finally:
        try:
            if "table_name" in options:
                drop_table(built)
        finally:
            built.close()
            if server is not None:
                server.cleanup()


def lose_everything(store: Store, kind: str) -> None:
    """The loss: FLUSHALL on the private Redis (a restart without persistence, a failover that
    dropped the last writes), the row deleted on SQL, the record dropped in memory."""
    if kind == "redis":
        store.client.flushall()  # type: ignore[attr-defined]
    else:
        lose(store, KEY)


def make_gate(store: Store, events: list[tuple[Outcome, int, str]]) -> Gate:
    config = IdempotencyConfig(
        operation="charge", fields=None, key_func=None, ttl=600.0, lease=2.0,
        release_on=(TimeoutError,), terminal_on=(), validate=False, wait=0.0, record_timeout=2.0,
    )

    def emit(outcome: Outcome, key: str, token: int, original: str, extra: dict[str, Any]) -> None:
        events.append((outcome, token, original))

    return Gate(store, config, KombuCodec("json", ["json"]), emit=emit)


def test_after_the_store_loses_a_held_claim_the_next_token_is_higher_and_the_stale_record_is_refused(
    store: Store, kind: str,
) -> None:
    events: list[tuple[Outcome, int, str]] = []
    gate = make_gate(store, events)
    running, resume = threading.Event(), threading.Event()
    effects: list[tuple[str, int]] = []

    def stale_body(token: int) -> dict[str, Any]:
        effects.append(("stale", token))
        running.set()
        assert resume.wait(DEADLINE), "the test never let the stale body finish"
        return {"charged_by": "stale", "token": token}

    def fresh_body(token: int) -> dict[str, Any]:
        effects.append(("fresh", token))
        return {"charged_by": "fresh", "token": token}

    with ThreadPoolExecutor(1) as pool:
        # Given a holder running its body under a real claim (the lease keeper renews it)
        stale = pool.submit(gate.run, Attempt(KEY, "task-stale", owner="host:stale"), stale_body)
        assert running.wait(DEADLINE), "the stale body never started"
        held = store.get(KEY)
        assert held is not None and held.state is State.IN_PROGRESS and held.task_id == "task-stale"
        stale_token = held.token
        # When the store loses the record, and a duplicate claims the key and records
        lose_everything(store, kind)
        assert store.get(KEY) is None
        fresh = gate.run(Attempt(KEY, "task-fresh", owner="host:fresh"), fresh_body).value
        # Then the duplicate's token is above the stale holder's
        assert fresh["charged_by"] == "fresh"
        assert fresh["token"] > stale_token
        # And when the stale body returns, its record is refused: the key keeps one result
        resume.set()
        with pytest.raises(LeaseLost) as info:
            stale.result(timeout=DEADLINE)
    assert (info.value.key, info.value.token) == (KEY, stale_token)
    rec = store.get(KEY)
    assert rec is not None
    assert (rec.state, rec.token, rec.task_id) == (State.DONE, fresh["token"], "task-fresh")
    assert gate.answer(rec) == fresh
    # Every later duplicate answers with that one result, without running the body
    again = claim(store, KEY, who="late")
    assert again.status is ClaimStatus.DONE and again.token == fresh["token"]
    assert gate.run(Attempt(KEY, "task-late", owner="host:late"), fresh_body).value == fresh
    # The body ran twice: after a loss, the fence holds, "at most once" does not
    assert effects == [("stale", stale_token), ("fresh", fresh["token"])]
    assert [(outcome, original) for outcome, _, original in events] == [
        (Outcome.CLAIMED, "task-stale"), (Outcome.CLAIMED, "task-fresh"),
        (Outcome.RECORDED, "task-fresh"), (Outcome.LEASE_LOST, "task-stale"),
        (Outcome.DUPLICATE, "task-fresh"),
    ]


def test_a_stale_release_after_the_loss_does_not_free_the_new_holders_claim(
    store: Store, kind: str,
) -> None:
    """A timeout-class error in the stale body releases its claim: refused, the new one stays."""
    stale = claim(store, KEY, who="stale")
    lose_everything(store, kind)
    # After a loss a token is the store's clock in µs: SQLite's reads whole milliseconds, and a
    # claim in the same one gets the same token (its claim id tells them apart: docs/fencing.md).
    wait_for(lambda: store.now() >= stale.now + 0.002, timeout=5, interval=0.001,
             what="the store's clock to pass the stale claim's millisecond")
    fresh = claim(store, KEY, who="fresh")
    assert fresh.status is ClaimStatus.CLAIMED and fresh.token > stale.token
    for refused in (
        lambda: store.release(KEY, stale.token, claim_id=stale.claim_id),
        lambda: store.renew(KEY, stale.token, 2.0, claim_id=stale.claim_id),
    ):
        with pytest.raises(LeaseLost):
            refused()
    assert claim(store, KEY, who="third").status is ClaimStatus.BUSY  # still the fresh holder's
    rec = store.get(KEY)
    assert rec is not None and (rec.owner, rec.token) == ("host:fresh", fresh.token)
