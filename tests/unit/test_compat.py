"""celery_idem.compat: the functions behind other libraries' private names, and their fallbacks.

The inventory itself (:data:`PRIVATE_NAMES`) is held to the code by test_private_names.py.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pydantic
import pytest
from celery import Celery
from celery.app.task import Context
from vine import barrier  # type: ignore[import-untyped, unused-ignore]

from celery_idem.compat import (
    MetaHook,
    fire_full_barriers,
    get_actual_ignore_result,
    push_fresh_request,
    worker_connection,
)
from celery_idem.identity import dump_pydantic_arguments


@pytest.fixture
def app() -> Celery:
    return Celery("test_compat", set_as_current=False)


def test_get_actual_ignore_result_asks_the_task_and_the_request(app: Celery) -> None:
    @app.task(shared=False)
    def kept() -> None:
        return None

    @app.task(shared=False, ignore_result=True)
    def ignored() -> None:
        return None

    assert get_actual_ignore_result(kept, Context()) is False
    assert get_actual_ignore_result(kept, Context(ignore_result=True)) is True
    assert get_actual_ignore_result(ignored, Context()) is True


def test_push_fresh_request_inherits_nothing_from_the_current_one(app: Celery) -> None:
    @app.task(shared=False)
    def work() -> None:
        return None

    work.push_request(id="outer", root_id="root", retries=3)
    try:
        push_fresh_request(work, id="errback")
        assert work.request.id == "errback"
        assert work.request.root_id is None and work.request.retries == 0
        work.pop_request()
        assert work.request.id == "outer"
    finally:
        work.pop_request()


def test_meta_hook_hands_the_consumers_meta_to_on_meta() -> None:
    seen: list[Any] = []

    class Handle(MetaHook):
        def on_meta(self, meta: Any) -> Any:
            seen.append(meta)
            return {"changed": meta}

    meta = {"status": "SUCCESS"}
    assert Handle()._maybe_set_cache(meta) == {"changed": meta}
    assert seen == [meta]
    assert MetaHook()._maybe_set_cache(meta) is meta


class Order(pydantic.BaseModel):
    order_id: str
    amount_cents: int


def test_pydantic_arguments_are_dumped_as_celery_sends_them(app: Celery) -> None:
    @app.task(shared=False, pydantic=True)
    def charge(order: Order, note: str = "") -> str:
        return order.order_id

    order = Order(order_id="o-1", amount_cents=5)
    args, kwargs = dump_pydantic_arguments(charge, (order,), {"note": "n"})
    if hasattr(charge, "_dump_pydantic_arguments"):  # Celery >= 5.7 dumps in apply_async
        assert list(args) == [{"order_id": "o-1", "amount_cents": 5}]
    else:  # older Celerys send the model as given (their serializer decides)
        assert list(args) == [order]
    assert dict(kwargs) == {"note": "n"}


def test_without_celerys_dump_the_arguments_are_kept_as_given() -> None:
    order = Order(order_id="o-1", amount_cents=5)
    args, kwargs = dump_pydantic_arguments(SimpleNamespace(), (order,), {"note": "n"})
    assert args == (order,) and kwargs == {"note": "n"}


def counted(size: int, count: int, fired: list[str]) -> barrier:
    """A barrier whose results were counted before it was finalized (as a ResultSet's are)."""
    waiter = barrier(callback=lambda: fired.append("fired"))
    for _ in range(count):
        waiter()
    waiter.size, waiter.finalized = size, True
    return waiter


def test_only_a_full_unfired_barrier_is_fired_once() -> None:
    fired: list[str] = []
    full = counted(2, 2, fired)
    fire_full_barriers([full, object()])
    assert fired == ["fired"] and full.ready
    fire_full_barriers([full])
    assert fired == ["fired"]  # a ready barrier is not fired again


def test_a_barrier_still_waiting_is_left_alone() -> None:
    fired: list[str] = []
    partial = counted(2, 1, fired)
    cancelled = counted(1, 1, fired)
    cancelled.cancel()
    unfinalized = counted(1, 1, fired)
    unfinalized.finalized = False
    fire_full_barriers([partial, cancelled, unfinalized])
    assert fired == []
    assert partial._value == 1  # nothing counted twice
    partial()
    assert fired == ["fired"]


def test_worker_connection_is_the_consumers_or_none() -> None:
    conn = object()
    assert worker_connection(SimpleNamespace(_conninfo=conn)) is conn
    assert worker_connection(SimpleNamespace()) is None
