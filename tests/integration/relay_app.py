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


@app.task(base=IdempotentTask, bind=True, idempotency_fields=("order_id",), idempotency_intent=True)
def ship_order(self: Any, order_id: str) -> str:
    """Ship an order committed with the enqueue (the transactional enqueue): the body must see
    its row in the table ``IDEM_ORDERS`` of the database ``IDEM_ORDERS_DB``."""
    import sqlalchemy as sa

    engine = sa.create_engine(os.environ["IDEM_ORDERS_DB"])
    try:
        with engine.connect() as conn:
            seen = conn.exec_driver_sql(
                f"SELECT id FROM {os.environ['IDEM_ORDERS']} WHERE id = '{order_id}'").all()
    finally:
        engine.dispose()
    effect(f"ship_order:{order_id}", f"{self.request.id}:{len(seen)}")
    return order_id
