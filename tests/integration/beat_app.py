"""The Celery app of the periodic-task test: real ``celery beat`` processes and a real worker.

Configured from the environment, like ``app.py``: ``IDEM_BROKER``, ``IDEM_BACKEND``,
``IDEM_PREFIX``, ``IDEM_QUEUE``, ``IDEM_LEDGER``; ``IDEM_BEAT_EVERY`` (seconds between a beat's
ticks) and ``IDEM_BEAT_PERIOD`` (the tasks' ``idempotency_period``). A beat process also gets
``IDEM_BEAT_NAME``: it then appends every message it publishes to the ledger list
``<prefix>sent:<task>`` (as JSON: beat, task id, key header, time), so the test counts the sends
that reached the broker. Bodies append their key to ``<prefix>ledger:<task>``.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis
from celery import Celery
from celery.signals import after_task_publish

from celery_idem import IdempotentTask

PREFIX = os.environ.get("IDEM_PREFIX", "beattest:")
EVERY = float(os.environ.get("IDEM_BEAT_EVERY", "3"))
PERIOD = float(os.environ.get("IDEM_BEAT_PERIOD", "3"))
BEAT_NAME = os.environ.get("IDEM_BEAT_NAME")

app = Celery("beattest", broker=os.environ.get("IDEM_BROKER", "redis://127.0.0.1:6379/0"),
             backend=os.environ.get("IDEM_BACKEND", "redis://127.0.0.1:6379/0"))
app.conf.update(
    task_default_queue=os.environ.get("IDEM_QUEUE", "beattest"),
    idempotency_key_prefix=PREFIX,
    result_expires=600,
    broker_connection_retry_on_startup=True,
    worker_prefetch_multiplier=1,
    beat_schedule={
        # Both entries send at every tick of every beat process: apply_async((), {}).
        "tick": {"task": "tests.integration.beat_app.tick", "schedule": EVERY},
        "tick_checked": {"task": "tests.integration.beat_app.tick_checked", "schedule": EVERY},
    },
)

_ledger = redis.Redis.from_url(os.environ.get("IDEM_LEDGER", "redis://127.0.0.1:6379/0"))


def effect(name: str, value: object) -> int:
    return int(_ledger.rpush(f"{PREFIX}ledger:{name}", str(value)))


# Every send is published (no enqueue check): the worker's gate must answer the second beat's.
@app.task(base=IdempotentTask, bind=True, idempotency_period=PERIOD,
          idempotency_check_on_enqueue=False)
def tick(self: Any) -> str:
    effect("tick", self.idempotency_key)
    return str(self.idempotency_key)


# The default: a send of a slot already done is answered at enqueue (nothing published).
@app.task(base=IdempotentTask, bind=True, idempotency_period=PERIOD)
def tick_checked(self: Any) -> str:
    effect("tick_checked", self.idempotency_key)
    return str(self.idempotency_key)


# Sent by name (send_task) without the key header: the worker derives the key itself.
@app.task(base=IdempotentTask, bind=True, idempotency_period=PERIOD)
def by_name(self: Any) -> str:
    effect("by_name", self.idempotency_key)
    return str(self.idempotency_key)


if BEAT_NAME:

    @after_task_publish.connect(weak=False)
    def _count_send(sender: str | None = None, headers: dict[str, Any] | None = None,
                    **_: Any) -> None:
        headers = headers or {}
        task = str(sender or headers.get("task", "")).rsplit(".", 1)[-1]
        _ledger.rpush(f"{PREFIX}sent:{task}", json.dumps({
            "beat": BEAT_NAME, "id": headers.get("id"), "key": headers.get("idempotency_key"),
            "time": time.time(),
        }))


# Sent by name while another copy of its slot runs: the copy is re-queued and must keep the
# slot its message's time gave it (the key rides the re-queue, not a later clock).
@app.task(base=IdempotentTask, bind=True, idempotency_period=PERIOD)
def slow_by_name(self: Any, marker: str) -> str:
    effect("slow_by_name", self.idempotency_key)
    time.sleep(2.0)
    return str(self.idempotency_key)
