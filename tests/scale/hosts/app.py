"""The many-hosts test's task, on the integration app (``celery -A tests.scale.hosts.app``).

``fenced_effect`` works for ``hold`` seconds, then commits one effect to the PostgreSQL ledger
(``IDEM_PG_URL``, tables ``<IDEM_PG_LEDGER>_*``) the way docs/concepts.md tells a body to write
to a system that may see a stale holder: with its fencing token, which that system refuses
unless it is higher than every token it has seen for the action (table ``_fence``). Every call
is logged in ``_calls`` (tag = the host it ran on), applied or refused; only applied calls add
a row to ``_ledger``.

The body does not look at ``idempotency_lease_lost`` on purpose: a stale holder that finishes
its work after a partition is the case the token is for.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

from celery.signals import worker_process_init

from celery_idem import IdempotentTask
from tests.integration.app import _pg, app

__all__ = ["app", "fenced_effect"]

_TABLES = os.environ.get("IDEM_PG_LEDGER", "")


@worker_process_init.connect(weak=False)  # type: ignore[untyped-decorator]
def _connect_ledger(**_: Any) -> None:
    """Each pool process opens its ledger connection at start, like a pooled connection, so
    a cut finds it established (a connection being opened during a black hole fails)."""
    if _TABLES:
        _pg()


@app.task(base=IdempotentTask, bind=True, idempotency_fields=("action",), idempotency_lease=3,
          idempotency_wait=5)
def fenced_effect(self: Any, action: str, hold: float = 0.0) -> dict[str, Any]:
    """Work ``hold`` seconds (no I/O), then commit the effect fenced by the token.

    On a worker started with ``SCALE_WORK_UNTIL=<path>`` the work also lasts until that file
    exists (at most 120 s): the test makes it when the partition has healed, so this host's
    bodies outlast the partition, whatever the machine's speed.
    """
    time.sleep(hold)
    until = os.environ.get("SCALE_WORK_UNTIL")
    deadline = time.monotonic() + 120
    while until and not os.path.exists(until) and time.monotonic() < deadline:
        time.sleep(0.05)
    conn = _pg()
    token, req = self.idempotency_token, self.request
    meta = (action, self.idempotency_key, token, req.id, req.retries or 0, os.getpid())
    with conn.transaction():
        applied = conn.execute(
            f"INSERT INTO {_TABLES}_fence (action, token) VALUES (%s, %s) "
            f"ON CONFLICT (action) DO UPDATE SET token = EXCLUDED.token "
            f"WHERE {_TABLES}_fence.token < EXCLUDED.token RETURNING 1", (action, token),
        ).fetchone() is not None
        conn.execute(
            f"INSERT INTO {_TABLES}_calls (action, idem_key, token, task_id, retries, pid, "
            f"applied, tag) VALUES (%s, %s, %s, %s, %s, %s, %s, %s)",
            (*meta, applied, socket.gethostname()),
        )
        if applied:
            conn.execute(
                f"INSERT INTO {_TABLES}_ledger (action, idem_key, token, task_id, retries, pid) "
                f"VALUES (%s, %s, %s, %s, %s, %s)", meta,
            )
    return {"action": action, "token": token, "host": socket.gethostname(), "applied": applied,
            "task_id": req.id}
