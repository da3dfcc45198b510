"""Golden vectors for idempotency keys: these strings are the key format, forever.

A key stored by one release must be found by every later one, so a change to any literal below
is a breaking change (every in-flight and recorded action would run again). Each vector also
carries the canonical JSON written by hand from the contract, and the test recomputes the key
from that text with hashlib, so the literals are tied to the documented formula, not only to
whatever the library happens to compute.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import decimal
import enum
import hashlib
import inspect
import json
import os
import subprocess
import sys
import uuid
import zoneinfo
from typing import Any

import pydantic
import pytest

from celery_idem import idempotency_key
from celery_idem.keys import bind_arguments, canonical, canonical_json

# No Celery, kombu or redis-py code runs here: make test-compat runs it on its first Celery only.
pytestmark = pytest.mark.celery_independent


class Color(str, enum.Enum):
    RED = "red"


class Priority(enum.IntEnum):
    HIGH = 3


class Plan(enum.Enum):
    GOLD = "gold"


@dataclasses.dataclass(frozen=True)
class Money:
    amount: decimal.Decimal
    currency: str


@dataclasses.dataclass(frozen=True)
class Line:
    sku: str
    price: Money
    qty: int = 1


PLUS_ONE = dt.timezone(dt.timedelta(hours=1))


class Order(pydantic.BaseModel):
    order_id: str
    amount: decimal.Decimal
    at: dt.datetime


def by_hand(operation: str, canonical_text: str) -> str:
    """The contract's formula, written out: operation + ':' + sha256(canonical JSON)[:32]."""
    return f"{operation}:{hashlib.sha256(canonical_text.encode('utf-8')).hexdigest()[:32]}"


