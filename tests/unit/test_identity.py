"""celery_idem.identity: the key of a call, its fingerprint, a message header's key and time.

In process, on tasks of a ``memory://`` app (no broker, no worker): identity only reads the
task's options and signature.
"""

from __future__ import annotations

import datetime as dt
import time
from typing import Any

import pytest
from celery import Celery
from celery.app.task import Context

from celery_idem import IdempotentTask
from celery_idem.exceptions import InvalidKey
from celery_idem.identity import UNBOUND_ARGS, bind, failed_request, header_key, identify, message_time
from celery_idem.keys import caller_key, parse_key


@pytest.fixture
def app() -> Celery:
    app = Celery("test_identity", set_as_current=False)
    app.conf.idempotency_store = "memory://"
    return app


def define(app: Celery, **options: Any) -> Any:
    @app.task(base=IdempotentTask, shared=False, **options)
    def charge(order_id: str, amount_cents: int, note: str = "") -> str:
        return order_id

    return charge


def test_a_derived_key_covers_the_chosen_fields_however_they_are_passed(app: Celery) -> None:
    charge = define(app, idempotency_fields=("order_id", "amount_cents"))
    call = identify(charge, ("o-1", 500), {"note": "a"}, None, None)
    key = call.key
    assert identify(charge, (), {"amount_cents": 500, "order_id": "o-1", "note": "b"},
                    None, None).key == key
    assert identify(charge, ("o-1", 501), {}, None, None).key != key
    assert key.startswith(charge.idempotency_config.operation)
    assert call.fingerprint() is None  # a derived key carries its fields; no validation asked


def test_validation_fingerprints_the_whole_call(app: Celery) -> None:
    charge = define(app, idempotency_fields=("order_id",), idempotency_validate=True)
    a = identify(charge, ("o-1", 500), {"note": "a"}, None, None)
    b = identify(charge, ("o-1", 500), {"note": "b"}, None, None)
    assert a.key == b.key
    assert a.fingerprint() is not None and b.fingerprint() is not None
    assert a.fingerprint() != b.fingerprint()


def test_an_explicit_key_is_the_callers_key_of_the_operation(app: Celery) -> None:
    charge = define(app)
    key = identify(charge, ("o-1", 500), {}, "order-o-1", None).key
    operation = charge.idempotency_config.operation
    assert key == caller_key(operation, "order-o-1")
    scoped = identify(charge, ("o-1", 500), {}, "order-o-1", "tenant-a").key
    assert scoped == caller_key(operation, "order-o-1", "tenant-a") != key
    with pytest.raises(InvalidKey):
        identify(charge, ("o-1", 500), {}, "", None)


def test_a_period_puts_the_slot_of_at_in_the_key(app: Celery) -> None:
    charge = define(app, idempotency_period=60.0)
    at = 1_800_000_000.0  # a multiple of 60
    first = identify(charge, ("o-1", 5), {}, None, None, at=at + 1).key
    assert identify(charge, ("o-1", 5), {}, None, None, at=at + 59).key == first
    assert identify(charge, ("o-1", 5), {}, None, None, at=at + 61).key != first
    # A send of the schedule a moment early takes the coming slot
    assert identify(charge, ("o-1", 5), {}, None, None, at=at - 1, scheduled=True).key == first
    aware = dt.datetime.fromtimestamp(at + 1, tz=dt.timezone.utc)
    assert identify(charge, ("o-1", 5), {}, None, None, at=aware).key == first


@pytest.mark.parametrize(("at", "error", "match"), [
    (dt.datetime(2027, 1, 1), ValueError, "naive datetime"),
    (True, TypeError, "Unix seconds or an aware datetime"),
    ("1800000000", TypeError, "Unix seconds or an aware datetime"),
])
def test_a_period_refuses_a_time_it_cannot_place(app: Celery, at: Any, error: type[Exception],
                                                 match: str) -> None:
    charge = define(app, idempotency_period=60.0)
    with pytest.raises(error, match=match):
        identify(charge, ("o-1", 5), {}, None, None, at=at)


def test_a_key_func_must_return_a_non_empty_str(app: Celery) -> None:
    charge = define(app, idempotency_key_func=lambda order_id, amount_cents, note="": order_id)
    assert identify(charge, ("o-1", 5), {}, None, None).key == \
        identify(charge, ("o-1", 6), {"note": "x"}, None, None).key
    with pytest.raises(TypeError, match="idempotency_key_func returned 7"):
        identify(charge, (7, 5), {}, None, None)


