"""Celery's own ways of calling a task keep working on an IdempotentTask.

Eager mode on the in-process ``memory://`` store; tests/integration/test_celery_semantics.py
runs the same paths in real workers. Every test builds its own app and defines its tasks with
``shared=False``.
"""

from __future__ import annotations

import datetime as dt
import decimal
from typing import Any

import celery
import pydantic
import pytest
from celery import Celery
from celery.app.task import Context

from celery_idem import IdempotentTask, TerminalError
from celery_idem.keys import key_from_fields
from celery_idem.task import HEADER


@pytest.fixture
def app() -> Celery:
    app = Celery("test_call_paths", set_as_current=False)
    app.conf.task_always_eager = True
    app.conf.idempotency_store = "memory://"
    return app


#: Celery dumps pydantic arguments at enqueue from 5.7 on (before, delay(model) fails to encode
#: for a plain task too).
PYDANTIC_TASKS = pytest.mark.skipif(
    tuple(int(part) for part in celery.__version__.split(".")[:2]) < (5, 7),
    reason="Celery < 5.7 does not dump pydantic arguments at enqueue")


class Order(pydantic.BaseModel):
    order_id: str
    amount: decimal.Decimal
    at: dt.datetime


class AliasedOrder(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(populate_by_name=True)
    order_id: str = pydantic.Field(alias="orderId")


ORDER = Order(order_id="ord_1", amount=decimal.Decimal("9.90"),
              at=dt.datetime(2026, 12, 2, 16, 35, tzinfo=dt.timezone.utc))


# -- bytes (point 2) ---------------------------------------------------------------------------

def test_bytes_arguments_are_keyed_and_a_bytearray_is_the_same_action(app: Celery) -> None:
    runs: list[bytes] = []

    @app.task(base=IdempotentTask, shared=False)
    def echo(blob: bytes) -> int:
        runs.append(bytes(blob))
        return len(blob)

    # When bytes (not valid UTF-8) are sent, then the same content as a bytearray
    assert echo.delay(b"\x00\xff\xfe").get() == 3
    assert echo.delay(bytearray(b"\x00\xff\xfe")).get() == 3
    # Then the body ran once, and a str of other content is another action
    assert runs == [b"\x00\xff\xfe"]
    assert echo.idempotency_key_for((b"abc",)) != echo.idempotency_key_for(("abc",))


# -- pydantic=True (point 6) -------------------------------------------------------------------

@PYDANTIC_TASKS
def test_a_pydantic_model_argument_is_keyed_like_the_dict_celery_sends(app: Celery) -> None:
    runs: list[Order] = []

    @app.task(base=IdempotentTask, shared=False, pydantic=True, bind=True)
    def place(self: Any, order: Order) -> str:
        runs.append(order)
        return str(self.idempotency_key)

    sent = ORDER.model_dump(mode="json")
    expected = place.idempotency_key_for((sent,))
    # When the model is passed to delay(), then the dict to apply() (a worker's view)
    assert place.delay(ORDER).get() == expected
    assert place.apply((sent,)).get() == expected
    # Then both are one action, and the body got a model, as Celery promises
    assert len(runs) == 1 and runs[0] == ORDER
    assert place.idempotency_key_for((ORDER,)) == expected


@PYDANTIC_TASKS
def test_a_pydantic_model_is_keyed_by_celerys_dump_with_the_tasks_dump_options(
    app: Celery,
) -> None:
    @app.task(base=IdempotentTask, shared=False, pydantic=True,
              pydantic_dump_kwargs={"by_alias": True})
    def place(order: AliasedOrder) -> str:
        return order.order_id

    model = AliasedOrder(order_id="ord_2")
    # Celery sends {"orderId": ...}: a worker without the header sees that, so the key must too
    assert place.idempotency_key_for((model,)) == place.idempotency_key_for(({"orderId": "ord_2"},))
    assert place.delay(model).get() == "ord_2"


# -- typing=False (point 7) --------------------------------------------------------------------

def test_typing_false_sends_a_call_that_does_not_bind_like_celery_does(app: Celery) -> None:
    @app.task(base=IdempotentTask, shared=False, typing=False, idempotency_fields=("order_id",))
    def loose(order_id: str) -> str:
        return order_id

    # Then the key is the raw arguments under names no parameter can have (fields not applied)
    assert loose.idempotency_key_for(("o1", "extra"), {"x": 1}) == key_from_fields(
        loose.name, {"*args": ["o1", "extra"], "**kwargs": {"x": 1}})
    # When the call is made, delay() does not refuse it; the body does, as in plain Celery
    with pytest.raises(TypeError, match="positional argument"):
        loose.delay("o1", "extra").get()
    # And a call that binds is keyed as usual
    assert loose.idempotency_key_for(("o1",)) == key_from_fields(loose.name, {"order_id": "o1"})


def test_typing_true_still_refuses_a_call_that_does_not_bind_at_delay(app: Celery) -> None:
    @app.task(base=IdempotentTask, shared=False)
    def strict(order_id: str) -> str:
        return order_id

    with pytest.raises(TypeError):
        strict.delay("o1", "extra")


def test_an_app_with_strict_typing_off_is_typing_false(app: Celery) -> None:
    loose_app = Celery("loose", set_as_current=False, strict_typing=False)
    loose_app.conf.task_always_eager = True
    loose_app.conf.idempotency_store = "memory://"

    @loose_app.task(base=IdempotentTask, shared=False)
    def loose(order_id: str) -> str:
        return order_id

    assert loose.idempotency_key_for((1, 2)).startswith(f"{loose.name}:")


# -- new-style errbacks (point 3) --------------------------------------------------------------

def make_errback(app: Celery, runs: list[dict[str, Any]], **options: Any) -> Any:
    @app.task(base=IdempotentTask, shared=False, **options)
    def on_error(request: Any, exc: BaseException, traceback: Any, tag: str = "") -> str:
        from celery import current_task

        runs.append({"failed": request.id, "exc": type(exc).__name__, "tag": tag,
                     "key": current_task.idempotency_key, "own_id": current_task.request.id})
        return "handled"

    return on_error


def test_a_new_style_errback_runs_when_celery_calls_it_with_the_failed_request(
    app: Celery,
) -> None:
    runs: list[dict[str, Any]] = []
    on_error = make_errback(app, runs)

    @app.task(base=IdempotentTask, shared=False)
    def declined(order_id: str) -> None:
        raise TerminalError(f"declined {order_id}")

    # When a task with a new-style errback fails (Celery calls errback(request, exc, tb))
    failed = declined.apply_async(("o1",), link_error=on_error.s(tag="t"))
    # Then the errback ran, with the failed request and the exception, under its own key
    assert failed.state == "FAILURE"
    assert [(r["failed"], r["exc"], r["tag"]) for r in runs] == [(failed.id, "TerminalError", "t")]
    assert runs[0]["key"] == key_from_fields(on_error.name, {
        "request": failed.id, "exc": None, "traceback": None, "tag": "t", "$errback": True})


def test_an_errback_runs_once_per_failed_task_id(app: Celery) -> None:
    runs: list[dict[str, Any]] = []
    on_error = make_errback(app, runs)
    exc = ValueError("boom")

    # When Celery handles the failure of t1 twice (a redelivered message), then of t2
    assert on_error(Context(id="t1"), exc, None) == "handled"
    assert on_error(Context(id="t1"), exc, None) == "handled"
    on_error(Context(id="t2"), exc, None)
    # Then the body ran once per failed task
    assert [r["failed"] for r in runs] == ["t1", "t2"]


def test_an_errback_key_honours_idempotency_fields(app: Celery) -> None:
    runs: list[dict[str, Any]] = []
    on_error = make_errback(app, runs, idempotency_fields=("tag",))

    on_error(Context(id="t1"), ValueError("x"), None, tag="order-7")
    on_error(Context(id="t2"), ValueError("x"), None, tag="order-7")
    # One failure handling per tag, and never the same action as an ordinary call
    assert len(runs) == 1
    assert runs[0]["key"] == key_from_fields(on_error.name, {"tag": "order-7", "$errback": True})


def test_an_errback_called_inside_a_running_request_leaves_that_request_alone(
    app: Celery,
) -> None:
    runs: list[dict[str, Any]] = []
    on_error = make_errback(app, runs)
    # Given the failed task's request on the errback's own stack (a task that is its own
    # errback): its header holds the failed task's key
    on_error.push_request(id="failed-1", headers={HEADER: "other:key"}, called_directly=False)
    try:
        on_error(Context(id="failed-1"), ValueError("x"), None)
        outer = on_error.request
        # Then the errback ran under its own key, and the failed request was not touched
        assert runs[0]["key"] != "other:key" and runs[0]["own_id"] is None
        assert outer.id == "failed-1" and not hasattr(outer, "idempotency_key_")
        assert not outer.ignore_result
    finally:
        on_error.pop_request()


# -- direct calls by Celery's builtins ---------------------------------------------------------

def test_map_and_chunks_call_the_task_directly_and_each_item_is_an_action(app: Celery) -> None:
    runs: list[int] = []

    @app.task(base=IdempotentTask, shared=False)
    def square(x: int) -> int:
        runs.append(x)
        return x * x

    # celery.map and celery.starmap call square(item) in-process, once per item
    assert square.map([1, 2, 2]).apply_async().get() == [1, 4, 4]
    assert square.chunks(zip([3, 3, 4]), 2).apply_async().get() == [[9, 9], [16]]
    assert runs == [1, 2, 3, 4]
