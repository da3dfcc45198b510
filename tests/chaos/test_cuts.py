"""Scenario 8 (and 9): the connection to the store is cut mid-operation, at claim, at record and
at renew, with real workers.

Two kinds of cut, each made deterministic:

* the server kills the worker's connection while the command waits: Redis ``CLIENT PAUSE
  WRITE`` holds every script, then ``CLIENT KILL ID``; PostgreSQL ``LOCK TABLE`` holds every
  write, then ``pg_terminate_backend``. The command never runs.
* the reply is lost (:class:`~tests.chaos.support.TcpProxy` ``drop_reply``): the command ran,
  the worker never hears so.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from tests.chaos.support import Stack, load_scripts, lua_sha, pids, wait_for
from tests.integration import app as tasks

pytestmark = [pytest.mark.worker, pytest.mark.crash, pytest.mark.slow]


@pytest.fixture
def redis_active(redis_stack: Any) -> Iterator[Any]:
    with redis_stack.active():
        yield redis_stack


@pytest.fixture
def sql_active(sql_stack: Any) -> Iterator[Any]:
    with sql_stack.active():
        yield sql_stack


def key_of(task: Any, name: str) -> str:
    return str(task.idempotency_key_for((name,)))


def no_takeover(stack: Stack, key: str) -> bool:
    return not any("celery_idem takeover" in line for line in stack.key_lines(key))


# -- the server kills the connection ----------------------------------------------------------


class RedisKiller:
    """``CLIENT PAUSE WRITE`` the store, then ``CLIENT KILL`` the client whose script waits."""

    def __init__(self, stack: Any) -> None:
        self.admin = stack.store_server.client()

    def hold(self) -> None:
        self.admin.client_pause(30_000, all=False)

    def kill_waiting(self, verb: str) -> int:
        def waiting() -> list[dict[str, Any]]:
            return [c for c in self.admin.client_list()
                    if "b" in c["flags"] and c["cmd"] == "evalsha"]

        try:
            found = wait_for(waiting, timeout=30, what=f"the {verb} script to wait")
            for client in found:
                self.admin.client_kill_filter(_id=client["id"])
        finally:
            self.admin.client_unpause()
        return len(found)

    def close(self) -> None:
        self.admin.client_unpause()
        self.admin.close()


class PgKiller:
    """``LOCK TABLE`` the store's table, then ``pg_terminate_backend`` the waiting write."""

    def __init__(self, stack: Any) -> None:
        self.stack = stack
        self.admin = psycopg.connect(stack.ledger.url, autocommit=True)
        self.lock: psycopg.Connection[Any] | None = None
        stack.store.get("make-sure-the-table-exists")

    def hold(self) -> None:
        self.lock = psycopg.connect(self.stack.ledger.url)
        self.lock.execute(f"LOCK TABLE {self.stack.table} IN SHARE ROW EXCLUSIVE MODE")

    def kill_waiting(self, verb: str) -> int:
        # pg_stat_activity keeps the first 1 kB of a statement: enough for its opening words.
        marks = {"claim": 'WITH peek', "record": "SET state =", "renew": "SET lease_expires ="}

        def waiting() -> list[tuple[int, str]]:
            return self.admin.execute(
                "SELECT pid, query FROM pg_stat_activity WHERE application_name = %s "
                "AND wait_event_type = 'Lock'", (self.stack.application_name,),
            ).fetchall()

        try:
            found = wait_for(waiting, timeout=30, what=f"the {verb} statement to wait")
            for pid, query in found:
                assert marks[verb] in query, query
                self.admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
        finally:
            self.close_lock()
        return len(found)

    def close_lock(self) -> None:
        if self.lock is not None:
            self.lock.rollback()
            self.lock.close()
            self.lock = None

    def close(self) -> None:
        self.close_lock()
        self.admin.close()


