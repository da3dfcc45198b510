"""IdempotentTask in eager mode (``task_always_eager``) on the in-process ``memory://`` store.

Every test builds its own app (so its own store: the store is cached per app) and defines its
tasks with ``shared=False``, so no task leaks into apps created by other tests.
"""

from __future__ import annotations

import dataclasses
import decimal
import time
from collections.abc import Callable
from typing import Any

import pytest
from celery import Celery
from celery.result import EagerResult

import celery_idem
from celery_idem import CachedResult, IdempotentTask, TerminalError, idempotency_key
from celery_idem.records import State
from celery_idem.stores.memory import MemoryStore
from celery_idem.task import get_store


@pytest.fixture
def app() -> Celery:
    app = Celery("test_eager", set_as_current=False)
    app.conf.task_always_eager = True
    app.conf.idempotency_store = "memory://"
    return app


class Ledger:
    """What the bodies saw: one entry per run."""

    def __init__(self) -> None:
        self.runs: list[dict[str, Any]] = []

    def __len__(self) -> int:
        return len(self.runs)


@pytest.fixture
def ledger() -> Ledger:
    return Ledger()


def make_charge(app: Celery, ledger: Ledger, **options: Any) -> Any:
    @app.task(base=IdempotentTask, bind=True, shared=False, **options)
    def charge(self: Any, order_id: str, amount_cents: int, note: str = "") -> dict[str, Any]:
        ledger.runs.append({
            "key": self.idempotency_key,
            "token": self.idempotency_token,
            "task_id": self.request.id,
            "args": (order_id, amount_cents, note),
        })
        return {"charged": order_id, "amount_cents": amount_cents, "run": len(ledger)}

    return charge


def test_two_delays_with_the_same_arguments_run_the_body_once(app: Celery, ledger: Ledger) -> None:
    charge = make_charge(app, ledger)

    r1 = charge.delay("ord_8891", 4200)
    r2 = charge.delay("ord_8891", 4200)

    assert len(ledger) == 1
    assert r1.get() == r2.get() == {"charged": "ord_8891", "amount_cents": 4200, "run": 1}


def test_the_second_delay_is_a_cached_result_of_the_original_task_id(
    app: Celery, ledger: Ledger
) -> None:
    charge = make_charge(app, ledger)
    r1 = charge.delay("ord_8891", 4200)

    r2 = charge.delay("ord_8891", 4200)

    assert not isinstance(r1, CachedResult)
    assert isinstance(r2, CachedResult)
    assert isinstance(r2, EagerResult)
    assert r2.id == r1.id == ledger.runs[0]["task_id"]
    assert r2.original_task_id == r1.id
    assert r2.idempotency_key == ledger.runs[0]["key"]
    assert r2.state == "SUCCESS"
    assert r2.successful()


def test_omitted_defaults_and_keyword_arguments_are_the_same_action(
    app: Celery, ledger: Ledger
) -> None:
    charge = make_charge(app, ledger)

    charge.delay("ord_1", 100)
    charge.delay("ord_1", 100, note="")
    charge.delay(order_id="ord_1", amount_cents=100)
    charge.apply_async(kwargs={"amount_cents": 100, "order_id": "ord_1"})

    assert len(ledger) == 1


def test_different_business_arguments_are_different_actions(app: Celery, ledger: Ledger) -> None:
    charge = make_charge(app, ledger)

    charge.delay("ord_1", 100)
    charge.delay("ord_1", 101)
    charge.delay("ord_2", 100)

    assert len(ledger) == 3


def test_with_idempotency_fields_other_arguments_do_not_change_the_action(
    app: Celery, ledger: Ledger
) -> None:
    # The contract's charge_card example
    charge = make_charge(app, ledger, idempotency_fields=("order_id", "amount_cents"))

    r1 = charge.delay("ord_8891", 4200)
    r2 = charge.delay("ord_8891", 4200, note="retry by the agent")

    assert len(ledger) == 1
    assert r1.get() == r2.get()


def test_inside_the_body_the_task_exposes_its_key_and_token(app: Celery, ledger: Ledger) -> None:
    charge = make_charge(app, ledger)

    charge.delay("ord_1", 100)

    # The key is the documented one: task name as operation, bound arguments as fields
    expected = idempotency_key(charge.name, order_id="ord_1", amount_cents=100, note="")
    assert ledger.runs[0]["key"] == expected
    # The fencing token: the store clock in µs at the claim (see celery_idem.stores.base)
    token = ledger.runs[0]["token"]
    assert isinstance(token, int) and time.time() * 1e6 - 60e6 < token < 2**53
    assert charge.idempotency_key_for(("ord_1", 100)) == expected


