"""Pending.wait never raises: a result backend that cannot be reached gives an error outcome.

The backend is a real Redis URL on a port where nothing listens (connection refused at once).
"""

from __future__ import annotations

import time

from celery import Celery
from celery.result import AsyncResult

from celery_idem import IdempotentTask
from celery_idem.contrib.tools import Pending, tool
from tests.integration.harness import free_port


def test_wait_with_the_backend_down_answers_an_error_instead_of_raising() -> None:
    app = Celery("tools-backend-down", broker="memory://",
                 backend=f"redis://127.0.0.1:{free_port()}/0", set_as_current=False)
    app.conf.redis_backend_health_check_interval = None

    @app.task(base=IdempotentTask, name="tools_backend_down.charge", shared=False)
    def charge(order_id: str) -> str:
        return order_id

    t = tool(charge, timeout=1.0)
    pending = Pending(t, result=AsyncResult("3f1c7a52-task", app=app), key="k-backend-down")
    started = time.monotonic()
    out = pending.wait(timeout=1.0)
    assert out["status"] == "error", out
    assert out["retryable"] is True, out
    assert out["task_id"] == "3f1c7a52-task" and out["idempotency_key"] == "k-backend-down"
    assert "could not be read" in out["message"], out
    assert time.monotonic() - started < 60  # bounded: it answered, it did not hang