# (id, args, kwargs, canonical JSON written by hand, the pinned key)
GOLDEN: list[tuple[str, tuple[Any, ...], dict[str, Any], str, str]] = [
    (
        "str id and int field (the README example)",
        ("charge_card", "ord_8891"), {"amount_cents": 4200},
        '{"amount_cents":4200,"id":"ord_8891","op":"charge_card"}',
        "charge_card:024bfa09f722232c800ff9095d3ba39a",
    ),
    (
        "operation only: id is null",
        ("op",), {},
        '{"id":null,"op":"op"}',
        "op:9df8f0315f9a2ea30b5a74875c3689cc",
    ),
    (
        "int business id",
        ("op", 42), {},
        '{"id":42,"op":"op"}',
        "op:22b6e66c3ecee91f66dc3e764841d5e3",
    ),
    (
        "non-integral floats in repr form",
        ("op", None), {"rate": 0.1, "small": 1.5e-07},
        '{"id":null,"op":"op","rate":0.1,"small":1.5e-07}',
        "op:e00895fe99df14f3d9e72ec7e787c89e",
    ),
    (
        "an integral float is its int: 4200.0 is the README example's 4200",
        ("charge_card", "ord_8891"), {"amount_cents": 4200.0},
        '{"amount_cents":4200,"id":"ord_8891","op":"charge_card"}',
        "charge_card:024bfa09f722232c800ff9095d3ba39a",
    ),
    (
        "a Decimal with more digits than a float is its exact text",
        ("op", None), {"amount": decimal.Decimal("0.10000000000000000000001")},
        '{"amount":"0.10000000000000000000001","id":null,"op":"op"}',
        "op:f75ffdc9fcf0a2a03799e05f60a9fb4a",
    ),
    (
        "bools stay true/false",
        ("op", None), {"flag": True, "off": False},
        '{"flag":true,"id":null,"off":false,"op":"op"}',
        "op:f8e2adb0d58ebc938742e4b8ce24a3f1",
    ),
    (
        "nested dict and list, dict keys sorted",
        ("op", "x"), {"meta": {"b": [1, 2, {"c": None}], "a": "z"}},
        '{"id":"x","meta":{"a":"z","b":[1,2,{"c":null}]},"op":"op"}',
        "op:5ed9b0e84fa65a8b49df670442c542a2",
    ),
    (
        "tuple is an array",
        ("op", None), {"pair": (1, "a")},
        '{"id":null,"op":"op","pair":[1,"a"]}',
        "op:1b8b09b2eee74ae22d723d4ff9cc98e5",
    ),
    (
        "set sorted by canonical text",
        ("op", None), {"tags": {"b", "a", "c"}},
        '{"id":null,"op":"op","tags":["a","b","c"]}',
        "op:4a072e3c65722f486a045b142c827ab0",
    ),
    (
        "frozenset of ints sorted by their JSON text, not numerically",
        ("op", None), {"nums": frozenset({10, 2, 1})},
        '{"id":null,"nums":[1,10,2],"op":"op"}',
        "op:a99f5818c677c42ddb240df6515a9e1a",
    ),
    (
        "aware datetime converted to UTC",
        ("op", None), {"at": dt.datetime(2026, 12, 2, 17, 35, tzinfo=PLUS_ONE)},
        '{"at":"2026-12-02T16:35:00+00:00","id":null,"op":"op"}',
        "op:989a085aadae1925b7a06d43502bbf58",
    ),
    (
        "naive datetime written as it is",
        ("op", None), {"at": dt.datetime(2026, 12, 2, 16, 35, 0, 123456)},
        '{"at":"2026-12-02T16:35:00.123456","id":null,"op":"op"}',
        "op:5015124d468dded1973cc06c3b234aaf",
    ),
    (
        "date",
        ("op", None), {"day": dt.date(2026, 12, 2)},
        '{"day":"2026-12-02","id":null,"op":"op"}',
        "op:f82b5c0895154074c035c4c702119c12",
    ),
    (
        "time",
        ("op", None), {"t": dt.time(16, 35)},
        '{"id":null,"op":"op","t":"16:35:00"}',
        "op:bb6d9cf7eb4c4e5b05d0186a876eb30c",
    ),
    (
        "Decimal a number: 42.50 is 42.5",
        ("op", None), {"amount": decimal.Decimal("42.50")},
        '{"amount":42.5,"id":null,"op":"op"}',
        "op:ef430c3101edaffcca0869d314649fd9",
    ),
    (
        "an integral Decimal is its int",
        ("op", None), {"amount": decimal.Decimal("1E+2")},
        '{"amount":100,"id":null,"op":"op"}',
        "op:aa9ab56eb2839000e01de7a09636aa50",
    ),
    (
        "UUID lower-case hyphenated",
        ("op", uuid.UUID("12345678-1234-5678-1234-56789ABCDEF0")), {},
        '{"id":"12345678-1234-5678-1234-56789abcdef0","op":"op"}',
        "op:5bb7a5e0bba4c98173b0f89dd8fab09d",
    ),
    (
        "str, int and plain enums become their values",
        ("op", None), {"color": Color.RED, "prio": Priority.HIGH, "plan": Plan.GOLD},
        '{"color":"red","id":null,"op":"op","plan":"gold","prio":3}',
        "op:673d32afaa3875fb418704eb3bebea53",
    ),
    (
        "nested dataclasses become objects of their fields",
        ("op", None), {"line": Line("sku-1", Money(decimal.Decimal("9.90"), "EUR"))},
        '{"id":null,"line":{"price":{"amount":9.9,"currency":"EUR"},"qty":1,"sku":"sku-1"},'
        '"op":"op"}',
        "op:847f7108b29442c22305e3681497a623",
    ),
    (
        "non-ASCII text is \\u-escaped",
        ("op", "ü"), {"name": "café"},
        '{"id":"\\u00fc","name":"caf\\u00e9","op":"op"}',
        "op:e410372cb424c29836d347e07fcf69ff",
    ),
    (
        "bytes as base64 under the $bytes tag",
        ("op", None), {"blob": b"\x00\xff"},
        '{"blob":{"$bytes":"AP8="},"id":null,"op":"op"}',
        "op:3b2dccf90dbf365784c8a0437cfb0cfe",
    ),
    (
        "a bytearray is the same action as bytes with the same content",
        ("op", None), {"blob": bytearray(b"\x00\xff")},
        '{"blob":{"$bytes":"AP8="},"id":null,"op":"op"}',
        "op:3b2dccf90dbf365784c8a0437cfb0cfe",
    ),
    (
        "empty bytes",
        ("op", None), {"blob": b""},
        '{"blob":{"$bytes":""},"id":null,"op":"op"}',
        "op:98b711c8ac8fd942f40c45209ad97828",
    ),
    (
        "bytes business id",
        ("op", b"hi"), {},
        '{"id":{"$bytes":"aGk="},"op":"op"}',
        "op:2eda3330017a8fc17a5ef1ac35d0efc6",
    ),
    (
        "a dict that looks like bytes is escaped under $dict",
        ("op", None), {"meta": {"$bytes": "AP8="}},
        '{"id":null,"meta":{"$dict":{"$bytes":"AP8="}},"op":"op"}',
        "op:f62ec8b756a80acc5391a332cc27ac1c",
    ),
    (
        "a dict that looks like an escaped dict is escaped again",
        ("op", None), {"meta": {"$dict": 1}},
        '{"id":null,"meta":{"$dict":{"$dict":1}},"op":"op"}',
        "op:0c4e1b1f2d84d257dff0fcf10aea0ee4",
    ),
    (
        "a pydantic model is its model_dump(mode='json') (pydantic's own JSON forms)",
        ("op", None),
        {"order": Order(order_id="ord_1", amount=decimal.Decimal("9.90"),
                        at=dt.datetime(2026, 12, 2, 16, 35, tzinfo=dt.timezone.utc))},
        '{"id":null,"op":"op","order":{"amount":"9.90","at":"2026-12-02T16:35:00Z",'
        '"order_id":"ord_1"}}',
        "op:fa41d2d1bd73c09764bd630faebf6457",
    ),
]