def test_outside_a_body_the_key_and_token_are_none(app: Celery, ledger: Ledger) -> None:
    charge = make_charge(app, ledger)
    assert charge.idempotency_key is None
    assert charge.idempotency_token is None


def test_a_per_call_key_beats_the_tasks_key_rules_within_the_tasks_namespace(
    app: Celery, ledger: Ledger
) -> None:
    charge = make_charge(app, ledger)

    r1 = charge.apply_async(("ord_1", 100), idempotency_key="refund-2026-0001")
    r2 = charge.apply_async(("ord_1", 100), idempotency_key="refund-2026-0001")
    r3 = charge.apply_async(("ord_1", 100))  # the derived key is another action

    stored = f"{charge.name}:key=refund-2026-0001"
    assert [run["key"] for run in ledger.runs] == [
        stored, idempotency_key(charge.name, order_id="ord_1", amount_cents=100, note=""),
    ]
    assert r1.idempotency_key == stored
    assert isinstance(r2, CachedResult) and r2.id == r1.id
    assert r2.get() == r1.get() == {"charged": "ord_1", "amount_cents": 100, "run": 1}
    assert r3.get()["run"] == 2
    assert get_store(app).get(stored) is not None
    assert get_store(app).get("refund-2026-0001") is None


def test_a_per_call_key_reused_with_other_arguments_is_refused(
    app: Celery, ledger: Ledger
) -> None:
    # Given a per-call key used once (the default: its record keeps the call's fingerprint)
    charge = make_charge(app, ledger)
    charge.apply_async(("ord-1001", 5000), idempotency_key="k-1")
    # When the same key comes with another action, Then it is refused, nothing runs
    with pytest.raises(celery_idem.IdempotencyKeyMismatch, match="use a new key"):
        charge.apply_async(("ord-9999", 1), idempotency_key="k-1")
    assert len(ledger) == 1


def test_the_fingerprint_covers_only_the_identifying_fields(
    app: Celery, ledger: Ledger
) -> None:
    charge = make_charge(app, ledger, idempotency_fields=("order_id", "amount_cents"))
    r1 = charge.apply_async(("ord_1", 100), idempotency_key="k-1")
    # A retry that only rewords the note is the same action
    r2 = charge.apply_async(("ord_1", 100, "retry by the agent"), idempotency_key="k-1")
    assert r2.get() == r1.get() and len(ledger) == 1
    with pytest.raises(celery_idem.IdempotencyKeyMismatch):
        charge.apply_async(("ord_1", 101), idempotency_key="k-1")


def test_fingerprint_off_answers_a_reused_per_call_key_from_its_record(
    app: Celery, ledger: Ledger
) -> None:
    charge = make_charge(app, ledger, idempotency_fingerprint=False)
    r1 = charge.apply_async(("ord_1", 100), idempotency_key="k-1")
    r2 = charge.apply_async(("ord_2", 999), idempotency_key="k-1")
    assert r2.get() == r1.get() and len(ledger) == 1


def test_a_per_call_key_never_answers_another_operation(app: Celery, ledger: Ledger) -> None:
    charge = make_charge(app, ledger)

    @app.task(base=IdempotentTask, shared=False)
    def salary(employee: str) -> dict[str, Any]:
        return {"employee": employee, "salary": 123_456, "ssn": "078-05-1120"}

    taken = salary.delay("e-1")
    # The other task's full key, passed as a per-call key: a new action of charge
    out = charge.apply_async(("ord_1", 100), idempotency_key=taken.idempotency_key)
    assert out.get() == {"charged": "ord_1", "amount_cents": 100, "run": 1}
    assert out.idempotency_key == f"{charge.name}:key={taken.idempotency_key}"
    # and a forged header with it is a caller's key of charge too
    same = charge.apply_async(("ord_1", 100), headers={"idempotency_key": taken.idempotency_key})
    assert same.idempotency_key == out.idempotency_key and same.get() == out.get()
    with pytest.raises(celery_idem.IdempotencyKeyMismatch):
        charge.apply_async(("ord_2", 100), headers={"idempotency_key": taken.idempotency_key})


