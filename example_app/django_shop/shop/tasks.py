"""The charge task: the order's update and its receipt commit in one transaction.atomic()."""

from typing import Any

from celery import shared_task

from celery_idem import IdempotentTask

from .models import Order


@shared_task(base=IdempotentTask, bind=True, idempotency_fields=("order_id",))
def charge(self: IdempotentTask, order_id: int) -> dict[str, Any]:
    """Charge an order once: one key per order id, whatever the other arguments or retries."""
    with self.idempotent_transaction() as tx:  # transaction.atomic() + the receipt
        order = Order.objects.select_for_update().get(pk=order_id)
        order.charged_cents += order.amount_cents
        order.charges += 1
        order.save()
        tx.result = {"order": order_id, "charged_cents": order.charged_cents,
                     "task_id": self.request.id}
    return tx.result
