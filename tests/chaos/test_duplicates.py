"""Scenarios 1 and 2: concurrent duplicates across two workers; a response lost after the commit.

Both run on the Redis store and on the SQL store (PostgreSQL) with two real prefork workers,
and count effects in the PostgreSQL ledger the bodies commit to.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
from celery.result import AsyncResult

from celery_idem import CachedResult
from tests.chaos.support import Stack, wait_for
from tests.integration import app as tasks

pytestmark = [pytest.mark.worker, pytest.mark.crash, pytest.mark.slow]


def test_many_concurrent_duplicates_across_two_workers_run_each_body_once(
    stack: Stack, action: Callable[[str], str]
) -> None:
    # Given three actions, each enqueued 12 times at the same instant from 36 threads
    names = [action(f"dup{i}") for i in range(3)]
    copies = 12
    start = threading.Barrier(len(names) * copies)
    results: dict[str, list[AsyncResult]] = {n: [] for n in names}
    errors: list[BaseException] = []
    lock = threading.Lock()

    def enqueue(name: str) -> None:
        start.wait(30)
        try:
            r = tasks.chaos_effect.delay(name, hold=1.0)
        except BaseException as exc:  # reported below, never swallowed
            errors.append(exc)
            return
        with lock:
            results[name].append(r)

    threads = [threading.Thread(target=enqueue, args=(n,)) for n in names for _ in range(copies)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    # Then every copy resolves to one result per action, from one body run (one claim)
    for name in names:
        values = [r.get(timeout=90) for r in results[name]]
        assert len(values) == copies
        assert all(v == values[0] for v in values), name
        effects = stack.effects(name)
        assert len(effects) == 1, effects
        assert effects[0]["task_id"] == values[0]["task_id"]
        assert effects[0]["token"] == values[0]["token"]
        key = tasks.chaos_effect.idempotency_key_for((name,))
        assert not any("celery_idem takeover" in line for line in stack.key_lines(key))
    # And the copies really were duplicates that reached the workers, on both of them
    sent = [r.id for rs in results.values() for r in rs if not isinstance(r, CachedResult)]
    assert len(sent) > len(names)
    for w in stack.workers:
        assert any(f"[{task_id}] received" in w.text() for task_id in sent), w.name


def test_response_lost_after_the_commit_only_a_forwarded_key_keeps_it_to_one_effect(
    stack: Stack, action: Callable[[str], str]
) -> None:
    honoured, naive = action("lost-reply-keyed"), action("lost-reply-naive")
    # Given bodies that commit, then lose the response (TimeoutError) on their first attempt
    keyed = tasks.chaos_effect.delay(honoured, forward_key=True, timeout="after_commit")
    plain = tasks.chaos_effect.delay(naive, forward_key=False, timeout="after_commit")
    out_keyed, out_plain = keyed.get(timeout=60), plain.get(timeout=60)
    # Then the timeout released the claim and autoretry ran the body again, under a new claim
    # with a higher token
    for name, out in ((honoured, out_keyed), (naive, out_plain)):
        t1, t2 = (c["token"] for c in stack.calls(name))
        assert out["retries"] == 1 and out["token"] == t2 > t1, name
    # With the key forwarded, the remote answered the retry as a replay: exactly one effect
    assert [c["applied"] for c in stack.calls(honoured)] == [True, False]
    assert len(stack.effects(honoured)) == 1
    # Without it, the honest limit: the gate cannot know the first commit happened, two effects
    assert len(stack.effects(naive)) == 2
    # And from now on both keys are done: a duplicate runs nothing and gets the recorded result
    for name, out in ((honoured, out_keyed), (naive, out_plain)):
        again = tasks.chaos_effect.delay(name, forward_key=True, timeout="after_commit")
        assert isinstance(again, CachedResult) and again.get(timeout=5) == out
    wait_for(stack.queue_empty, timeout=30, what="the queue to drain")
    assert len(stack.effects(honoured)) == 1 and len(stack.effects(naive)) == 2