def test_the_same_key_in_two_scopes_is_two_actions(app: Celery, ledger: Ledger) -> None:
    charge = make_charge(app, ledger)
    a = charge.apply_async(("ord_1", 100), idempotency_key="order-1", idempotency_scope="t-a")
    b = charge.apply_async(("ord_1", 100), idempotency_key="order-1", idempotency_scope="t-b")
    derived_a = charge.apply_async(("ord_1", 100), idempotency_scope="t-a")
    derived = charge.apply_async(("ord_1", 100))
    assert len(ledger) == 4
    assert a.idempotency_key == f"{charge.name}@t-a:key=order-1"
    assert b.idempotency_key == f"{charge.name}@t-b:key=order-1"
    assert derived_a.idempotency_key == derived.idempotency_key.replace(
        charge.name, f"{charge.name}@t-a", 1)
    again = charge.apply_async(("ord_1", 100), idempotency_key="order-1", idempotency_scope="t-a")
    assert isinstance(again, CachedResult) and again.id == a.id and len(ledger) == 4


@pytest.mark.parametrize("scope", ["", "a b", "t:1", "t@1", "x" * 65, 7, "t\n"])
def test_an_invalid_scope_is_refused_and_nothing_runs(
    app: Celery, ledger: Ledger, scope: Any
) -> None:
    charge = make_charge(app, ledger)
    with pytest.raises(celery_idem.InvalidKey, match="idempotency_scope"):
        charge.apply_async(("ord_1", 100), idempotency_scope=scope)
    assert len(ledger) == 0


@pytest.mark.parametrize("key", ["a\nb", "\x1b[31mred", "a\u202eb", "\ud800"])
def test_a_per_call_key_with_control_characters_is_refused(
    app: Celery, ledger: Ledger, key: str
) -> None:
    charge = make_charge(app, ledger)
    with pytest.raises(celery_idem.InvalidKey, match="U\\+"):
        charge.apply_async(("ord_1", 100), idempotency_key=key)
    assert len(ledger) == 0 and list(get_store(app).scan()) == []


@pytest.mark.parametrize("key", ["", "x" * 201, 42])
def test_an_invalid_per_call_key_is_rejected_and_nothing_runs(
    app: Celery, ledger: Ledger, key: Any
) -> None:
    charge = make_charge(app, ledger)
    with pytest.raises(ValueError, match="idempotency_key"):
        charge.apply_async(("ord_1", 100), idempotency_key=key)
    assert len(ledger) == 0


@pytest.mark.parametrize(
    ("args", "field"),
    [
        pytest.param((object(), 100), "order_id", id="object"),
        pytest.param(("ord_1", 1j), "amount_cents", id="complex"),
        pytest.param(("ord_1", 100, {"lines": [{"sku": "a"}, {"sku": object()}]}),
                     "note.lines[1].sku", id="nested"),
    ],
)
def test_a_non_canonical_argument_raises_type_error_at_delay_naming_the_field(
    app: Celery, ledger: Ledger, args: tuple[Any, ...], field: str
) -> None:
    charge = make_charge(app, ledger)

    with pytest.raises(TypeError) as info:
        charge.delay(*args)

    assert repr(field) in str(info.value)
    assert len(ledger) == 0
    assert list(get_store(app).scan()) == []


def test_arguments_that_do_not_match_the_signature_raise_type_error_at_delay(
    app: Celery, ledger: Ledger
) -> None:
    charge = make_charge(app, ledger)
    with pytest.raises(TypeError, match="charge"):
        charge.delay("ord_1")  # amount_cents missing
    assert len(ledger) == 0


def test_a_result_backend_with_no_atomic_store_is_improperly_configured_at_delay(
    ledger: Ledger,
) -> None:
    # Given an app whose result backend cannot hold a claim, and no idempotency_store
    app = Celery("test_eager_rpc", set_as_current=False, backend="rpc://")
    app.conf.task_always_eager = True
    charge = make_charge(app, ledger)
    # When a task is sent, Then it is refused with the schemes that would work
    with pytest.raises(celery_idem.ImproperlyConfigured) as info:
        charge.delay("ord_1", 100)
    message = str(info.value)
    assert "rpc://" in message
    for scheme in ("redis://", "rediss://", "unix://", "db+postgresql://", "db+sqlite://",
                   "db+mysql://", "memory://"):
        assert scheme in message
    assert len(ledger) == 0


def test_an_unknown_idempotency_store_scheme_is_improperly_configured(ledger: Ledger) -> None:
    app = Celery("test_eager_bad_store", set_as_current=False)
    app.conf.task_always_eager = True
    app.conf.idempotency_store = "mongodb://localhost/idem"
    charge = make_charge(app, ledger)
    with pytest.raises(celery_idem.ImproperlyConfigured, match="mongodb://"):
        charge.delay("ord_1", 100)


