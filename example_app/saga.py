"""The checkout saga: charge the card, create the order, send the receipt; undo on failure.

Each step is one write to the provider (``example_app/payments.py``), made with the step's own
idempotency key and fencing token (:class:`celery_idem.contrib.saga.Step`), so a step that ran, or whose
write reached the provider before its worker died, is never applied twice::

    charge_card ──> create_order ──> send_receipt
        │               │                 │ fails terminally (address rejected)
        │               │ sold out        v
        │               └──────> cancel_order (compensation of create_order)
        └──────────────────────> refund_charge (compensation of charge_card)

Run it (provider and worker as in ``example_app/README.md``)::

    from example_app.saga import checkout
    checkout.delay("ord_1", 4200, "ada@example.com", "book").get()

The task is a ``shared_task``, so it needs no particular app: the example worker includes this
module, and the test suite's worker loads it with ``-I example_app.saga``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from functools import partial
from typing import Any

from celery import shared_task

from celery_idem import IdempotentTask, TerminalError
from celery_idem.contrib.saga import Saga, Step

from .payments import ProviderClient, ProviderError

#: Stock of the example catalogue: "lamp" is sold out, so creating its order fails terminally.
STOCK = {"book": 100, "mug": 100, "lamp": 0}

Checkpoint = Callable[[str], None]


def _no_checkpoint(point: str) -> None:
    return None


def provider() -> ProviderClient:
    """The provider client (``EXAMPLE_PAYMENTS_URL``; the same default as the example app)."""
    return ProviderClient(os.environ.get("EXAMPLE_PAYMENTS_URL") or "http://127.0.0.1:8080",
                          timeout=5, retries=1)


def _post(step: Step, resource: str, body: dict[str, Any], checkpoint: Checkpoint) -> Any:
    """One write to the provider with the step's key and token; 4xx other than 409 is final."""
    headers = {"Idempotency-Key": step.idempotency_key,
               "Fencing-Token": str(step.idempotency_token)}
    try:
        out = provider().request("POST", f"/v1/{resource}", body, headers)
    except ProviderError as exc:
        if exc.status == 409:
            raise  # fenced off: a newer run of this step has written; this one stops here
        raise TerminalError(f"{resource} refused: {exc}") from exc
    # The write is committed at the provider; the step is not recorded yet (the tests crash
    # here to show that a resumed step replays this same write by key).
    checkpoint(f"{step.name}{':compensate' if step.compensating else ''}:committed")
    return out


# -- the steps and their compensations (first argument: the Step) -------------------------------

def charge_card(step: Step, order_id: str, amount_cents: int, *,
                checkpoint: Checkpoint = _no_checkpoint) -> dict[str, Any]:
    out = _post(step, "charges", {"order_id": order_id, "amount_cents": amount_cents,
                                  "currency": "usd"}, checkpoint)
    return {"id": out["id"], "order_id": order_id, "amount_cents": amount_cents}


def refund_charge(step: Step, charge: dict[str, Any], *,
                  checkpoint: Checkpoint = _no_checkpoint) -> dict[str, Any]:
    out = _post(step, "charge_refunds", {"order_id": charge["order_id"], "charge_id": charge["id"],
                                  "amount_cents": charge["amount_cents"]}, checkpoint)
    return {"id": out["id"]}


def create_order(step: Step, order_id: str, sku: str, charge_id: str, *,
                 checkpoint: Checkpoint = _no_checkpoint) -> dict[str, Any]:
    if STOCK.get(sku, 0) <= 0:
        raise TerminalError(f"{sku!r} is sold out; order {order_id} cannot be created")
    out = _post(step, "orders", {"order_id": order_id, "sku": sku, "charge_id": charge_id},
                checkpoint)
    return {"id": out["id"], "order_id": order_id}


def cancel_order(step: Step, order: dict[str, Any], *,
                 checkpoint: Checkpoint = _no_checkpoint) -> dict[str, Any]:
    out = _post(step, "cancellations", {"order_id": order["order_id"], "order": order["id"]},
                checkpoint)
    return {"id": out["id"]}


def send_receipt(step: Step, email: str, order_id: str, *,
                 checkpoint: Checkpoint = _no_checkpoint) -> dict[str, Any]:
    if "@" not in email:
        raise TerminalError(f"the receipt address {email!r} is rejected")
    out = _post(step, "emails", {"to": email, "template": "receipt", "order_id": order_id},
                checkpoint)
    return {"id": out["id"]}


def run_checkout(saga: Saga, order_id: str, amount_cents: int, email: str, sku: str,
                 checkpoint: Checkpoint = _no_checkpoint) -> dict[str, Any]:
    """The saga's body: three steps; ``checkpoint(point)`` is called between and inside them."""
    hook = {"checkpoint": checkpoint}
    charge = saga.step("charge_card", charge_card, order_id, amount_cents, **hook,
                       compensate=partial(refund_charge, **hook))
    checkpoint("after:charge_card")
    order = saga.step("create_order", create_order, order_id, sku, charge["id"], **hook,
                      compensate=partial(cancel_order, **hook))
    checkpoint("after:create_order")
    receipt = saga.step("send_receipt", send_receipt, email, order_id, **hook)
    return {"order_id": order_id, "charge": charge["id"], "order": order["id"],
            "receipt": receipt["id"]}


@shared_task(base=IdempotentTask, bind=True, name="shop.checkout",
             idempotency_fields=("order_id",), autoretry_for=(TimeoutError, ConnectionError),
             retry_backoff=False, default_retry_delay=0.5, max_retries=3)
def checkout(self: IdempotentTask, order_id: str, amount_cents: int, email: str,
             sku: str = "book") -> dict[str, Any]:
    """Check out one order: once per order id, however often it is enqueued or redelivered."""
    return run_checkout(Saga(self), order_id, amount_cents, email, sku)
