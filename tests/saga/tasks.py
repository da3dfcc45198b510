"""The checkout saga in the integration app's workers (``-I tests.saga.tasks``), with crash points.

``saga_test.checkout`` runs the example's saga body (``example_app.saga.run_checkout``) with a
checkpoint that SIGKILLs the worker child the first time (across every process) the saga reaches
one of the test's points. Importing ``example_app.saga`` also registers the example's own
``shop.checkout`` (a ``shared_task``) on this app.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Sequence
from typing import Any

from celery_idem import IdempotentTask
from celery_idem.contrib.saga import Saga
from example_app.saga import run_checkout
from tests.integration.app import PREFIX, _ledger, app


def crash_points(order_id: str, kills: Sequence[str]) -> Callable[[str], None]:
    """A checkpoint that logs each point reached and SIGKILLs this process once per kill point."""
    kills = set(kills)

    def checkpoint(point: str) -> None:
        _ledger.rpush(f"{PREFIX}points:{order_id}", f"{point} {os.getpid()}")
        if point in kills and _ledger.set(f"{PREFIX}killed:{order_id}:{point}", 1, nx=True, ex=600):
            os.kill(os.getpid(), signal.SIGKILL)

    return checkpoint


@app.task(base=IdempotentTask, bind=True, name="saga_test.checkout",
          idempotency_fields=("order_id",), idempotency_lease=2, idempotency_wait=10)
def checkout(self: IdempotentTask, order_id: str, amount_cents: int, email: str, sku: str,
             kills: Sequence[str] = ()) -> Any:
    """The example's checkout saga with a 2 s lease, and SIGKILLs at ``kills``."""
    return run_checkout(Saga(self), order_id, amount_cents, email, sku,
                        checkpoint=crash_points(order_id, kills))
