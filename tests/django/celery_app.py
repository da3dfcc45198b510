"""The Celery app of the Django worker tests, run in real ``celery worker`` processes.

Configured from the environment (set by tests/django/test_worker.py): ``DJANGO_SETTINGS_MODULE``
and the database names (:func:`tests.django.support.worker_env`), ``DJ_BROKER`` (a private
``redis-server``: broker and kill flags), ``DJ_PREFIX``, ``DJ_LEASE``, ``DJ_STORE`` (default:
none, so ``result_backend = "django-db"`` picks the store: Django's ``default`` database).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import django
import redis
from celery import Celery

django.setup()  # before the models are imported (Celery's Django fixup would do it later)

from celery_idem import IdempotentTask  # noqa: E402
from tests.django.shop.models import Order  # noqa: E402

BROKER = os.environ.get("DJ_BROKER", "redis://127.0.0.1:6379/0")
PREFIX = os.environ.get("DJ_PREFIX", "dj:")
LEASE = float(os.environ.get("DJ_LEASE", "2"))

app = Celery("djtest", broker=BROKER)
app.conf.update(
    result_backend="django-db",
    task_default_queue=os.environ.get("DJ_QUEUE", "djtest"),
    idempotency_key_prefix=PREFIX,
    broker_connection_retry_on_startup=True,
    worker_prefetch_multiplier=1,
    # Fast crash recovery (docs/shared celery-behaviour.md, finding 8).
    broker_transport_options={"visibility_timeout": 3600, "unacked_restore_interval": 1,
                              "unacked_restore_throttle": 1},
)
if os.environ.get("DJ_STORE"):
    app.conf.idempotency_store = os.environ["DJ_STORE"]

_flags = redis.Redis.from_url(BROKER)


def _row(task: Any, action: str, amount: int) -> dict[str, Any]:
    return {"action": action, "amount": amount, "task_id": task.request.id,
            "token": task.idempotency_token, "pid": os.getpid()}


@app.task(base=IdempotentTask, bind=True, idempotency_fields=("action",), idempotency_lease=LEASE)
def charge(self: IdempotentTask, action: str, amount: int) -> dict[str, Any]:
    """One Order and its receipt in one atomic; the first attempt dies right after the COMMIT."""
    row = _row(self, action, amount)
    with self.idempotent_transaction() as tx:
        Order.objects.create(**row)
        tx.result = row
    if os.environ.get("DJ_KILL_AFTER_COMMIT") == "1" and _flags.set(f"{PREFIX}killed:{action}",
                                                                    os.getpid(), nx=True):
        os.kill(os.getpid(), signal.SIGKILL)  # before the record and the ack (acks_late)
    return tx.result  # type: ignore[no-any-return]


@app.task(base=IdempotentTask, bind=True, idempotency_fields=("action",), idempotency_lease=LEASE)
def busy_charge(self: IdempotentTask, action: str, marker: str, hold: float) -> dict[str, Any]:
    """A plain ORM write (no receipt) after ``hold`` seconds of work; appends its pid to ``marker``.

    Every body that runs appends a line, so the marker counts bodies.
    """
    with Path(marker).open("a") as fh:
        fh.write(f"{os.getpid()} {self.idempotency_token}\n")
    time.sleep(hold)  # the work itself (duplicates arrive meanwhile), not a synchronisation
    row = _row(self, action, 1)
    Order.objects.create(**row)
    return row


@app.task(base=IdempotentTask, bind=True, idempotency_fields=("action",), idempotency_lease=LEASE)
def held_charge(self: IdempotentTask, action: str, marker: str) -> dict[str, Any]:
    """The first attempt writes its pid to ``marker`` and waits to be SIGKILLed (at most 60 s)."""
    first = bool(_flags.set(f"{PREFIX}held:{action}", os.getpid(), nx=True))
    # The marker after the flag: the test kills this process as soon as it reads the marker.
    with Path(marker).open("a") as fh:
        fh.write(f"{os.getpid()} {self.idempotency_token}\n")
    if first:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # the test kills this process meanwhile
            time.sleep(0.05)
    row = _row(self, action, 1)
    with self.idempotent_transaction() as tx:
        Order.objects.create(**row)
        tx.result = row
    return tx.result  # type: ignore[no-any-return]


if os.environ.get("DJ_RELAY_AFTER"):
    app.conf.idempotency_relay_after = float(os.environ["DJ_RELAY_AFTER"])
    app.conf.idempotency_relay_interval = 0.2


@app.task(base=IdempotentTask, bind=True, idempotency_fields=("action",), idempotency_intent=True)
def ship_order(self: IdempotentTask, action: str) -> bool:
    """Enqueued in the transaction that creates the action's Order (the transactional enqueue):
    notes on the broker's Redis whether the body saw that row."""
    seen = Order.objects.filter(action=action).exists()
    _flags.rpush(f"{PREFIX}shipped:{action}", f"{self.request.id}:{seen}")
    return seen
