"""Tasks for tests/integration/test_celery_semantics.py: Celery's own call paths.

Registered on the integration app (``tests.integration.app``), so workers run with
``-A tests.integration.semantics_app``. Each IdempotentTask has a plain Celery twin
(``plain_*``), the reference for what Celery does.
"""

from __future__ import annotations

import base64
import os
from typing import Any

import pydantic

from celery_idem import IdempotentTask, TerminalError
from tests.integration.app import app, effect

__all__ = ["app"]

#: Set in the workers' environment only: the worker knows a newer signature of ``evolving``
#: than the producer (a rolling deploy), which is what ``typing=False`` is for.
WORKER_SIDE = bool(os.environ.get("IDEM_SEMANTICS_WORKER"))


def _b64(blob: bytes) -> str:
    return base64.b64encode(blob).decode("ascii")


# -- bytes (point 2) ---------------------------------------------------------------------------

@app.task
def make_bytes(tag: str) -> bytes:
    """A parent whose result (bytes, not UTF-8) goes to a callback."""
    return b"\x00\xff" + tag.encode()


@app.task(base=IdempotentTask)
def echo_bytes(blob: bytes, tag: str) -> int:
    effect(f"echo:{tag}", _b64(blob))
    return len(blob)


@app.task
def plain_echo_bytes(blob: bytes, tag: str) -> int:
    effect(f"echo:{tag}", _b64(blob))
    return len(blob)


@app.task(base=IdempotentTask)
def bytes_errback(task_id: str, blob: bytes = b"", tag: str = "") -> str:
    """An old-style errback (one argument left: the failed task id), published by the worker."""
    effect(f"errback:{tag}", f"{task_id}:{_b64(blob)}")
    return task_id


@app.task
def plain_bytes_errback(task_id: str, blob: bytes = b"", tag: str = "") -> str:
    effect(f"errback:{tag}", f"{task_id}:{_b64(blob)}")
    return task_id


# -- new-style errbacks (point 3) --------------------------------------------------------------

@app.task(base=IdempotentTask, idempotency_fields=("tag",))
def failing(tag: str) -> None:
    raise TerminalError(f"declined {tag}")


@app.task(base=IdempotentTask)
def on_error(request: Any, exc: BaseException, traceback: Any, tag: str = "") -> str:
    """Celery calls it as ``on_error(request, exc, traceback)``, in the failed task's worker."""
    from celery import current_task

    effect(f"on_error:{tag}", f"{request.id}|{type(exc).__name__}|{current_task.idempotency_key}")
    return "handled"


@app.task
def plain_on_error(request: Any, exc: BaseException, traceback: Any, tag: str = "") -> str:
    effect(f"on_error:{tag}", f"{request.id}|{type(exc).__name__}")
    return "handled"


# -- pydantic=True (point 6) -------------------------------------------------------------------

class Order(pydantic.BaseModel):
    order_id: str
    amount_cents: int
    note: str = ""


@app.task(base=IdempotentTask, bind=True, pydantic=True)
def place_order(self: Any, order: Order) -> dict[str, Any]:
    effect(f"order:{order.order_id}", self.request.id)
    return {"key": self.idempotency_key, "type": type(order).__name__,
            "amount_cents": order.amount_cents}


@app.task(bind=True, pydantic=True)
def plain_place_order(self: Any, order: Order) -> dict[str, Any]:
    effect(f"order:{order.order_id}", self.request.id)
    return {"type": type(order).__name__, "amount_cents": order.amount_cents}


# -- typing=False (point 7) --------------------------------------------------------------------

if WORKER_SIDE:
    @app.task(base=IdempotentTask, typing=False, name="tests.integration.semantics_app.evolving")
    def evolving(order_id: str, amount_cents: int = 0) -> dict[str, Any]:
        """The worker's (newer) signature."""
        effect(f"evolving:{order_id}")
        return {"order_id": order_id, "amount_cents": amount_cents}

    @app.task(typing=False, name="tests.integration.semantics_app.plain_evolving")
    def plain_evolving(order_id: str, amount_cents: int = 0) -> dict[str, Any]:
        effect(f"evolving:{order_id}")
        return {"order_id": order_id, "amount_cents": amount_cents}
else:
    @app.task(base=IdempotentTask, typing=False, name="tests.integration.semantics_app.evolving")
    def evolving(order_id: str) -> dict[str, Any]:  # type: ignore[misc]
        """The producer's (older) signature: typing=False lets it send the newer call."""
        raise AssertionError("runs on the worker only")

    @app.task(typing=False, name="tests.integration.semantics_app.plain_evolving")
    def plain_evolving(order_id: str) -> dict[str, Any]:  # type: ignore[misc]
        raise AssertionError("runs on the worker only")


@app.task(base=IdempotentTask, typing=False)
def loose(order_id: str) -> str:
    effect(f"loose:{order_id}")
    return order_id


@app.task(typing=False)
def plain_loose(order_id: str) -> str:
    effect(f"loose:{order_id}")
    return order_id
