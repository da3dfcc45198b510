"""A worker app for tests/integration/test_worker_start.py, configured from the environment.

``IDEM_BROKER`` (required), ``IDEM_STORE`` (``idempotency_store``; unset: the store is the
result backend), ``IDEM_BACKEND`` (``result_backend``), ``IDEM_QUEUE``, ``IDEM_REQUIRE``
(``idempotency_require_durable_store``), ``IDEM_MISSPELT`` (a value for ``idempotency_stroe``).
"""

from __future__ import annotations

import os
from typing import Any

from celery import Celery

from celery_idem import IdempotentTask

app = Celery("start", broker=os.environ["IDEM_BROKER"],
             backend=os.environ.get("IDEM_BACKEND") or None)
app.conf.update(
    idempotency_key_prefix=os.environ.get("IDEM_PREFIX", "start:"),
    idempotency_require_durable_store=os.environ.get("IDEM_REQUIRE") == "1",
    task_default_queue=os.environ.get("IDEM_QUEUE", "idem-start"),
    broker_connection_retry_on_startup=True,
)
if os.environ.get("IDEM_STORE"):
    app.conf.idempotency_store = os.environ["IDEM_STORE"]
if os.environ.get("IDEM_MISSPELT"):
    app.conf.idempotency_stroe = os.environ["IDEM_MISSPELT"]


@app.task(base=IdempotentTask, bind=True, idempotency_fields=("n",))
def noop(self: Any, n: int) -> int:
    return n
