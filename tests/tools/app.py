"""The Celery app the tool tests run in a real ``celery worker`` (threads pool).

Configured from the environment so each test module gets its own queue, key prefix and ledger:
``TOOLS_REDIS`` (broker, backend, store and ledger), ``TOOLS_PREFIX``, ``TOOLS_QUEUE``. Every
body appends to the ledger list ``<prefix>ledger:<name>`` before it returns, so the ledger
counts executions of the effect, independently of the store.
"""

from __future__ import annotations

import datetime as dt
import enum
import os
import time
import uuid
from collections.abc import Mapping, Sequence
from decimal import Decimal
from typing import Annotated, Any, Literal, Optional, Union

import redis
from celery import Celery

from celery_idem import IdempotentTask, TerminalError
from celery_idem.contrib.tools import Toolbox, tool

REDIS = os.environ.get("TOOLS_REDIS", "redis://127.0.0.1:6379/0")
PREFIX = os.environ.get("TOOLS_PREFIX", "tools-test:")
app = Celery("toolstest", broker=REDIS, backend=REDIS)
app.conf.update(
    task_default_queue=os.environ.get("TOOLS_QUEUE", "tools-test"),
    idempotency_key_prefix=PREFIX,
    result_expires=600,
    broker_connection_retry_on_startup=True,
    worker_prefetch_multiplier=1,
)

_ledger = redis.Redis.from_url(REDIS)


def effect(name: str, value: object = 1) -> int:
    """Commit one side effect to the ledger; returns how many there are now."""
    return int(_ledger.rpush(f"{app.conf.idempotency_key_prefix}ledger:{name}", str(value)))


def released(name: str) -> bool:
    return bool(_ledger.exists(f"{app.conf.idempotency_key_prefix}flag:{name}"))


@app.task(base=IdempotentTask, bind=True, idempotency_fields=("order_id", "amount_cents"))
def charge_card(self: IdempotentTask, order_id: str, amount_cents: int,
                currency: Literal["usd", "eur"] = "usd", hold: bool = False) -> dict[str, Any]:
    """Charge the customer's card for an order.

    Args:
        order_id: The shop's order id.
        amount_cents: The amount, in cents.
        currency: ISO currency code.
        hold: Test hook: keep running until the test releases the order.
    """
    deadline = time.monotonic() + 120
    while hold and not released(order_id) and time.monotonic() < deadline:
        time.sleep(0.02)
    n = effect(f"charge:{order_id}", self.request.id)
    return {"charge_id": f"ch_{order_id}_{amount_cents}", "amount_cents": amount_cents,
            "currency": currency, "effects": n}


@app.task(base=IdempotentTask, bind=True)
def refund(self: IdempotentTask, charge_id: str) -> dict[str, Any]:
    """Refund a charge."""
    effect(f"refund:{charge_id}")
    raise TerminalError(f"charge {charge_id} was already refunded")


@app.task(base=IdempotentTask, bind=True)
def cancel_order(self: IdempotentTask, order_id: str) -> None:
    """Cancel an order."""
    effect(f"cancel:{order_id}")
    raise RuntimeError(f"order service answered 500 for {order_id}\n  at line 3 of handler.py")


@app.task(base=IdempotentTask, bind=True, idempotency_fields=("order_id",),
          idempotency_validate=True)
def create_shipment(self: IdempotentTask, order_id: str, address: str) -> dict[str, Any]:
    """Create the shipment of an order (the order id alone names it)."""
    effect(f"shipment:{order_id}")
    return {"shipment_id": f"sh_{order_id}", "address": address}


@app.task(base=IdempotentTask, bind=True)
def sync_ledger(self: IdempotentTask, account: str) -> None:
    """Sync an account's ledger (fails with a secret in its error text)."""
    effect(f"sync:{account}")
    raise RuntimeError("db connect failed: postgresql://admin:hunter2@db.internal/prod "
                       f"(arg=sk_live_51Hx{account})")


class CardDeclined(Exception):
    """A decline whose text is meant for the customer (shown when the tool exposes it)."""


class QuotaExceeded(Exception):
    """An error marked safe to show to a model by its class."""

    expose_to_model = True


@app.task(base=IdempotentTask, bind=True)
def charge_declined(self: IdempotentTask, order_id: str) -> None:
    """Charge a card that is declined."""
    effect(f"declined:{order_id}")
    raise CardDeclined(f"card ending 4242 declined for {order_id}: insufficient funds")


