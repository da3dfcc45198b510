"""The app of ``app.py`` (same environment) with a task that keeps intents, for the worker's relay
(tests/integration/test_relay_worker.py). ``IDEM_RELAY_AFTER`` sets ``idempotency_relay_after``
(and a 0.2 s relay interval); ``IDEM_RELAY=0`` turns the relay off."""

from __future__ import annotations

import os
from typing import Any

from celery_idem import IdempotentTask
from tests.integration.app import app, effect

__all__ = ["app", "ship"]

if os.environ.get("IDEM_RELAY_AFTER"):
    app.conf.idempotency_relay_after = float(os.environ["IDEM_RELAY_AFTER"])
    app.conf.idempotency_relay_interval = 0.2
if os.environ.get("IDEM_RELAY") == "0":
    app.conf.idempotency_relay = False


@app.task(base=IdempotentTask, bind=True, idempotency_fields=("order_id",), idempotency_intent=True)
def ship(self: Any, order_id: str) -> str:
    """Ship once: the message is kept in the store until the outcome is recorded."""
    effect(f"ship:{order_id}", self.request.id)
    return order_id
