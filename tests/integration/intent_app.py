"""The integration app plus a task whose enqueue keeps an intent (``idempotency_intent``).

Workers and relays run it with ``celery -A tests.integration.intent_app``; the tasks of
tests/integration/app.py are registered too (the same app object). More environment than
app.py reads:

* ``IDEM_INTENTS``: ``0`` defines the task without ``idempotency_intent`` and sets none of the
  relay settings: the control run of tests/integration/test_intents*.py, in which the lost
  actions stay lost (``IDEM_INTENTS=0 pytest tests/integration/test_intents.py`` fails);
* ``IDEM_RELAY_AFTER`` (default 2 s), ``IDEM_RELAY_INTERVAL`` (default 0.2 s);
* ``IDEM_RELAY``: ``0`` starts no relay thread in the workers (a test runs its own relays).

Each run of the body appends ``<action> <task id> <time.time()>`` to the ledger list
``<prefix>ledger:intended``: one list for every action, so a test of thousands reads it at once.
"""

from __future__ import annotations

import os
import time
from typing import Any

from celery_idem import IdempotentTask
from tests.integration.app import _ledger, app, flag

__all__ = ["INTENTS", "LEDGER", "RELAY_AFTER", "RELAY_INTERVAL", "app", "intended"]

INTENTS = os.environ.get("IDEM_INTENTS", "1") != "0"
RELAY_AFTER = float(os.environ.get("IDEM_RELAY_AFTER", "2"))
RELAY_INTERVAL = float(os.environ.get("IDEM_RELAY_INTERVAL", "0.2"))
#: The ledger list's name after the key prefix.
LEDGER = "ledger:intended"

if INTENTS:
    app.conf.update(
        idempotency_relay_after=RELAY_AFTER,
        idempotency_relay_interval=RELAY_INTERVAL,
        idempotency_relay=os.environ.get("IDEM_RELAY", "1") != "0",
    )

_INTENT: dict[str, Any] = {"idempotency_intent": True} if INTENTS else {}


@app.task(base=IdempotentTask, bind=True, idempotency_fields=("action",), idempotency_lease=3,
          **_INTENT)
def intended(self, action, hold=0.0, marker=""):  # type: ignore[no-untyped-def]
    """Writes its pid to ``marker`` (if given), holds up to ``hold`` s (or until the flag
    ``release:<action>``), then commits one effect to the ledger."""
    if marker:  # the pid first, so a test can kill the process running the body
        with open(marker, "a") as fh:
            fh.write(f"{os.getpid()}\n")
    deadline = time.monotonic() + hold
    while time.monotonic() < deadline and not flag(f"release:{action}"):
        time.sleep(0.02)
    prefix = os.environ.get("IDEM_PREFIX", "itest:")
    _ledger.rpush(f"{prefix}{LEDGER}", f"{action} {self.request.id} {time.time():.3f}")
    return {"action": action, "task_id": self.request.id, "pid": os.getpid()}
