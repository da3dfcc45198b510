"""A minimal worker app for tests/stores/test_durability.py: its store and the option come from
the environment (``IDEM_DURABILITY_STORE``, ``IDEM_REQUIRE_DURABLE``)."""

from __future__ import annotations

import os
from typing import Any

from celery import Celery

from celery_idem import IdempotentTask

_url = os.environ.get("IDEM_DURABILITY_STORE", "redis://127.0.0.1:6379/0")
app = Celery("durability", broker=_url, backend=_url)
app.conf.update(
    idempotency_store=_url,
    idempotency_key_prefix="durability:",
    idempotency_require_durable_store=os.environ.get("IDEM_REQUIRE_DURABLE") == "1",
    task_default_queue="durability",
)


@app.task(base=IdempotentTask, bind=True)
def noop(self: Any, n: int) -> int:
    return n
