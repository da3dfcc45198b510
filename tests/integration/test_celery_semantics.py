"""Celery's documented call paths work on an IdempotentTask in real workers.

Each test runs the IdempotentTask and its plain Celery twin (tests/integration/semantics_app.py)
side by side in a real prefork ``celery worker``: the plain task is the reference.
"""

from __future__ import annotations

import base64

import celery
import pytest

from celery_idem.keys import key_from_fields
from tests.integration import semantics_app as tasks
from tests.integration.conftest import Cluster
from tests.integration.harness import wait_for

pytestmark = pytest.mark.worker

APP = "tests.integration.semantics_app"
CELERY = tuple(int(part) for part in celery.__version__.split(".")[:2])


def _b64(blob: bytes) -> str:
    return base64.b64encode(blob).decode("ascii")


def test_bytes_arguments_are_sent_keyed_and_run_once(cluster: Cluster) -> None:
    cluster.worker(app=APP)
    blob = b"\x00\xff\xfe"  # not UTF-8: kombu's JSON sends it as base64
    # When bytes are passed to delay(), twice, the second time as a bytearray
    first = tasks.echo_bytes.delay(blob, "d1")
    assert first.get(timeout=30) == 3
    again = tasks.echo_bytes.delay(bytearray(blob), "d1")
    # Then both resolve to the one run (the second from the record, nothing published)
    assert again.get(timeout=30) == 3 and again.id == first.id
    assert cluster.effects("echo:d1") == [_b64(blob)]


def test_a_callback_sent_by_the_worker_with_a_bytes_argument_runs(cluster: Cluster) -> None:
    cluster.worker(app=APP)
    # When a parent's bytes result is passed to a callback (the worker publishes the callback)
    tasks.make_bytes.apply_async(("cb-plain",), link=tasks.plain_echo_bytes.s("cb-plain"))
    tasks.make_bytes.apply_async(("cb-idem",), link=tasks.echo_bytes.s("cb-idem"))
    # Then the IdempotentTask callback runs, as the plain one does
    for tag in ("cb-plain", "cb-idem"):
        expected = [_b64(b"\x00\xff" + tag.encode())]
        assert wait_for(lambda tag=tag: cluster.effects(f"echo:{tag}"), timeout=30,
                        what=f"the {tag} callback") == expected


@pytest.mark.skipif(CELERY < (5, 7), reason="Celery < 5.7 runs no old-style errback with keyword "
                    "arguments: the plain twin's does not run either (measured with make test-compat)")
def test_an_errback_sent_by_the_worker_with_a_bytes_argument_runs(cluster: Cluster) -> None:
    cluster.worker(app=APP)
    blob = b"\x00\xff"
    # When a task fails and its old-style errback (task_id first) carries bytes
    failed_plain = tasks.failing.apply_async(
        ("eb-plain",), link_error=tasks.plain_bytes_errback.s(blob=blob, tag="eb-plain"))
    failed_idem = tasks.failing.apply_async(
        ("eb-idem",), link_error=tasks.bytes_errback.s(blob=blob, tag="eb-idem"))
    # Then the worker publishes it and it runs, with the failed task id, as the plain one does
    for tag, failed in (("eb-plain", failed_plain), ("eb-idem", failed_idem)):
        assert wait_for(lambda tag=tag: cluster.effects(f"errback:{tag}"), timeout=30,
                        what=f"the {tag} errback") == [f"{failed.id}:{_b64(blob)}"]


def test_a_new_style_errback_runs_with_the_failed_request(cluster: Cluster) -> None:
    cluster.worker(app=APP)
    # When a task fails and Celery calls its new-style errbacks, errback(request, exc, traceback)
    failed = tasks.failing.apply_async(
        ("ns-1",), link_error=[tasks.plain_on_error.s(tag="plain"), tasks.on_error.s(tag="idem")])
    with pytest.raises(Exception, match="declined ns-1"):
        failed.get(timeout=30)
    # Then the IdempotentTask errback runs, with the failed request and exception, like the
    # plain one, under a key of its own (the failed task's id)
    assert wait_for(lambda: cluster.effects("on_error:plain"), timeout=30,
                    what="the plain errback") == [f"{failed.id}|TerminalError"]
    [seen] = wait_for(lambda: cluster.effects("on_error:idem"), timeout=30,
                      what="the IdempotentTask errback")
    assert seen == "|".join((failed.id, "TerminalError", key_from_fields(tasks.on_error.name, {
        "request": failed.id, "exc": None, "traceback": None, "tag": "idem", "$errback": True})))


@pytest.mark.skipif(CELERY < (5, 7), reason="Celery < 5.7 does not dump pydantic arguments at "
                    "enqueue: plain Celery's delay(model) fails to encode too")
def test_a_pydantic_model_argument_is_sent_and_a_worker_derives_the_same_key(
    cluster: Cluster,
) -> None:
    cluster.worker(app=APP)
    order = tasks.Order(order_id="py-1", amount_cents=4200)
    sent = order.model_dump(mode="json")
    # When the model is passed to delay() (plain Celery as the reference)
    plain = tasks.plain_place_order.delay(tasks.Order(order_id="py-plain", amount_cents=1))
    assert plain.get(timeout=30) == {"type": "Order", "amount_cents": 1}
    first = tasks.place_order.delay(order)
    out = first.get(timeout=30)
    # Then the body gets the model and the key is the dict's key
    assert out == {"key": tasks.place_order.idempotency_key_for((sent,)), "type": "Order",
                   "amount_cents": 4200}
    # And a producer that sends the dict by name, with no key header, is the same action
    by_name = cluster.app.send_task(tasks.place_order.name, args=[sent])
    assert by_name.get(timeout=30) == out
    assert cluster.effects("order:py-1") == [first.id]


def test_typing_false_sends_what_celery_sends(cluster: Cluster) -> None:
    cluster.env["IDEM_SEMANTICS_WORKER"] = "1"  # the worker has the newer signature
    cluster.worker(app=APP)
    # When the producer's (older) signature does not bind the call, plain Celery sends it
    plain = tasks.plain_evolving.delay("ev-plain", 500)
    assert plain.get(timeout=30) == {"order_id": "ev-plain", "amount_cents": 500}
    # Then so does the IdempotentTask, the worker runs it, and the same call is one action
    first = tasks.evolving.delay("ev-1", 500)
    assert first.get(timeout=30) == {"order_id": "ev-1", "amount_cents": 500}
    again = tasks.evolving.delay("ev-1", 500)
    assert again.get(timeout=30) == first.get() and again.id == first.id
    assert len(cluster.effects("evolving:ev-1")) == 1
    # And a call that binds nowhere fails on the worker, as with plain Celery, not at delay()
    for task in (tasks.plain_loose, tasks.loose):
        res = task.delay("lo-1", "extra")
        with pytest.raises(TypeError, match="positional argument"):
            res.get(timeout=30)
    assert cluster.effects("loose:lo-1") == []
