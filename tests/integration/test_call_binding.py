"""A call the body cannot be called with fails at once, as in plain Celery, and claims nothing."""

from __future__ import annotations

import time

import pytest

from tests.integration import app as tasks
from tests.integration.conftest import Cluster

pytestmark = pytest.mark.worker


def test_a_call_that_does_not_bind_fails_at_once_and_claims_nothing(cluster: Cluster) -> None:
    # typing=False: Celery sends not_typed(5); the worker cannot call the body with it. Plain
    # Celery stores FAILURE(TypeError) at once, and so must an IdempotentTask: nothing ran, so
    # nothing is claimed (no claim held for the lease) and nothing is recorded.
    cluster.worker()
    for _ in range(2):  # the second identical call fails at once too: no held claim to wait for
        result = tasks.not_typed.delay(5)
        started = time.monotonic()
        with pytest.raises(TypeError):
            result.get(timeout=10)
        assert time.monotonic() - started < 5
        assert result.status == "FAILURE"
    result = tasks.not_typed.delay(5, wrong_arg=5)
    with pytest.raises(TypeError):
        result.get(timeout=10)
    assert cluster.effects("not_typed") == []
    key = tasks.not_typed.idempotency_key_for((5,), {})
    assert cluster.store.get(key) is None
    # A call that binds is gated as usual.
    assert tasks.not_typed.delay(2, 3).get(timeout=10) == 5
    assert tasks.not_typed.delay(2, 3).get(timeout=10) == 5
    assert cluster.effects("not_typed") == ["1"]