@pytest.mark.parametrize(
    ("args", "kwargs", "expected"),
    [pytest.param(a, kw, key, id=name) for name, a, kw, _, key in GOLDEN],
)
def test_the_key_of_each_golden_input_never_changes(
    args: tuple[Any, ...], kwargs: dict[str, Any], expected: str
) -> None:
    assert idempotency_key(*args, **kwargs) == expected


@pytest.mark.parametrize(
    ("operation", "canonical_text", "expected"),
    [pytest.param(a[0], text, key, id=name) for name, a, _, text, key in GOLDEN],
)
def test_each_golden_key_is_the_sha256_of_the_hand_written_canonical_json(
    operation: str, canonical_text: str, expected: str
) -> None:
    # The hand-written text is what the contract's json.dumps would produce from the canonical
    # forms; it must parse, and be its own canonical serialisation.
    reparsed = json.loads(canonical_text)
    assert json.dumps(reparsed, sort_keys=True, separators=(",", ":")) == canonical_text
    assert by_hand(operation, canonical_text) == expected


@pytest.mark.parametrize(
    ("args", "kwargs", "canonical_text"),
    [pytest.param(a, kw, text, id=name) for name, a, kw, text, _ in GOLDEN],
)
def test_canonical_json_of_each_golden_input_is_the_hand_written_text(
    args: tuple[Any, ...], kwargs: dict[str, Any], canonical_text: str
) -> None:
    operation, business_id = args[0], (args[1] if len(args) > 1 else None)
    assert canonical_json({"op": operation, "id": business_id, **kwargs}) == canonical_text


def test_the_readme_key_is_verified_with_hashlib_from_the_contract_formula() -> None:
    # Given the contract's formula applied to plain JSON values (no canonical forms needed)
    text = json.dumps(
        {"op": "charge_card", "id": "ord_8891", "amount_cents": 4200},
        sort_keys=True, separators=(",", ":"),
    )
    digest = hashlib.sha256(text.encode()).hexdigest()[:32]
    # Then the library's key is exactly operation:digest
    assert idempotency_key("charge_card", "ord_8891", amount_cents=4200) == f"charge_card:{digest}"


def test_an_aware_datetime_has_the_same_key_as_the_same_instant_in_utc() -> None:
    paris = dt.datetime(2026, 7, 1, 18, 35, tzinfo=zoneinfo.ZoneInfo("Europe/Paris"))  # UTC+2
    utc = dt.datetime(2026, 7, 1, 16, 35, tzinfo=dt.timezone.utc)
    plus_one = dt.datetime(2026, 7, 1, 17, 35, tzinfo=PLUS_ONE)
    keys = {idempotency_key("op", at=when) for when in (paris, utc, plus_one)}
    assert len(keys) == 1
    text = '{"at":"2026-07-01T16:35:00+00:00","id":null,"op":"op"}'
    assert keys == {by_hand("op", text)}


