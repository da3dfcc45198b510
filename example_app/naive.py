"""The same write tools on a plain ``celery.Task``: what most code looks like, and why it charges
twice.

Like many integrations they do send an ``Idempotency-Key``, but a fresh one per execution
(generated inside the body). That covers only the lowest retry layer, the HTTP client's own
retry, which re-sends the same headers. Celery's ``autoretry_for``, a second enqueue of the
same action and the agent calling the tool again each run the body anew, with a new key.
"""

from __future__ import annotations

import uuid
from typing import Any

from .celery_app import app
from .tasks import RETRY, provider


def _fresh_key() -> str:
    return f"naive-{uuid.uuid4()}"


@app.task(name="shop.naive.charge_card", **RETRY)
def charge_card(order_id: str, amount_cents: int, currency: str = "usd") -> Any:
    return provider().charge(order_id, amount_cents, currency, idempotency_key=_fresh_key())


@app.task(name="shop.naive.send_email", **RETRY)
def send_email(to: str, template: str, order_id: str) -> Any:
    return provider().send_email(to, template, order_id, idempotency_key=_fresh_key())


@app.task(name="shop.naive.create_shipment", **RETRY)
def create_shipment(order_id: str, address: str) -> Any:
    return provider().create_shipment(order_id, address, idempotency_key=_fresh_key())
