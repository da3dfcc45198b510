"""Tasks for the fencing tests, loaded into the integration app's workers with ``-I``.

The body claims, announces its token in a file (``claimed-<token>``, holding its pid) and on a
line of ``claims`` (the tokens in the order of the claims), waits for the test's ``go`` file,
then makes
its one remote write to the example payments provider (a separate HTTP process, URL in
``FENCE_PROVIDER_URL``), forwarding the idempotency key and the fencing token.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from celery_idem import IdempotentTask
from example_app.payments import FencedOff, ProviderClient
from tests.integration.app import app


@app.task(base=IdempotentTask, bind=True, name="fencing.charge",
          idempotency_fields=("order_id", "amount_cents"), idempotency_lease=2,
          idempotency_wait=20)
def fenced_charge(self: IdempotentTask, order_id: str, amount_cents: int, gate_dir: str) -> Any:
    """Charge once through the provider, with the key and this claim's fencing token."""
    token = self.idempotency_token
    d = Path(gate_dir)
    (d / f"claimed-{token}").write_text(str(os.getpid()))
    with (d / "claims").open("a") as claims:  # after the pid file: a listed token has one
        claims.write(f"{token}\n")
    deadline = time.monotonic() + 120  # bounded: a test that never says go fails, not hangs
    while not (d / "go").exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    client = ProviderClient(os.environ["FENCE_PROVIDER_URL"], timeout=10, retries=0)
    try:
        charge = client.charge(order_id, amount_cents, idempotency_key=self.idempotency_key,
                               fencing_token=token)
    except FencedOff as exc:
        # The remote refused the stale token. Returning lets the gate try to record with it,
        # which the store refuses too (LeaseLost): the test checks both fences.
        (d / f"fenced-{token}").write_text(str(exc.body))
        return {"fenced_off": True, "token": token}
    (d / f"charged-{token}").write_text(charge["id"])
    return {"charge": charge, "token": token, "pid": os.getpid()}