@pytest.mark.parametrize("kind", ["redis", "sql"])
def test_store_connection_killed_at_claim_at_record_and_at_renew(
    kind: str, request: pytest.FixtureRequest, action: Callable[[str], str], tmp_path: Path
) -> None:
    stack = request.getfixturevalue(f"{kind}_active")
    killer = RedisKiller(stack) if kind == "redis" else PgKiller(stack)
    try:
        # At claim: the claim never runs; the attempt re-queues (store unavailable) and the
        # next delivery claims once and runs it
        at_claim = action("cut-claim")
        killer.hold()
        r = tasks.chaos_effect.delay(at_claim)
        assert killer.kill_waiting("claim") == 1
        out = r.get(timeout=60)
        assert [e["token"] for e in stack.effects(at_claim)] == [out["token"]]
        assert no_takeover(stack, key_of(tasks.chaos_effect, at_claim))
        lines = stack.key_lines(key_of(tasks.chaos_effect, at_claim))
        assert any("requeued" in line and "store_unavailable" in line for line in lines)

        # At record (60 s lease: no renewal is due): the record is retried and lands
        at_record = action("cut-record")
        marker = tmp_path / "record"
        r = tasks.chaos_effect_long.delay(at_record, hold=30, marker=str(marker))
        wait_for(lambda: pids(marker), timeout=30, what="the body to start")
        killer.hold()
        stack.release(at_record)
        assert killer.kill_waiting("record") == 1
        out = r.get(timeout=60)
        rec = stack.store.get(key_of(tasks.chaos_effect_long, at_record))
        assert rec.state.value == "done" and rec.token == out["token"]
        assert no_takeover(stack, key_of(tasks.chaos_effect_long, at_record))
        assert len(stack.effects(at_record)) == 1

        # At renew (3 s lease, renewed every second while the body holds): renewed again soon
        # after, the lease never runs out, nobody takes over
        at_renew = action("cut-renew")
        marker = tmp_path / "renew"
        key = key_of(tasks.chaos_effect, at_renew)
        r = tasks.chaos_effect.delay(at_renew, hold=30, marker=str(marker))
        wait_for(lambda: pids(marker), timeout=30, what="the body to start")
        killer.hold()
        assert killer.kill_waiting("renew") == 1
        wait_for(lambda: any("renew failed" in line for line in stack.key_lines(key)),
                 timeout=30, what="the failed renewal to be logged")
        dup = tasks.chaos_effect.delay(at_renew)  # a duplicate meanwhile: must not run
        stack.release(at_renew)
        out = r.get(timeout=60)
        assert out["token"] == stack.store.get(key).token and dup.get(timeout=60) == out
        assert len(stack.effects(at_renew)) == 1 and pids(marker) == [out["pid"]]
        assert no_takeover(stack, key)
    finally:
        killer.close()


# -- the reply is lost ------------------------------------------------------------------------

# What identifies each verb's request on the wire.
REDIS_VERBS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "claim": ((lua_sha("claim"),), ()),
    "record": ((lua_sha("record"),), ()),
    "renew": ((lua_sha("renew"),), ()),
}
SQL_VERBS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "claim": (("ON CONFLICT",), ()),
    "record": (("SET state =", "content_type = $"), ("owner = $", "ON CONFLICT")),
    "renew": (("SET lease_expires =", "RETURNING"), ("ON CONFLICT",)),
}


@pytest.mark.parametrize("kind", ["redis", "sql"])
def test_store_reply_lost_at_claim_at_record_and_at_renew(
    kind: str, request: pytest.FixtureRequest, action: Callable[[str], str], tmp_path: Path
) -> None:
    stack = request.getfixturevalue(f"{kind}_active")
    verbs = REDIS_VERBS if kind == "redis" else SQL_VERBS
    if kind == "redis":
        load_scripts(stack.store_server.client())

    def arm(verb: str, key: str) -> Any:
        patterns, exclude = verbs[verb]
        return stack.proxy.arm(*patterns, stack.prefix + key, mode="drop_reply", exclude=exclude)

    # At claim: the claim is written but the attempt never hears so. It re-queues, finds its
    # own orphaned claim busy, and takes it over when the 3 s lease runs out (a higher token),
    # one run
    at_claim = action("lost-claim")
    rule = arm("claim", key_of(tasks.chaos_effect, at_claim))
    out = tasks.chaos_effect.delay(at_claim).get(timeout=60)
    assert rule.hits == 1
    assert [e["token"] for e in stack.effects(at_claim)] == [out["token"]]
    assert not no_takeover(stack, key_of(tasks.chaos_effect, at_claim))

    # At record: the record is written, its reply lost; the retried record finds its own
    # outcome already there (same token, same state) and succeeds
    at_record = action("lost-record")
    key = key_of(tasks.chaos_effect, at_record)
    rule = arm("record", key)
    out = tasks.chaos_effect.delay(at_record).get(timeout=60)
    assert rule.hits == 1
    rec = stack.store.get(key)
    assert rec.state.value == "done" and rec.token == out["token"] and no_takeover(stack, key)
    assert len(stack.effects(at_record)) == 1
    again = tasks.chaos_effect.apply_async((at_record,), link_error=tasks.plain.si("x"))
    assert again.get(timeout=60) == out  # a duplicate delivered to a worker runs nothing
    assert len(stack.effects(at_record)) == 1

    # At renew: the lease was extended, the holder does not know; it renews again, no takeover
    at_renew = action("lost-renew")
    key = key_of(tasks.chaos_effect, at_renew)
    marker = tmp_path / "renew"
    rule = arm("renew", key)
    r = tasks.chaos_effect.delay(at_renew, hold=30, marker=str(marker))
    assert rule.fired.wait(30)
    wait_for(lambda: any("renew failed" in line for line in stack.key_lines(key)), timeout=30,
             what="the failed renewal to be logged")
    stack.release(at_renew)
    assert r.get(timeout=60)["token"] == stack.store.get(key).token
    assert len(stack.effects(at_renew)) == 1 and len(pids(marker)) == 1
    assert no_takeover(stack, key)