def test_an_errback_call_has_a_key_of_its_own(app: Celery) -> None:
    @app.task(base=IdempotentTask, shared=False)
    def on_error(request: Any, exc: Any, traceback: Any) -> None:
        return None

    failed = Context(id="failed-id")
    assert failed_request((failed, ValueError("x"), None)) is failed
    assert failed_request(("failed-id", None, None)) is None
    assert failed_request(()) is None
    bound = bind(on_error, (failed, ValueError("x"), "tb"), {})
    assert bound == {"request": "failed-id", "exc": None, "traceback": None}
    errback_key = identify(on_error, (failed, ValueError("x"), "tb"), {}, None, None).key
    plain_key = identify(on_error, ("failed-id", None, None), {}, None, None).key
    assert errback_key != plain_key


def test_bind_refuses_or_keeps_a_call_that_does_not_bind(app: Celery) -> None:
    strict = define(app)
    with pytest.raises(TypeError, match="order_id"):
        bind(strict, (), {"wrong": 1})
    loose = define(app, typing=False, name="loose_charge")
    assert bind(loose, (1,), {"wrong": 2}) == {UNBOUND_ARGS: [1], "**kwargs": {"wrong": 2}}


def test_unsendable_names_the_argument_the_serializer_refuses(app: Celery) -> None:
    charge = define(app)
    call = identify(charge, ("o-1", 5), {"note": object()}, "order-o-1", None)
    message = str(call.unsendable("json", ValueError("boom")))
    assert charge.name in message and "'note'" in message and "object" in message
    assert "'json'" in message and "nothing was sent" in message
    assert "order_id" not in message


def test_unsendable_without_a_culprit_blames_the_message(app: Celery) -> None:
    charge = define(app)
    call = identify(charge, ("o-1", 5), {}, None, None)
    assert str(call.unsendable("json", ValueError("boom"))) == \
        f"{charge.name}: the message cannot be encoded: boom; nothing was sent"


def test_header_key_keeps_a_stored_key_and_wraps_a_callers_one(app: Celery) -> None:
    charge = define(app)
    operation = charge.idempotency_config.operation
    derived = identify(charge, ("o-1", 5), {}, None, None).key
    carried = identify(charge, ("o-1", 5), {}, header="order-o-1", any_scope=True)
    assert (carried.key, carried.per_call) == (caller_key(operation, "order-o-1"), True)
    assert header_key(charge, derived) == (derived, False, None)
    assert header_key(charge, "order-o-1") == (caller_key(operation, "order-o-1"), True, None)
    # A stored key of another scope is the worker's authority only with any_scope
    in_tenant = caller_key(operation, "order-o-1", "tenant-a")
    assert parse_key(in_tenant, operation) is not None
    assert header_key(charge, in_tenant, any_scope=True) == (in_tenant, True, "tenant-a")
    with pytest.raises(InvalidKey):
        header_key(charge, "bad\nkey")
    with pytest.raises(InvalidKey):
        header_key(charge, "x" * 300)


@pytest.mark.parametrize(("properties", "expected"), [
    ({"timestamp": dt.datetime(2027, 1, 1)}, dt.datetime(2027, 1, 1, tzinfo=dt.timezone.utc).timestamp()),
    ({"timestamp": dt.datetime(2027, 1, 1, 1, tzinfo=dt.timezone(dt.timedelta(hours=1)))},
     dt.datetime(2027, 1, 1, tzinfo=dt.timezone.utc).timestamp()),
    ({"timestamp": 1_800_000_000}, 1_800_000_000.0),
    ({"timestamp": True}, None),
    ({"timestamp": -5}, None),
    ({"timestamp": float("nan")}, None),
    ({}, None),
    (None, None),
])
def test_message_time_reads_the_timestamp_property(properties: Any, expected: float | None) -> None:
    assert message_time(Context(properties=properties)) == expected


def test_a_naive_message_timestamp_is_utc_whatever_the_local_zone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TZ", "Asia/Tokyo")
    time.tzset()
    try:
        stamp = dt.datetime(2027, 1, 1)
        assert message_time(Context(properties={"timestamp": stamp})) == \
            stamp.replace(tzinfo=dt.timezone.utc).timestamp()
    finally:
        monkeypatch.undo()
        time.tzset()
