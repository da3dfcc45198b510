"""Scenario 5: the Redis broker's ``visibility_timeout`` (2 s) is shorter than the body (8 s).

kombu hands the unacknowledged message to the other worker while the first still runs it
(celery-behaviour.md, Q6c). The copy must not run the body: the holder's heartbeat keeps its
3 s lease alive, so the copy waits, re-queues itself, and ends with the holder's result.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.chaos.support import pids, wait_for
from tests.integration import app as tasks

pytestmark = [pytest.mark.worker, pytest.mark.crash, pytest.mark.slow]


@pytest.mark.parametrize("kind", ["redis", "sql"])
def test_visibility_timeout_shorter_than_the_body_the_second_delivery_does_not_run_it(
    kind: str, make_stack: Callable[..., Any], action: Callable[[str], str], tmp_path: Path
) -> None:
    stack = make_stack(kind, env={"IDEM_VISIBILITY": "2"})
    workers = [stack.worker("a", concurrency=1), stack.worker("b", concurrency=1)]
    name = action("visibility")
    marker = tmp_path / "pids"
    # Given a body of 8 s on one worker (A), and a broker that re-delivers after 2 s
    r = tasks.chaos_effect.delay(name, hold=8, marker=str(marker))
    wait_for(lambda: pids(marker), timeout=30, what="the body to start")
    holder = next(w for w in workers if pids(marker)[0] in w.children())
    other = next(w for w in workers if w is not holder)
    # When the broker hands the same message to the other worker (B) while A still runs it
    wait_for(lambda: f"[{r.id}] received" in other.text(), timeout=30,
             what="the visibility-timeout copy to reach worker B")
    # Then the result is A's, and the body ran once
    out = r.get(timeout=60)
    assert out["pid"] == pids(marker)[0]
    assert [out["token"]] == [int(t) for t in Path(f"{marker}.tokens").read_text().split()]
    wait_for(stack.queue_empty, timeout=60, what="every copy to finish")
    assert pids(marker) == [out["pid"]]
    assert [e["pid"] for e in stack.effects(name)] == [out["pid"]]
    key = tasks.chaos_effect.idempotency_key_for((name,))
    assert not any("celery_idem takeover" in line for line in stack.key_lines(key))
    rec = stack.store.get(key)
    assert rec.state.value == "done" and rec.token == out["token"] and rec.task_id == r.id
