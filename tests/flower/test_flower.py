"""What Flower shows for each idempotency decision, over its HTTP API and ``/metrics``."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from celery_idem import LeaseLost
from celery_idem.keys import KeyParts, parse_key
from tests.flower.conftest import Stack, decisions
from tests.integration import app as tasks
from tests.integration.harness import ROOT, wait_for

pytestmark = pytest.mark.worker

CHARGE = "tests.integration.app.charge"


def _finished(outcomes: list[str]):  # type: ignore[no-untyped-def]
    def done(task: dict) -> bool:  # type: ignore[type-arg]
        return task.get("state") in ("SUCCESS", "FAILURE") \
            and task.get("idempotency_outcomes") == outcomes
    return done


def test_a_first_run_shows_claimed_then_recorded_with_its_key_and_token(stack: Stack) -> None:
    # Given a new business action
    first = tasks.charge.delay("fl_first", 100)
    first.get(timeout=30)
    key = tasks.charge.idempotency_key_for(("fl_first", 100))
    # Then Flower's task shows both decisions, the key and this task as the original
    info = stack.flower.wait_task(first.id, _finished(["claimed", "recorded"]), what="first run")
    assert info["state"] == "SUCCESS"  # the Celery state is left alone
    assert info["idempotency_outcome"] == "recorded"
    assert info["idempotency_key"] == key
    assert info["original_task_id"] == first.id
    assert info["idempotency_token"] == first.get()["token"]  # the claim's token
    assert info["previous_task_id"] is None


def test_a_duplicate_shows_that_it_was_a_duplicate_its_key_and_the_original_task_id(
    stack: Stack,
) -> None:
    first = tasks.charge.delay("fl_dup", 200)
    first.get(timeout=30)
    # When the same action is sent again by name (no enqueue-side short cut: it reaches the worker)
    dup = tasks.app.send_task(CHARGE, ("fl_dup", 200))
    assert dup.get(timeout=30) == first.get()
    # Then Flower shows, on the duplicate itself, what happened and to which task it refers
    info = stack.flower.wait_task(dup.id, _finished(["duplicate"]), what="the duplicate")
    assert info["state"] == "SUCCESS"  # not "done", the record's state
    assert info["idempotency_outcome"] == "duplicate"
    assert info["idempotency_key"] == tasks.charge.idempotency_key_for(("fl_dup", 200))
    assert info["original_task_id"] == first.id
    assert info["idempotency_record_state"] == "done"
    assert info["idempotency_token"] == first.get()["token"]  # the recorded claim's


def test_a_per_call_key_with_a_scope_is_shown_as_the_cli_shows_it(stack: Stack) -> None:
    caller = f"k-{uuid.uuid4().hex[:8]}"
    # Given a per-call key in a scope
    r = tasks.charge.apply_async(("fl_scoped", 250), idempotency_key=caller,
                                 idempotency_scope="t")
    # The stored key: the task's namespace, the scope, the caller's key
    stored = f"{CHARGE}@t:key={caller}"
    assert r.get(timeout=30)["key"] == stored
    assert parse_key(stored, CHARGE) == KeyParts(CHARGE, "t", caller, per_call=True)
    assert stack.cluster.store.get(stored) is not None
    # What `idem key --key --scope` prints for that call
    cli = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "tests.integration.app", "idem", "key", CHARGE,
         '"fl_scoped"', "250", "--key", caller, "--scope", "t"],
        cwd=ROOT, env={**os.environ, **stack.cluster.env}, capture_output=True, text=True,
        timeout=60)
    assert cli.returncode == 0, cli.stderr
    assert cli.stdout.strip() == stored
    # Then Flower shows the task's key as the CLI does
    info = stack.flower.wait_task(r.id, _finished(["claimed", "recorded"]), what="scoped run")
    assert info["idempotency_key"] == stored


def test_a_takeover_shows_every_attempt_the_new_token_and_the_previous_holder(
    stack: Stack, tmp_path: Path
) -> None:
    before = stack.flower.metrics()
    # Given a holder killed mid-body (its message is redelivered, with the same task id)
    marker = tmp_path / "pids"
    r = tasks.slow_charge.delay("fl_take", str(marker), 60)
    stack.worker.kill_child_running(marker)
    wait_for(lambda: len(marker.read_text().split()) >= 2, timeout=40, what="the takeover")
    stack.cluster.set_flag("release:fl_take")
    t1, t2 = (int(t) for t in Path(f"{marker}.tokens").read_text().split())
    assert r.get(timeout=40)["token"] == t2 > t1
    # Then the task in Flower lists the claim, the takeover after the lease, and the record
    info = stack.flower.wait_task(r.id, _finished(["claimed", "takeover", "recorded"]),
                                  what="the takeover")
    assert info["idempotency_token"] == t2
    assert info["previous_task_id"] == r.id  # the killed attempt of the same task id
    assert info["previous_owner"] and info["previous_owner"].endswith(tuple("0123456789"))
    assert info["original_task_id"] == r.id
    # And /metrics counts it
    after = stack.flower.metrics()
    name = "tests.integration.app.slow_charge"
    assert decisions(after, name, "takeover") - decisions(before, name, "takeover") == 1


def test_a_lease_lost_after_an_operator_release_is_shown_and_counted(stack: Stack) -> None:
    before = stack.flower.metrics()
    key = tasks.charge.idempotency_key_for(("fl_lost", 300))
    # Given a body holding its claim
    r = tasks.charge.delay("fl_lost", 300, hold=30)
    rec = wait_for(lambda: stack.cluster.store.get(key), timeout=30, what="the claim")
    # When an operator releases the live claim and the body then finishes
    stack.cluster.store.release(key, rec.token)
    stack.cluster.set_flag("release:fl_lost")
    # Then its record is fenced off, and Flower shows why the task failed
    with pytest.raises(LeaseLost):
        r.get(timeout=30)
    info = stack.flower.wait_task(r.id, _finished(["claimed", "lease_lost"]), what="lease_lost")
    assert info["state"] == "FAILURE"
    assert info["idempotency_context"] == "verb=record"
    after = stack.flower.metrics()
    assert decisions(after, CHARGE, "lease_lost") - decisions(before, CHARGE, "lease_lost") == 1


def test_metrics_count_every_decision_per_task_and_outcome(stack: Stack) -> None:
    before = stack.flower.metrics()
    first = tasks.charge.delay("fl_metrics", 400)
    first.get(timeout=30)
    dups = [tasks.app.send_task(CHARGE, ("fl_metrics", 400)) for _ in range(2)]
    for dup in dups:
        dup.get(timeout=30)
        stack.flower.wait_task(dup.id, _finished(["duplicate"]), what="a duplicate")
    stack.flower.wait_task(first.id, _finished(["claimed", "recorded"]), what="the first run")
    after = stack.flower.metrics()

    def delta(outcome: str) -> float:
        return decisions(after, CHARGE, outcome) - decisions(before, CHARGE, outcome)

    assert (delta("claimed"), delta("recorded"), delta("duplicate")) == (1, 1, 2)
    # Flower's own counter sees the same events, without the outcome
    worker = stack.worker.name
    events = [v for (name, labels), v in after.items()
              if name == "flower_events_total"
              and ("type", "task-idempotency") in labels and ("task", CHARGE) in labels]
    assert sum(events) >= 4, (worker, events)