def test_a_naive_datetime_differs_from_the_aware_utc_instant() -> None:
    naive = dt.datetime(2026, 7, 1, 16, 35)
    aware = naive.replace(tzinfo=dt.timezone.utc)
    assert idempotency_key("op", at=naive) != idempotency_key("op", at=aware)


def test_a_tuple_and_a_list_with_the_same_items_are_the_same_action() -> None:
    assert idempotency_key("op", items=(1, "a", [2])) == idempotency_key("op", items=[1, "a", (2,)])


def test_a_set_and_a_frozenset_are_order_independent() -> None:
    words = ["pear", "apple", "fig", "kiwi", "date"]
    keys = {
        idempotency_key("op", tags=set(words)),
        idempotency_key("op", tags=set(reversed(words))),
        idempotency_key("op", tags=frozenset(words)),
        idempotency_key("op", tags=sorted(words)),
    }
    assert len(keys) == 1


def test_equal_decimals_with_different_exponents_have_the_same_key() -> None:
    assert idempotency_key("op", amount=decimal.Decimal("42.50")) == idempotency_key(
        "op", amount=decimal.Decimal("42.5")
    )
    assert idempotency_key("op", amount=decimal.Decimal("4.250E+1")) == idempotency_key(
        "op", amount=decimal.Decimal("42.5")
    )


def test_distinct_decimals_with_more_than_28_digits_have_distinct_keys() -> None:
    # Given two different amounts that agree on their first 28 significant digits
    a = decimal.Decimal("1.00000000000000000000000000000001")
    b = decimal.Decimal("1.00000000000000000000000000000002")
    assert a != b
    # Then they are different actions
    assert idempotency_key("op", amount=a) != idempotency_key("op", amount=b)
    # And a long integral Decimal keeps every digit
    big = decimal.Decimal("12345678901234567890123456789012345")
    assert canonical(big) == 12345678901234567890123456789012345


def test_a_decimal_key_does_not_depend_on_the_threads_decimal_context() -> None:
    # Given a key computed under the default context
    amount = decimal.Decimal("42.567")
    expected = idempotency_key("op", amount=amount)
    # When another part of the program lowers the precision (decimal contexts are per thread)
    with decimal.localcontext() as ctx:
        ctx.prec = 3
        key = idempotency_key("op", amount=amount)
    # Then the key is the same: a key must be stable across processes
    assert key == expected


def test_int_and_str_of_the_same_digits_are_different_actions() -> None:
    assert idempotency_key("op", 1) != idempotency_key("op", "1")
    assert idempotency_key("op", n=1) != idempotency_key("op", n="1")


def test_true_and_1_are_different_actions() -> None:
    assert idempotency_key("op", flag=True) != idempotency_key("op", flag=1)
    assert idempotency_key("op", False) != idempotency_key("op", 0)


def test_field_values_cannot_be_shifted_between_fields() -> None:
    # The celery_once collision: {"a": "x_b-1"} vs {"a": "x", "b": 1}
    assert idempotency_key("op", a="x_b-1") != idempotency_key("op", a="x", b=1)


def test_the_operation_is_the_readable_prefix_and_part_of_the_hash() -> None:
    key_a, key_b = idempotency_key("refund", "ord_1"), idempotency_key("charge", "ord_1")
    assert key_a.startswith("refund:") and key_b.startswith("charge:")
    assert key_a.split(":", 1)[1] != key_b.split(":", 1)[1]


@pytest.mark.parametrize("operation", ["", None, 3])
def test_an_empty_or_non_str_operation_is_rejected(operation: Any) -> None:
    with pytest.raises(ValueError, match="operation"):
        idempotency_key(operation, "x")


@pytest.mark.parametrize(
    ("fields", "path", "type_name"),
    [
        pytest.param({"token": object()}, "token", "object", id="object"),
        pytest.param({"view": memoryview(b"\x00\x01")}, "view", "memoryview", id="memoryview"),
        pytest.param({"items": [{"sku": "a"}, {"sku": object()}]}, "items[1].sku", "object",
                     id="nested path"),
        pytest.param({"meta": {"inner": {"raw": 1j}}}, "meta.inner.raw", "complex",
                     id="nested dict path"),
        pytest.param({"line": Line("s", Money(1.5j, "EUR"))}, "line.price.amount", "complex",  # type: ignore[arg-type]
                     id="inside a dataclass"),
    ],
)
def test_a_value_without_canonical_form_raises_type_error_naming_the_field(
    fields: dict[str, Any], path: str, type_name: str
) -> None:
    with pytest.raises(TypeError) as info:
        idempotency_key("op", **fields)
    message = str(info.value)
    assert repr(path) in message
    assert type_name in message


