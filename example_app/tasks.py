"""The agent's write tools as ``IdempotentTask``: each business action has its effect once.

The key is derived from the business action (``idempotency_fields``) once, when the tool call
is enqueued, above every retry layer: the HTTP client's retry inside the body, Celery's
``autoretry_for`` and the agent calling the tool again all carry the same key. The body
forwards the key (and the fencing token) to the provider, which honours them: that is what
keeps a retry after "timed out, but the provider had committed" from charging twice.
"""

from __future__ import annotations

from typing import Any

from celery_idem import IdempotentTask

from .celery_app import app, setting
from .payments import ProviderClient

#: Errors that mean "the effect may not have happened": retried by Celery (and, for
#: IdempotentTask, they release the claim so the retry runs the body again).
RETRY_ON = (TimeoutError, ConnectionError)
#: Celery's retry layer, the same for the naive tools.
RETRY = {"autoretry_for": RETRY_ON, "retry_backoff": False, "default_retry_delay": 0.2,
         "max_retries": 3}


def provider() -> ProviderClient:
    """The HTTP client: 1.5 s timeout, one retry with the same headers (retry layer 1)."""
    return ProviderClient(setting("EXAMPLE_PAYMENTS_URL"), timeout=1.5, retries=1)


@app.task(base=IdempotentTask, bind=True, name="shop.charge_card",
          idempotency_fields=("order_id", "amount_cents"), **RETRY)
def charge_card(self: IdempotentTask, order_id: str, amount_cents: int, currency: str = "usd") -> Any:
    """Charge the order's card once."""
    return provider().charge(order_id, amount_cents, currency,
                             idempotency_key=self.idempotency_key,
                             fencing_token=self.idempotency_token)


@app.task(base=IdempotentTask, bind=True, name="shop.send_email",
          idempotency_fields=("to", "template", "order_id"), **RETRY)
def send_email(self: IdempotentTask, to: str, template: str, order_id: str) -> Any:
    """Send one e-mail per (recipient, template, order)."""
    return provider().send_email(to, template, order_id,
                                 idempotency_key=self.idempotency_key,
                                 fencing_token=self.idempotency_token)


@app.task(base=IdempotentTask, bind=True, name="shop.create_shipment",
          idempotency_fields=("order_id",), **RETRY)
def create_shipment(self: IdempotentTask, order_id: str, address: str) -> Any:
    """Create the order's shipment once (the order id alone names it)."""
    return provider().create_shipment(order_id, address,
                                      idempotency_key=self.idempotency_key,
                                      fencing_token=self.idempotency_token)


@app.task(name="shop.ping")
def ping() -> str:
    """No effect: the demo checks with it that a worker consumes the queue."""
    return "pong"
