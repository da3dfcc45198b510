"""The worker's log at INFO: one structured line per decision, never the task's arguments, and a
recorded terminal error as an expected failure (no traceback)."""

from __future__ import annotations

import re
import uuid

import pytest

from celery_idem import TerminalError
from tests.flower.conftest import Stack
from tests.integration import app as tasks
from tests.integration.harness import wait_for

pytestmark = pytest.mark.worker


def test_a_takeover_is_logged_at_info_with_key_and_task_id_and_never_the_arguments(
    stack: Stack,
) -> None:
    cluster, worker = stack.cluster, stack.worker  # the worker logs at INFO (-l INFO)
    secret = f"SECRET-NOTE-{uuid.uuid4().hex}"
    order = f"ord-DISTINCT-{uuid.uuid4().hex[:8]}"
    key = tasks.charge.idempotency_key_for((order, 4200))
    # Given a holder that died without a trace but its claim (lease 0.2 s)
    dead = cluster.store.claim(key, owner="gone-host:1", task_id="dead-task-id", attempt=0,
                               lease=0.2, ttl=600)
    assert dead.status.holds
    wait_for(lambda: cluster.store.get(key).lease_expires <= cluster.store.now(),  # type: ignore[union-attr]
             timeout=10, what="the dead holder's lease to run out")
    # When the action is sent again, with an argument that must never be logged
    r = tasks.charge.delay(order, 4200, note=secret)
    taken = r.get(timeout=30)["token"]
    assert taken > dead.token
    # Then the worker logged one takeover line with the key and both task ids
    wait_for(lambda: f"celery_idem takeover key={key}" in worker.text(), timeout=10,
             what="the log line")
    log = worker.text()
    lines = [line for line in log.splitlines() if "celery_idem " in line]
    takeover = [line for line in lines if f"celery_idem takeover key={key} " in line]
    assert len(takeover) == 1, lines
    assert re.search(
        rf"INFO.*celery_idem takeover key={re.escape(key)} task_id={r.id} token={taken} "
        rf"original_task_id={r.id} previous_task_id=dead-task-id previous_owner=gone-host:1$",
        takeover[0],
    ), takeover[0]
    # The usual decisions (claimed, recorded) are DEBUG: not in an INFO log
    assert not any(re.search(r"celery_idem (claimed|recorded) ", line) for line in lines)
    # And no line carries the raw arguments: not the note, not the order id
    assert secret not in log
    assert not any(order in line for line in lines)


def test_a_duplicate_is_logged_at_info_naming_the_original_task_and_never_the_arguments(
    stack: Stack,
) -> None:
    worker = stack.worker
    secret = f"SECRET-NOTE-{uuid.uuid4().hex}"
    order = f"ord-DUPLOG-{uuid.uuid4().hex[:8]}"
    # Given a charge that ran, and a duplicate that reached the worker (send_task: no enqueue check)
    first = tasks.charge.delay(order, 4200, note=secret)
    first.get(timeout=30)
    dup = tasks.app.send_task("tests.integration.app.charge", (order, 4200), {"note": secret})
    dup.get(timeout=30)
    key = tasks.charge.idempotency_key_for((order, 4200))
    # Then one INFO line says which task the duplicate's answer came from
    wait_for(lambda: f"celery_idem duplicate key={key} " in worker.text(), timeout=10,
             what="the duplicate's log line")
    lines = [ln for ln in worker.text().splitlines() if f"celery_idem duplicate key={key} " in ln]
    assert len(lines) == 1, lines
    assert re.search(rf"INFO.*celery_idem duplicate key={re.escape(key)} task_id={dup.id} token=\d+ "
                     rf"original_task_id={first.id} record_state=done$", lines[0]), lines[0]
    assert secret not in worker.text() and order not in lines[0]


def test_a_terminal_error_is_logged_as_expected_at_info_without_a_traceback(stack: Stack) -> None:
    worker = stack.worker
    order = f"ord-DECLINED-{uuid.uuid4().hex[:8]}"
    # Given a charge the provider declines (a TerminalError: the action's recorded outcome)
    r = tasks.declined.delay(order)
    with pytest.raises(TerminalError, match="card declined"):
        r.get(timeout=30)
    # Then Celery's line for it is INFO "raised expected", with no traceback after it
    wait_for(lambda: f"[{r.id}] raised" in worker.text(), timeout=10, what="the failure's line")
    log = worker.text().splitlines()
    [index] = [i for i, line in enumerate(log) if f"[{r.id}] raised" in line]
    assert re.search(rf"INFO/.*Task {re.escape(tasks.declined.name)}\[{r.id}\] raised expected: "
                     r"TerminalError\('card declined for ", log[index]), log[index]
    following = log[index + 1] if index + 1 < len(log) else ""
    assert not following.startswith("Traceback"), following
