"""The Celery app the integration tests run in real ``celery worker`` processes.

Configured from the environment so every test gets its own queue, key prefix and ledger:
``IDEM_BROKER``, ``IDEM_BACKEND``, ``IDEM_STORE`` (default: the backend), ``IDEM_PREFIX``,
``IDEM_QUEUE``, ``IDEM_LEDGER`` (a Redis URL where bodies count their effects).

Every body appends to the ledger list ``<prefix>ledger:<name>`` *before* it returns, so the
ledger counts executions of the side effect, independently of the store under test.
"""

from __future__ import annotations

import os
import time

import redis
from celery import Celery

from celery_idem import IdempotentTask, TerminalError

PREFIX = os.environ.get("IDEM_PREFIX", "itest:")
app = Celery("itest", broker=os.environ.get("IDEM_BROKER", "redis://127.0.0.1:6379/0"),
             backend=os.environ.get("IDEM_BACKEND", "redis://127.0.0.1:6379/0"))
app.conf.update(
    task_default_queue=os.environ.get("IDEM_QUEUE", "itest"),
    idempotency_key_prefix=PREFIX,
    result_expires=600,
    broker_connection_retry_on_startup=True,
    worker_prefetch_multiplier=1,
    # Fast crash recovery for the SIGKILL tests (see celery-behaviour.md, finding 8).
    broker_transport_options={
        "visibility_timeout": float(os.environ.get("IDEM_VISIBILITY", "3600")),
        "unacked_restore_interval": 1,
        "unacked_restore_throttle": 1,
    },
)
if os.environ.get("IDEM_STORE"):
    app.conf.idempotency_store = os.environ["IDEM_STORE"]

_ledger = redis.Redis.from_url(os.environ.get("IDEM_LEDGER", "redis://127.0.0.1:6379/0"))


def effect(name: str, value: object = 1) -> int:
    """Commit one side effect to the ledger; returns how many there are now."""
    return int(_ledger.rpush(f"{PREFIX}ledger:{name}", str(value)))


def flag(name: str) -> bool:
    return bool(_ledger.exists(f"{PREFIX}flag:{name}"))


@app.task(base=IdempotentTask, bind=True, idempotency_fields=("order_id", "amount_cents"))
def charge(self, order_id, amount_cents, note="", hold=0.0):
    """Charge once; ``hold`` keeps the body running (to test leases and concurrency)."""
    deadline = time.monotonic() + hold
    while time.monotonic() < deadline and not flag(f"release:{order_id}"):
        time.sleep(0.02)
    n = effect(f"charge:{order_id}", self.request.id)
    return {"order_id": order_id, "charged": amount_cents, "effects": n,
            "token": self.idempotency_token, "key": self.idempotency_key}


@app.task(base=IdempotentTask, bind=True, autoretry_for=(TimeoutError,),
          retry_backoff=False, default_retry_delay=0, max_retries=5,
          idempotency_fields=("order_id",))
def flaky(self, order_id, fail_times=2):
    """Times out ``fail_times`` times before the effect (nothing committed), then succeeds."""
    attempts = effect(f"attempt:{order_id}")
    if attempts <= fail_times:
        raise TimeoutError(f"provider timed out (attempt {attempts})")
    effect(f"charge:{order_id}")
    return {"order_id": order_id, "attempts": attempts, "retries": self.request.retries}


@app.task(base=IdempotentTask, bind=True, idempotency_fields=("order_id",))
def declined(self, order_id):
    effect(f"charge:{order_id}")
    raise TerminalError(f"card declined for {order_id}")


@app.task(base=IdempotentTask, bind=True, idempotency_validate=True)
def validated(self, order_id, amount_cents):
    effect(f"charge:{order_id}")
    return amount_cents


@app.task(base=IdempotentTask, bind=True, idempotency_fields=("order_id",))
def add_step(self, total, order_id):
    """A canvas step: adds one to ``total``."""
    effect(f"step:{order_id}")
    return total + 1


@app.task
def plain(order_id):
    """A plain Celery task (for comparisons)."""
    effect(f"plain:{order_id}")
    return order_id


@app.task(base=IdempotentTask, bind=True, idempotency_fields=("order_id",), idempotency_lease=2,
          idempotency_wait=15)
def slow_charge(self, order_id, marker, hold):
    """Writes its pid to ``marker``, then runs up to ``hold`` s (or until released), then charges."""
    with open(marker, "a") as fh:
        fh.write(f"{os.getpid()}\n")
    deadline = time.monotonic() + hold
    while time.monotonic() < deadline and not flag(f"release:{order_id}"):
        time.sleep(0.02)
    effect(f"charge:{order_id}", self.request.id)
    return {"order_id": order_id, "token": self.idempotency_token, "pid": os.getpid(),
            "redelivered": bool((self.request.delivery_info or {}).get("redelivered"))}


@app.task(base=IdempotentTask, bind=True)
def summarize(self, results):
    """A chord body: keyed by its input, like any other IdempotentTask."""
    effect("summary")
    return sorted(r["order_id"] for r in results)


@app.task(base=IdempotentTask, bind=True, idempotency_fields=("order_id",))
def manual_retry(self, order_id):
    """Calls ``self.retry()`` itself once; the retry must carry the same key."""
    effect(f"attempt:{order_id}", self.idempotency_key)
    if self.request.retries == 0:
        raise self.retry(countdown=0)
    effect(f"charge:{order_id}")
    return {"key": self.idempotency_key, "token": self.idempotency_token}


@app.task(base=IdempotentTask, bind=True, idempotency_fields=("order_id",),
          idempotency_record_timeout=2)
def hold_then_charge(self, order_id, hold=30.0):
    """Holds until released (so a test can break the store), then charges."""
    effect(f"started:{order_id}")
    deadline = time.monotonic() + hold
    while time.monotonic() < deadline and not flag(f"release:{order_id}"):
        time.sleep(0.02)
    effect(f"charge:{order_id}")
    return order_id


@app.task(base=IdempotentTask, bind=True, idempotency_fields=("order_id",), idempotency_wait=0.3,
          max_retries=0)
def impatient(self, order_id, hold=0.0):
    """Waits only 0.3 s for a busy key, and may not retry at all (max_retries=0)."""
    deadline = time.monotonic() + hold
    while time.monotonic() < deadline and not flag(f"release:{order_id}"):
        time.sleep(0.02)
    effect(f"charge:{order_id}", self.request.id)
    return {"order_id": order_id, "ran_in": self.request.id}
