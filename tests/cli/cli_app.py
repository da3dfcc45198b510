"""The integration app (tests/integration/app.py) with the settings some CLI tests change.

``celery -A tests.cli.cli_app idem ...`` is ``-A tests.integration.app`` plus, from the
environment: ``IDEM_ACCEPT`` (comma-separated ``accept_content`` and ``result_accept_content``,
e.g. ``json,pickle``), ``IDEM_EVENTS=1`` (``idempotency_events = True``) and
``IDEM_NO_INTENTS=1`` (a Redis store that keeps no intents). It also defines
two tasks of its own, for tests/cli/test_lease_status.py (run by ``-A tests.cli.cli_app``).
"""

from __future__ import annotations

import os
import time

from celery_idem import IdempotentTask
from tests.integration.app import app, effect, flag

__all__ = ["HELD_LEASE", "app", "fails_unclassified", "long_body", "long_lease"]

if os.environ.get("IDEM_ACCEPT"):
    accept = [name.strip() for name in os.environ["IDEM_ACCEPT"].split(",") if name.strip()]
    app.conf.accept_content = accept
    app.conf.result_accept_content = accept
if os.environ.get("IDEM_EVENTS") == "1":
    app.conf.idempotency_events = True
if os.environ.get("IDEM_NO_INTENTS") == "1":  # a third-party store without the intent verbs
    from celery_idem.stores.redis import RedisStore

    class NoIntentsStore(RedisStore):
        keeps_intents = False

    app.conf.idempotency_store = NoIntentsStore.from_url(os.environ["IDEM_STORE"],
                                                         prefix=os.environ["IDEM_PREFIX"])


# -- what `idem list` / `show` say about a claim's holder (tests/cli/test_lease_status.py) ----------


#: fails_unclassified's lease: long enough that a held claim reads "not renewed" for many
#: seconds, the time two `celery` commands take to start on a loaded machine.
HELD_LEASE = 30


@app.task(base=IdempotentTask, bind=True, idempotency_fields=("order_id",),
          idempotency_lease=HELD_LEASE)
def fails_unclassified(self, order_id):  # type: ignore[no-untyped-def]
    """Commits its effect, then raises an error the task does not classify: the claim is held
    (not renewed) until its lease runs out."""
    effect(f"action:{order_id}", self.request.id)
    raise ValueError(f"the provider answered nonsense for {order_id}")


@app.task(base=IdempotentTask, bind=True, idempotency_fields=("order_id",), idempotency_lease=600)
def long_lease(self, order_id):  # type: ignore[no-untyped-def]
    """A task with a 10 min lease: a claim of it just taken reads "live" for minutes."""
    return order_id


@app.task(base=IdempotentTask, bind=True, idempotency_fields=("order_id",), idempotency_lease=9)
def long_body(self, order_id, hold=60.0):  # type: ignore[no-untyped-def]
    """Runs up to ``hold`` s (until released), renewing its 9 s lease every 3 s, then commits."""
    deadline = time.monotonic() + hold
    while time.monotonic() < deadline and not flag(f"release:{order_id}"):
        time.sleep(0.02)
    effect(f"action:{order_id}", self.request.id)
    return order_id