@app.task(base=IdempotentTask, bind=True)
def over_quota(self: IdempotentTask, order_id: str) -> None:
    """Call a provider whose quota is used up."""
    effect(f"quota:{order_id}")
    raise QuotaExceeded(f"daily quota of 100 calls used up ({order_id})")


@app.task
def stock_level(sku: str) -> dict[str, Any]:
    """How many items of a product are in stock (a read: no effect)."""
    n = effect(f"stock:{sku}")
    return {"sku": sku, "in_stock": 7, "lookups": n}


class Speed(enum.Enum):
    STANDARD = "standard"
    EXPRESS = "express"


class Priority(enum.IntEnum):
    LOW = 1
    HIGH = 2


@app.task(base=IdempotentTask, bind=True)
def echo_types(
    self: IdempotentTask, text: str, count: int, ratio: float, flag: bool, nothing: None,
    numbers: list[int], tags: set[str], pair: tuple[int, str], many: tuple[float, ...],
    names: Sequence[str], scores: dict[str, int], weights: Mapping[str, float],
    maybe: Optional[int], either: Union[int, str], size: Literal["s", "m", "l"],  # noqa: UP007, UP045
    speed: Speed, priority: Priority, note: Annotated[str, "a free note"], when: dt.datetime,
    day: dt.date, at: dt.time, ref: uuid.UUID, price: Decimal, anything: Any, untyped,
    rows: list[dict[str, int]], optional_default: int | None = None,
) -> dict[str, Any]:
    """Return every argument as the body received it, with its Python type's name."""
    values = {k: v for k, v in locals().items() if k != "self"}
    effect("echo")
    return {"values": values, "types": {k: type(v).__name__ for k, v in values.items()}}


def _toolbox() -> Toolbox:
    """The tools the MCP tests serve: ``celery -A tests.tools.app idem mcp --toolbox
    tests.tools.app:toolbox``. ``charge_card_quick`` is the same action with a short wait, so a
    client can give up waiting on a held body and call again."""
    wait = 60.0  # generous for a loaded machine; it never delays a passing test
    return Toolbox([
        tool(charge_card, timeout=wait, destructive=False, title="Charge a card"),
        tool(charge_card, name="charge_card_quick", timeout=0.5, destructive=False),
        tool(refund, timeout=wait),
        tool(stock_level, kind="read", timeout=wait, open_world=False),
        tool(charge_with_key, timeout=wait, key_argument="request_key", destructive=False),
        tool(echo_types, timeout=wait, open_world=False, untyped=True),
        tool(sync_ledger, timeout=wait, open_world=False),
    ])


@app.task(base=IdempotentTask, bind=True, idempotency_fields=("order_id", "amount_cents"))
def charge_untyped(self, order_id, amount_cents, note=""):
    """The README's ``charge_card``: no type hints (a tool needs ``untyped=True``)."""
    if amount_cents > 100_000:  # a model's "4200" would fail here: str > int
        raise TerminalError("card declined")
    return {"charged": amount_cents, "effects": effect(f"untyped:{order_id}", self.request.id)}


@app.task(base=IdempotentTask, bind=True)
def charge_with_key(self: IdempotentTask, order_id: str, amount_cents: int) -> dict[str, Any]:
    """Charge a card under the caller's own key (``request_key``, used verbatim)."""
    n = effect(f"keyed:{order_id}", self.idempotency_key)
    return {"order_id": order_id, "amount_cents": amount_cents, "key": self.idempotency_key,
            "effects": n}


@app.task(base=IdempotentTask, bind=True, idempotency_check_on_enqueue=False)
def charge_with_key_late(self: IdempotentTask, order_id: str, amount_cents: int) -> dict[str, Any]:
    """``charge_with_key`` with no check at enqueue: a reused key is refused by the worker."""
    n = effect(f"keyed:{order_id}", self.idempotency_key)
    return {"order_id": order_id, "amount_cents": amount_cents, "key": self.idempotency_key,
            "effects": n}


toolbox = _toolbox()


@app.task(base=IdempotentTask, bind=True)
def whoami(self: IdempotentTask, order_id: str) -> dict[str, Any]:
    """Who asked, and in which scope, as the body sees it."""
    effect(f"whoami:{order_id}", self.idempotency_scope)
    return {"principal": self.idempotency_principal, "scope": self.idempotency_scope}


@app.task(base=IdempotentTask, bind=True)
def place_order(self: IdempotentTask, order_id: str) -> dict[str, Any]:
    """Enqueue ``whoami`` from the body: the child runs in this call's scope, for its caller."""
    child = whoami.apply_async((order_id,))
    return {"principal": self.idempotency_principal, "scope": self.idempotency_scope,
            "child_id": child.id}
