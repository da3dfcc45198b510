"""``Task.replace`` hands the key over to the replacement: released at once, nothing recorded."""

from __future__ import annotations

import time

import pytest
from celery import chain
from celery.exceptions import TimeoutError as CeleryTimeoutError

from celery_idem.records import State
from tests.integration import app as tasks
from tests.integration.conftest import Cluster

pytestmark = pytest.mark.worker


def test_a_replaced_task_releases_its_key_and_its_result_lands_under_its_id(
    cluster: Cluster,
) -> None:
    # Task.replace publishes the replacement (frozen with the replaced task's id) and raises
    # Ignore. The gate must not hold the key for the lease: the replacement carries the action.
    cluster.worker()
    res = chain(tasks.replaced.si("r1"), tasks.add_step.si(10, "r1-after")).delay()
    assert res.get(timeout=20) == 11
    assert cluster.effects("replaced:r1:in") == ["1"]
    assert cluster.effects("replaced:r1:out") == ["1"]
    assert cluster.effects("step:r1-after") == ["1"]
    key = tasks.replaced.idempotency_key_for(("r1",), {})
    rec = cluster.store.get(key)  # released (a tombstone keeps the token), nothing recorded
    assert rec is None or rec.state is State.RELEASED
    # The replaced call again, at once: not held, so it runs (and replaces) again without
    # waiting for the 60 s lease; the replacement's steps are done and answered from their
    # records, and the result reaches the new id.
    started = time.monotonic()
    again = tasks.replaced.si("r1").delay()
    try:
        assert again.get(timeout=15) == "r1:done"
    except CeleryTimeoutError:  # pragma: no cover - the failure this test guards against
        pytest.fail("the replaced key was held: the repeated call waited for the lease")
    assert time.monotonic() - started < 10
    assert cluster.effects("replaced:r1:in") == ["1", "1"]
    assert cluster.effects("step:r1-step") == ["1"]  # one action, run once
    assert cluster.effects("replaced:r1:out") == ["1"]
