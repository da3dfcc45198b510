"""Scenarios 6 and 7: the store goes away while tasks are queued; Redis restarts with and
without persistence.

(``tests/integration/test_crash.py`` proves one task re-queued while the store is down; here a
backlog of duplicates waits on two workers, on both stores. For PostgreSQL, which other tests
share, "down" is the proxy in front of it refusing connections.)
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from typing import Any

import pytest

from celery_idem import CachedResult
from tests.chaos.support import wait_for
from tests.integration import app as tasks

pytestmark = [pytest.mark.worker, pytest.mark.crash, pytest.mark.slow]


def requeues_for_store(stack: Any) -> int:
    return sum(1 for line in stack.logs().splitlines()
               if "celery_idem requeued" in line and "reason=store_unavailable" in line)


@pytest.mark.parametrize("kind", ["redis", "sql"])
def test_store_down_while_tasks_are_queued_nothing_runs_then_every_action_runs_once(
    kind: str, make_stack: Callable[..., Any], action: Callable[[str], str]
) -> None:
    stack = make_stack(kind)
    stack.worker("a")
    stack.worker("b")
    if kind == "redis":
        down, up = (lambda: stack.store_server.stop(signal.SIGKILL)), stack.store_server.start
    else:
        down, up = stack.proxy.down, stack.proxy.up
    names = [action(f"outage{i}") for i in range(12)]
    # Given the store is down
    down()
    # When two copies of each of 12 actions are enqueued (the enqueue check is skipped)
    results = [tasks.chaos_effect.delay(n) for n in names for _ in range(2)]
    assert not any(isinstance(r, CachedResult) for r in results)
    # Then the messages are re-queued (twice per action at least: a copy sent while its action's
    # message is in flight attaches to it) and no body runs meanwhile
    wait_for(lambda: requeues_for_store(stack) >= 2 * len(names), timeout=90,
             what="every action's message to be re-queued twice")
    assert stack.ledger.effect_counts(action("")) == {}
    # And once the store is back, every action completes, exactly once
    up()
    outcomes = [r.get(timeout=120) for r in results]
    assert {o["action"] for o in outcomes} == set(names)
    assert stack.ledger.effect_counts(action("")) == {n: 1 for n in names}
    # each from the one claim that ran its one effect
    assert all([e["token"] for e in stack.effects(o["action"])] == [o["token"]] for o in outcomes)


def test_redis_restart_with_aof_keeps_the_records_and_without_persistence_loses_them(
    make_stack: Callable[..., Any], action: Callable[[str], str]
) -> None:
    aof = ("--appendonly", "yes", "--appendfsync", "everysec")
    stack = make_stack("redis", store_args=aof)
    stack.worker("a")
    server = stack.store_server
    names = [action(f"aof{i}") for i in range(5)]
    first = {n: tasks.chaos_effect.delay(n).get(timeout=60) for n in names}

    def duplicate_on_a_worker(name: str) -> Any:
        # send_task skips the enqueue check: the worker's gate must answer
        return tasks.app.send_task(tasks.chaos_effect.name, (name,)).get(timeout=60)

    # Given the store's Redis, with AOF (appendfsync everysec), is SIGKILLed and restarted
    server.stop(signal.SIGKILL)
    server.start()
    # Then every record survived: done, the first claim's token, and duplicates run nothing
    for n in names:
        rec = stack.store.get(tasks.chaos_effect.idempotency_key_for((n,)))
        assert rec is not None and rec.state.value == "done" and rec.token == first[n]["token"]
        assert isinstance(tasks.chaos_effect.delay(n), CachedResult)
        assert duplicate_on_a_worker(n) == first[n]
    assert stack.ledger.effect_counts(action("")) == {n: 1 for n in names}

    # Given a restart without persistence (no AOF, no RDB snapshot)
    server.stop(signal.SIGKILL)
    server.args = ["--appendonly", "no"]
    server.start()
    # Then the records are gone, and a duplicate runs the body again: the documented loss
    for n in names:
        assert stack.store.get(tasks.chaos_effect.idempotency_key_for((n,))) is None
        # Its token is above the lost one: tokens never go backwards, even across the loss
        # (a token restarting at 1 would match a stale holder's)
        assert duplicate_on_a_worker(n)["token"] > first[n]["token"]
    assert stack.ledger.effect_counts(action("")) == {n: 2 for n in names}