def test_bytes_are_never_the_same_action_as_a_str_or_a_dict_with_the_same_text() -> None:
    # Given bytes, the str of the same text, its base64 text, and a dict spelling the tagged form
    forms = [b"abc", "abc", "YWJj", {"$bytes": "YWJj"}, ["$bytes", "YWJj"]]
    # Then each is an action of its own
    assert len({idempotency_key("op", blob=form) for form in forms}) == len(forms)


def test_other_dicts_with_dollar_keys_are_not_escaped() -> None:
    # Only a dict whose single key is a tag is escaped: every existing key stays as it was
    assert canonical({"$bytes": "x", "other": 1}) == {"$bytes": "x", "other": 1}
    assert canonical({"$price": 1}) == {"$price": 1}


def test_a_pydantic_model_is_the_same_action_as_the_dict_celery_sends_for_it() -> None:
    # Given a model and the dict Celery's pydantic=True dump sends in its place
    order = Order(order_id="ord_1", amount=decimal.Decimal("9.90"),
                  at=dt.datetime(2026, 12, 2, 16, 35, tzinfo=dt.timezone.utc))
    sent = json.loads(json.dumps(order.model_dump(mode="json")))
    # Then the producer (model) and a worker that got the dict derive the same key
    assert idempotency_key("op", order=order) == idempotency_key("op", order=sent)


