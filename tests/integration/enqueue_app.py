"""The integration app plus a task with the producer-side done-check turned off.

Workers run it with ``celery -A tests.integration.enqueue_app``; the tasks of
tests/integration/app.py are registered too (the same app object).
"""

from __future__ import annotations

from celery_idem import IdempotentTask
from tests.integration.app import app, effect

__all__ = ["app", "charge_unchecked"]


@app.task(base=IdempotentTask, bind=True, idempotency_fields=("order_id",),
          idempotency_check_on_enqueue=False)
def charge_unchecked(self, order_id, amount_cents):  # type: ignore[no-untyped-def]
    """Charge once; an enqueue never reads the store first."""
    effect(f"charge_unchecked:{order_id}", self.request.id)
    return {"order_id": order_id, "charged": amount_cents, "ran_in": self.request.id}
