"""Scenarios 3 and 4: the worker child is SIGKILLed after the record, or inside the body's
open transaction; on the Redis and the SQL store, two real prefork workers.

(``tests/integration/test_crash.py`` already proves a mid-body kill with the Redis ledger; the
variant here kills the child inside the body's uncommitted PostgreSQL transaction, so the
ledger also shows that the killed attempt left no effect behind.)
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.chaos.support import Stack, pid_alive, pids, wait_for
from tests.integration import app as tasks

pytestmark = [pytest.mark.worker, pytest.mark.crash, pytest.mark.slow]


def test_child_killed_after_the_record_before_the_ack_the_redelivery_returns_the_cached_result(
    stack: Stack, action: Callable[[str], str], tmp_path: Path
) -> None:
    name = action("after-record")
    marker = tmp_path / "pids"
    # Given a body that returns, is recorded, and then its child is SIGKILLed before Celery
    # stores the result or acknowledges the message (acks_late)
    r = tasks.chaos_effect.delay(name, marker=str(marker), kill="after_record")
    # Then the message is redelivered and answers with the recorded result: the value the
    # killed child computed (its pid, its claim's token, first delivery), not a second run
    out = r.get(timeout=60)
    assert pids(marker) == [out["pid"]]
    assert [out["token"]] == [int(t) for t in Path(f"{marker}.tokens").read_text().split()]
    assert out["redelivered"] is False
    assert not pid_alive(out["pid"])
    wait_for(lambda: stack.logs().count(f"[{r.id}] received") >= 2, timeout=30,
             what="the redelivery")
    rec = stack.store.get(tasks.chaos_effect.idempotency_key_for((name,)))
    assert rec.state.value == "done" and rec.token == out["token"] and rec.task_id == r.id
    effects = stack.effects(name)
    assert len(effects) == 1 and effects[0]["pid"] == out["pid"]


def test_child_killed_mid_body_before_the_commit_takeover_after_the_lease_commits_once(
    stack: Stack, action: Callable[[str], str], tmp_path: Path
) -> None:
    name = action("before-commit")
    marker = tmp_path / "pids"
    # Given a body SIGKILLed inside its open ledger transaction (the row is written, not committed)
    r = tasks.chaos_effect.delay(name, marker=str(marker), kill="before_commit")
    # Then the redelivered message waits out the 3 s lease, takes over with a higher token and
    # commits
    out = r.get(timeout=60)
    started = pids(marker)
    assert len(started) == 2 and started[1] == out["pid"] != started[0]
    assert not pid_alive(started[0])
    t1, t2 = (int(t) for t in Path(f"{marker}.tokens").read_text().split())
    assert out["token"] == t2 > t1 and out["redelivered"] is True
    # And the killed attempt left nothing: one call, one effect, both the takeover's
    assert [(c["token"], c["pid"]) for c in stack.calls(name)] == [(t2, out["pid"])]
    assert [(e["token"], e["pid"]) for e in stack.effects(name)] == [(t2, out["pid"])]
    key = tasks.chaos_effect.idempotency_key_for((name,))
    assert any("celery_idem takeover" in line for line in stack.key_lines(key))
    rec = stack.store.get(key)
    assert rec.state.value == "done" and rec.token == t2