def test_an_eager_app_without_any_backend_gets_a_memory_store(ledger: Ledger) -> None:
    app = Celery("test_eager_plain", set_as_current=False)
    app.conf.task_always_eager = True
    charge = make_charge(app, ledger)

    charge.delay("ord_1", 100)
    charge.delay("ord_1", 100)

    assert isinstance(get_store(app), MemoryStore)
    assert len(ledger) == 1


def test_each_app_has_its_own_store(ledger: Ledger) -> None:
    apps = []
    for name in ("test_eager_a", "test_eager_b"):
        app = Celery(name, set_as_current=False)
        app.conf.task_always_eager = True
        app.conf.idempotency_store = "memory://"
        apps.append(app)
    charges = [make_charge(app, ledger, name="shop.charge") for app in apps]

    for charge in charges:
        charge.delay("ord_1", 100)

    assert len(ledger) == 2
    assert get_store(apps[0]) is not get_store(apps[1])


def test_a_store_instance_and_the_key_prefix_setting_are_honoured(ledger: Ledger) -> None:
    store = MemoryStore(prefix="shop-idem:")
    app = Celery("test_eager_instance", set_as_current=False)
    app.conf.task_always_eager = True
    app.conf.idempotency_store = store
    charge = make_charge(app, ledger)

    charge.delay("ord_1", 100)

    assert get_store(app) is store
    assert [rec.state for rec in store.scan()] == [State.DONE]

    other = Celery("test_eager_prefix", set_as_current=False)
    other.conf.task_always_eager = True
    other.conf.idempotency_store = "memory://"
    other.conf.idempotency_key_prefix = "billing:"
    assert get_store(other).prefix == "billing:"


def test_a_key_func_decides_the_identity(app: Celery, ledger: Ledger) -> None:
    def by_order(order_id: str, *args: Any, **kwargs: Any) -> str:
        return order_id

    charge = make_charge(app, ledger, idempotency_key_func=by_order)

    r1 = charge.delay("ord_1", 100)
    r2 = charge.delay("ord_1", 250, note="another amount, same order")

    assert len(ledger) == 1
    assert r2.get() == r1.get()
    assert ledger.runs[0]["key"] == idempotency_key(charge.name, "ord_1")


def test_a_key_func_set_on_a_base_class_gets_only_the_call_arguments(
    app: Celery, ledger: Ledger
) -> None:
    seen: list[tuple[Any, ...]] = []

    def by_order(*args: Any, **kwargs: Any) -> str:
        seen.append(args)
        return str(args[0])

    class ByOrder(IdempotentTask):
        idempotency_key_func = by_order

    @app.task(base=ByOrder, shared=False)
    def refund(order_id: str) -> str:
        ledger.runs.append({"order_id": order_id})
        return "refunded"

    refund.delay("ord_1")

    assert seen == [("ord_1",)]


def test_a_key_func_that_returns_no_string_raises_type_error(app: Celery, ledger: Ledger) -> None:
    charge = make_charge(app, ledger, idempotency_key_func=lambda *a, **k: 17)
    with pytest.raises(TypeError, match="idempotency_key_func"):
        charge.delay("ord_1", 100)
    assert len(ledger) == 0


def test_the_operation_option_names_the_key(app: Celery, ledger: Ledger) -> None:
    charge = make_charge(app, ledger, idempotency_operation="charge_card")
    charge.delay("ord_1", 100)
    assert ledger.runs[0]["key"] == idempotency_key(
        "charge_card", order_id="ord_1", amount_cents=100, note=""
    )


def test_canonical_values_give_one_action_across_equal_forms(app: Celery, ledger: Ledger) -> None:
    @dataclasses.dataclass
    class Amount:
        value: decimal.Decimal
        currency: str

    @app.task(base=IdempotentTask, shared=False, idempotency_fields=("amount",))
    def pay(amount: Any, tags: Any = ()) -> str:
        ledger.runs.append({"amount": amount})
        return "paid"

    pay.delay({"value": 42.5, "currency": "EUR"})
    pay.delay(Amount(decimal.Decimal("42.50"), "EUR"))

    assert len(ledger) == 1
    pay.delay({"value": "42.5", "currency": "EUR"})  # text is not a number
    assert len(ledger) == 2


def test_a_terminal_error_is_answered_from_the_record_without_running(
    app: Celery, ledger: Ledger
) -> None:
    @app.task(base=IdempotentTask, shared=False)
    def decline(order_id: str) -> None:
        ledger.runs.append({"order_id": order_id})
        raise TerminalError(f"card declined for {order_id}")

    first = decline.delay("ord_1")
    second = decline.delay("ord_1")

    assert len(ledger) == 1
    assert first.state == second.state == "FAILURE"
    assert isinstance(second, CachedResult) and second.id == first.id
    with pytest.raises(TerminalError, match=r"^card declined for ord_1$"):
        second.get()


