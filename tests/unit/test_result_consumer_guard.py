"""The test process's guard against celery#10477 (tests/conftest.py), on a real result consumer.

Celery < 5.7 with redis-py < 6.4: when the garbage collector finalises an ``AsyncResult`` while
the same thread holds the result consumer's ``PubSub`` lock (mid-SUBSCRIBE), its ``__del__``
cancels its subscription, waits for that lock, and the process hangs. Here the lock is held
by hand and a subscribed result is cancelled under it, as the collector does; the call must
return. Without the guard on Celery 5.4 (redis-py 5.3) it blocks and the assertion fails after
the join's deadline. On Celery 5.7 this checks Celery's own fix.
"""

from __future__ import annotations

import threading
import uuid

import pytest
from celery import Celery

DEADLINE = 10.0


def test_a_result_cancelled_while_its_consumer_holds_the_pubsub_lock_returns(redis_url: str) -> None:
    app = Celery(f"guard-{uuid.uuid4().hex[:8]}", broker="memory://", backend=redis_url,
                 set_as_current=False)
    consumer = app.backend.result_consumer
    first, held = f"first-{uuid.uuid4().hex}", f"held-{uuid.uuid4().hex}"
    consumer.start(first)  # makes the PubSub connection and subscribes
    consumer.consume_from(held)
    assert consumer._get_key_for_task(held) in consumer.subscribed_to
    returned = threading.Event()

    def cancel_mid_subscribe() -> None:
        with consumer._pubsub._lock:  # what a SUBSCRIBE in progress holds
            consumer.cancel_for(held)  # what a collected AsyncResult's __del__ calls
        returned.set()

    worker = threading.Thread(target=cancel_mid_subscribe, daemon=True)
    try:
        if not hasattr(consumer._pubsub, "_lock"):
            pytest.skip("this redis-py's PubSub has no lock (redis-py 5.2): nothing to deadlock on")
        worker.start()
        worker.join(DEADLINE)
        assert returned.is_set(), "cancel_for waited for the PubSub lock its own thread holds"
        # The consumer still works afterwards: a new subscription goes through.
        consumer.consume_from(f"after-{uuid.uuid4().hex}")
    finally:
        if not worker.is_alive():  # a worker still blocked holds the lock: stop() would block too
            consumer.stop()
        app.close()
