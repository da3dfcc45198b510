"""Tasks of the scope and slot tests: bodies that enqueue other tasks, and a periodic one.

The app of ``app.py`` (same environment), plus tasks whose bodies enqueue a child and report what
the enqueue answered. A body cannot wait for its child (Celery forbids it), so it returns the
child's task id and key, and the test waits for the child.
"""

from __future__ import annotations

from typing import Any

from celery_idem import CachedResult, IdempotentTask
from celery_idem.contrib.saga import Saga
from tests.integration.app import app, charge, effect

__all__ = ["app"]


@app.task(base=IdempotentTask, bind=True, idempotency_fields=("order_id", "amount_cents"))
def place_order(self: Any, order_id: str, amount_cents: int) -> dict[str, Any]:
    """Charge the order from inside the body: the charge is in this body's scope."""
    effect(f"order:{order_id}", self.idempotency_scope)
    child = charge.apply_async((order_id, amount_cents))
    return {"scope": self.idempotency_scope, "principal": self.idempotency_principal,
            "child_id": child.id, "child_key": child.idempotency_key,
            "child_cached": isinstance(child, CachedResult)}


@app.task(base=IdempotentTask, bind=True, idempotency_fields=("order_id",))
def saga_order(self: Any, order_id: str, amount_cents: int) -> dict[str, Any]:
    """A saga whose step enqueues the charge: the charge is in the saga's scope."""
    saga = Saga(self)
    child = saga.step("enqueue_charge", lambda step: charge.apply_async(
        (order_id, amount_cents)).idempotency_key)
    return {"scope": self.idempotency_scope, "child_key": child}


@app.task(base=IdempotentTask, bind=True)
def pick(self: Any, order_id: str) -> str:
    """The first step of a chain: its result is the next step's argument."""
    effect(f"pick:{order_id}", self.idempotency_scope)
    return order_id


@app.task(base=IdempotentTask, bind=True)
def ship(self: Any, order_id: str) -> dict[str, Any]:
    """The chain's next step, published by the worker that ran ``pick``."""
    effect(f"ship:{order_id}", self.idempotency_scope)
    return {"order_id": order_id, "scope": self.idempotency_scope, "key": self.idempotency_key,
            "principal": self.idempotency_principal}


@app.task(base=IdempotentTask, bind=True, idempotency_period=10)
def report(self: Any) -> str:
    """A periodic report: one run per 10-second slot."""
    effect("report", self.idempotency_key)
    return str(self.idempotency_key)