def test_validate_refuses_a_reused_per_call_key_with_other_arguments(
    app: Celery, ledger: Ledger
) -> None:
    # Given validation is on and a per-call key was used once
    charge = make_charge(app, ledger, idempotency_validate=True)
    charge.apply_async(("ord_1", 100), idempotency_key="k-1")
    # When the same key comes with other arguments, Then it is refused at enqueue: a mismatch,
    # not the old result, and nothing is sent
    with pytest.raises(celery_idem.IdempotencyKeyMismatch, match="Nothing was sent"):
        charge.apply_async(("ord_1", 999), idempotency_key="k-1")
    assert len(ledger) == 1


def test_validate_accepts_a_reused_key_with_the_same_arguments(
    app: Celery, ledger: Ledger
) -> None:
    charge = make_charge(app, ledger, idempotency_validate=True)
    r1 = charge.apply_async(("ord_1", 100), idempotency_key="k-1")
    r2 = charge.apply_async(("ord_1", 100), idempotency_key="k-1")
    assert len(ledger) == 1
    assert r2.get() == r1.get()


def test_a_timeout_class_error_releases_so_the_next_delay_runs_again(
    app: Celery, ledger: Ledger
) -> None:
    outcomes: list[Callable[[], Any]] = [
        lambda: (_ for _ in ()).throw(TimeoutError("provider slow")),
        lambda: "charged",
    ]

    @app.task(base=IdempotentTask, bind=True, shared=False)
    def flaky(self: Any, order_id: str) -> Any:
        ledger.runs.append({"token": self.idempotency_token})
        return outcomes[len(ledger) - 1]()

    first = flaky.delay("ord_1")
    second = flaky.delay("ord_1")

    assert first.state == "FAILURE" and isinstance(first.result, TimeoutError)
    assert second.get() == "charged"
    t1, t2 = (run["token"] for run in ledger.runs)
    assert t2 > t1  # the released claim's token is never issued again


def test_autoretry_runs_each_retry_through_the_gate_with_a_higher_token(
    app: Celery, ledger: Ledger
) -> None:
    @app.task(base=IdempotentTask, bind=True, shared=False, autoretry_for=(TimeoutError,),
              max_retries=3, default_retry_delay=0)
    def pay(self: Any, order_id: str) -> str:
        ledger.runs.append({"retries": self.request.retries, "token": self.idempotency_token,
                            "key": self.idempotency_key})
        if len(ledger) < 3:
            raise TimeoutError("provider slow")
        return "paid"

    first = pay.delay("ord_1")
    again = pay.delay("ord_1")

    assert first.get() == "paid"
    assert [run["retries"] for run in ledger.runs] == [0, 1, 2]
    tokens = [run["token"] for run in ledger.runs]
    assert tokens == sorted(set(tokens))  # strictly increasing: each retry takes over anew
    assert len({run["key"] for run in ledger.runs}) == 1  # the key is identical through retries
    assert isinstance(again, CachedResult) and again.id == first.id and again.get() == "paid"
    (rec,) = get_store(app).scan()
    assert (rec.state, rec.token, rec.attempt) == (State.DONE, tokens[-1], 2)


def test_a_call_that_does_not_bind_raises_typeerror_and_claims_nothing(app: Celery) -> None:
    runs: list[int] = []

    @app.task(base=IdempotentTask, shared=False, typing=False)
    def not_typed(x: int, y: int) -> int:
        runs.append(x)
        return x + y

    for _ in range(2):  # not held: the second identical call fails at once too
        with pytest.raises(TypeError, match="missing a required argument: 'y'"):
            not_typed.apply(args=(5,)).get()
    assert runs == []
    store = get_store(app)
    assert store.get(not_typed.idempotency_key_for((5,), {})) is None
    assert not_typed.apply(args=(2, 3)).get() == 5


def test_a_decorator_taking_any_arguments_is_not_refused_before_the_gate(app: Celery) -> None:
    import functools

    def inject(fun: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fun)  # the signature seen through __wrapped__ is fun's: (db, x)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            return fun("db", *args, **kwargs)
        return wrapper

    @app.task(base=IdempotentTask, shared=False, typing=False)
    @inject
    def uses_db(db: str, x: int) -> str:
        return f"{db}:{x}"

    assert uses_db.apply(args=(1,)).get() == "db:1"