def test_a_pydantic_model_that_cannot_be_dumped_raises_type_error_naming_the_field() -> None:
    class Holder(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(arbitrary_types_allowed=True)
        thing: object

    with pytest.raises(TypeError) as info:
        idempotency_key("op", holder=Holder(thing=object()))
    assert "'holder'" in str(info.value) and "Holder" in str(info.value)


def test_a_dict_with_int_keys_raises_type_error_naming_the_field() -> None:
    with pytest.raises(TypeError) as info:
        idempotency_key("op", "x", counts={1: "a"})
    assert "'counts'" in str(info.value)
    assert "int" in str(info.value)


def test_an_unsupported_business_id_raises_type_error_naming_id() -> None:
    with pytest.raises(TypeError, match="'id'"):
        idempotency_key("op", object())


def test_a_key_with_a_set_is_the_same_in_processes_with_other_hash_seeds() -> None:
    # Given a key whose value is a set of strings (iteration order depends on PYTHONHASHSEED)
    code = (
        "from celery_idem import idempotency_key;"
        "print(idempotency_key('tag', 'x', tags={'alpha', 'beta', 'gamma', 'delta', 'eps'}))"
    )
    here = idempotency_key("tag", "x", tags={"alpha", "beta", "gamma", "delta", "eps"})
    # When two fresh interpreters with different hash seeds compute it
    seen = set()
    for seed in ("1", "4242"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
            timeout=60,
        )
        seen.add(out.stdout.strip())
    # Then every process agrees with this one
    assert seen == {here}


def test_binding_applies_defaults_so_an_omitted_default_is_the_same_call() -> None:
    def charge(order_id: str, amount: int, note: str = "") -> None: ...

    sig = inspect.signature(charge)
    omitted = bind_arguments(sig, ("ord_1", 5), {})
    explicit = bind_arguments(sig, ("ord_1",), {"amount": 5, "note": ""})
    assert omitted == explicit == {"order_id": "ord_1", "amount": 5, "note": ""}
    assert idempotency_key("charge", **omitted) == idempotency_key("charge", **explicit)


def test_binding_keeps_var_args_under_their_parameter_names() -> None:
    def f(a: int, *rest: int, **extra: int) -> None: ...

    bound = bind_arguments(inspect.signature(f), (1, 2, 3), {"z": 4})
    assert bound == {"a": 1, "rest": (2, 3), "extra": {"z": 4}}


def test_binding_a_call_that_does_not_match_raises_type_error() -> None:
    def f(a: int) -> None: ...

    with pytest.raises(TypeError):
        bind_arguments(inspect.signature(f), (1, 2), {})


def _inspect_bind(sig: inspect.Signature, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    try:
        bound = sig.bind(*args, **kwargs)
    except TypeError as exc:
        return ("TypeError", str(exc))
    bound.apply_defaults()
    return list(bound.arguments.items())  # the order too


def _our_bind(sig: inspect.Signature, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    try:
        return list(bind_arguments(sig, args, kwargs).items())
    except TypeError as exc:
        return ("TypeError", str(exc))


def test_binding_is_inspects_bind_for_every_call_shape() -> None:
    # The key is made of this mapping: its content, its order and every error must be inspect's.
    def plain(a: int, b: int, c: int = 3, *, d: int = 4, e: int) -> None: ...
    def var(a: int, *rest: int, k: int = 1, **extra: int) -> None: ...
    def posonly(a: int, /, b: int = 2) -> None: ...
    def empty() -> None: ...

    calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = [
        ((), {}), ((1,), {}), ((1, 2), {}), ((1, 2), {"e": 5}), ((1,), {"b": 2, "e": 5}),
        ((1, 2, 3), {"e": 5, "d": 0}), ((1, 2, 3, 4), {"e": 5}), ((1, 2), {"a": 1, "e": 5}),
        ((1, 2), {"e": 5, "zz": 0}), ((), {"a": 1, "b": 2, "e": 5}), ((1, 2), {"c": None, "e": 5}),
        ((1,), {"k": 2, "z": 3}), ((1, 2, 3), {}), ((), {"a": 1}),
    ]
    for func in (plain, var, posonly, empty):
        sig = inspect.signature(func)
        for args, kwargs in calls:
            assert _our_bind(sig, args, kwargs) == _inspect_bind(sig, args, kwargs), (
                func.__name__, args, kwargs)


def test_canonical_json_is_json_dumps_sorted_and_compact() -> None:
    payload = {"b": [1.5, None, True, "é"], "a": "x\n\"", "c": {"y": 2, "x": -2.5}, 1: 1e-300}
    expected = json.dumps({str(k): v for k, v in payload.items()}, sort_keys=True,
                          separators=(",", ":"))
    assert canonical_json(payload) == expected


# -- numbers: JSON's one number type ---------------------------------------------------------


def test_a_number_is_one_action_whatever_its_spelling() -> None:
    # Given the spellings of 4200 a model, an HTTP client or another SDK may send
    spellings = [4200, 4200.0, json.loads("4.2e3"), json.loads("4200.000"),
                 decimal.Decimal("4200.00"), decimal.Decimal("4.2E+3")]
    # Then each is the same action, at the top level and nested
    assert len({idempotency_key("charge", "ord_1", amount_cents=n) for n in spellings}) == 1
    assert len({idempotency_key("charge", lines=[{"cents": n}]) for n in spellings}) == 1
    # And so are the spellings of a fraction, and the two zeros
    assert idempotency_key("op", rate=42.5) == idempotency_key("op", rate=decimal.Decimal("42.50"))
    assert idempotency_key("op", x=-0.0) == idempotency_key("op", x=0)
    assert idempotency_key("op", x=0.1) != idempotency_key("op", x=0.10000000000000002)


def test_booleans_and_strings_stay_apart_from_numbers() -> None:
    assert len({idempotency_key("op", x=v) for v in (True, 1, 1.0)}) == 2
    assert len({idempotency_key("op", x=v) for v in (False, 0, 0.0)}) == 2
    assert idempotency_key("op", x="4200") != idempotency_key("op", x=4200)


def test_big_integers_keep_every_digit() -> None:
    # Beyond 2**53 a float cannot tell neighbours apart; an int keeps them apart
    assert idempotency_key("op", n=2**53 + 1) != idempotency_key("op", n=2**53)
    assert canonical(10**30 + 1) == 10**30 + 1
    # And a float is the integer it exactly is
    assert idempotency_key("op", n=float(2**60)) == idempotency_key("op", n=2**60)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf"),
                                   decimal.Decimal("NaN"), decimal.Decimal("-Infinity"),
                                   decimal.Decimal("sNaN")])
def test_nan_and_infinity_are_refused_naming_the_field(value: Any) -> None:
    with pytest.raises(ValueError) as info:
        idempotency_key("op", items=[1, {"cents": value}])
    assert "'items[1].cents'" in str(info.value)
    assert "JSON has no NaN or infinity" in str(info.value)
