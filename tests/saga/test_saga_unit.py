"""The saga helper's decisions on the in-process store (eager mode): keys, replay, compensation.

The real-process behaviour (SIGKILL, redelivery, takeover) is in ``test_checkout.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery

from celery_idem import IdempotentTask, LeaseLost, TerminalError, idempotency_key
from celery_idem.contrib.saga import CompensationFailed, Saga, SagaFailed, Step, step_key
from celery_idem.records import State
from celery_idem.task import get_store


class World:
    """The effects the steps had, and faults to inject once."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.steps: list[Step] = []
        self.fail: dict[str, BaseException] = {}

    def effect(self, what: str) -> Any:
        def fn(step: Step, *args: Any, **kwargs: Any) -> Any:
            self.steps.append(step)
            fault = self.fail.pop(what, None)
            if fault is not None:
                raise fault
            self.log.append(what)
            return {"what": what, "args": list(args), "token": step.idempotency_token}
        return fn


def make_saga(app: Celery, world: World, with_block: bool = False) -> Any:
    @app.task(base=IdempotentTask, bind=True, shared=False, idempotency_fields=("order_id",))
    def checkout(self: Any, order_id: str, last: str = "c") -> Any:
        saga = Saga(self)
        a = saga.step("a", world.effect("a"), order_id, compensate=world.effect("undo-a"))
        saga.step("b", world.effect("b"), compensate=world.effect("undo-b"))
        saga.step("nocomp", world.effect("nocomp"))
        saga.step(last, world.effect(last), compensate=world.effect(f"undo-{last}"))
        return {"a": a, "results": list(saga.results)}

    return checkout


def test_each_step_runs_once_under_its_own_key(app: Celery) -> None:
    world = World()
    checkout = make_saga(app, world)
    out = checkout.apply(("o1",)).get()
    assert world.log == ["a", "b", "nocomp", "c"]
    assert out["a"] == {"what": "a", "args": ["o1"], "token": world.steps[0].idempotency_token}
    assert out["results"] == ["a", "b", "nocomp", "c"]
    saga_key = checkout.idempotency_key_for(("o1",))
    assert [s.idempotency_key for s in world.steps] == [
        step_key(saga_key, n) for n in ("a", "b", "nocomp", "c")]
    assert step_key(saga_key, "a") == idempotency_key("saga.a", saga_key)
    assert step_key(saga_key, "a", compensate=True) == idempotency_key("saga.a.compensate", saga_key)
    assert all(s.saga_key == saga_key for s in world.steps)
    # Each step's first claim of its own key: a clock token, exact in a double
    assert all(1_000_000_000_000_000 < s.idempotency_token < 2**53 for s in world.steps)
    store = get_store(app)
    assert store.get(step_key(saga_key, "c")).state is State.DONE  # type: ignore[union-attr]


def test_a_resumed_saga_replays_recorded_steps_and_runs_the_rest(app: Celery) -> None:
    world = World()
    checkout = make_saga(app, world)
    # A timeout-class error in step b releases step b and the saga (the run "crashed" there)
    world.fail["b"] = TimeoutError("provider timed out")
    with pytest.raises(TimeoutError):
        checkout.apply(("o2",)).get()
    assert world.log == ["a"]
    # The resumed run: a answers from its record, b runs (its claim was released), then the rest
    out = checkout.apply(("o2",)).get()
    assert world.log == ["a", "b", "nocomp", "c"]
    # the recorded result
    assert out["a"] == {"what": "a", "args": ["o2"], "token": world.steps[0].idempotency_token}
    assert [s.name for s in world.steps] == ["a", "b", "b", "nocomp", "c"]
    # b's second claim has a higher token than its first
    assert world.steps[2].idempotency_token > world.steps[1].idempotency_token


def test_a_terminal_step_compensates_completed_steps_newest_first_then_fails_the_saga(
    app: Celery,
) -> None:
    world = World()
    checkout = make_saga(app, world)
    world.fail["c"] = TerminalError("declined")
    with pytest.raises(SagaFailed) as failed:
        checkout.apply(("o3",)).get()
    assert world.log == ["a", "b", "nocomp", "undo-b", "undo-a"]
    assert failed.value.step == "c" and failed.value.compensated == ("b", "a")
    assert "TerminalError: declined" in str(failed.value)
    assert isinstance(failed.value.__cause__, TerminalError)
    undo = [s for s in world.steps if s.compensating]
    saga_key = checkout.idempotency_key_for(("o3",))
    assert [s.idempotency_key for s in undo] == [
        step_key(saga_key, "b", compensate=True), step_key(saga_key, "a", compensate=True)]
    # The saga is recorded as failed: a duplicate re-raises without running anything
    with pytest.raises(SagaFailed):
        checkout.apply(("o3",)).get()
    assert world.log == ["a", "b", "nocomp", "undo-b", "undo-a"]


def test_an_interrupted_compensation_run_resumes_and_compensates_each_step_once(app: Celery) -> None:
    world = World()
    checkout = make_saga(app, world)
    world.fail["c"] = TerminalError("declined")
    world.fail["undo-a"] = TimeoutError("refund timed out")  # after undo-b was recorded
    with pytest.raises(TimeoutError):
        checkout.apply(("o4",)).get()
    assert world.log == ["a", "b", "nocomp", "undo-b"]
    # Resumed: steps and c's failure answer from the store; undo-b replays; undo-a runs
    with pytest.raises(SagaFailed):
        checkout.apply(("o4",)).get()
    assert world.log == ["a", "b", "nocomp", "undo-b", "undo-a"]


def test_a_failed_compensation_is_named_and_the_others_still_run(app: Celery) -> None:
    world = World()
    checkout = make_saga(app, world)
    world.fail["c"] = TerminalError("declined")
    world.fail["undo-b"] = TerminalError("refund refused")
    with pytest.raises(CompensationFailed, match=r"compensation FAILED for: b \(TerminalError: "
                                                 r"refund refused\)") as failed:
        checkout.apply(("o5",)).get()
    assert world.log == ["a", "b", "nocomp", "undo-a"]
    assert failed.value.compensated == ("a",)


def test_a_terminal_error_between_steps_in_a_with_block_compensates(app: Celery) -> None:
    world = World()

    @app.task(base=IdempotentTask, bind=True, shared=False)
    def flow(self: Any, order_id: str) -> Any:
        with Saga(self) as saga:
            saga.step("a", world.effect("a"), compensate=world.effect("undo-a"))
            raise TerminalError("fraud check failed")

    with pytest.raises(SagaFailed, match=r"after step 'a'.*fraud check failed"):
        flow.apply(("o6",)).get()
    assert world.log == ["a", "undo-a"]


def test_bad_use_is_refused_with_a_clear_error(app: Celery) -> None:
    world = World()

    @app.task(base=IdempotentTask, bind=True, shared=False)
    def flow(self: Any, name: str, twice: bool = False) -> Any:
        saga = Saga(self)
        saga.step(name, world.effect("x"))
        if twice:
            saga.step(name, world.effect("x"))

    with pytest.raises(ValueError, match="step name must be 1-64 letters"):
        flow.apply(("has.dot",)).get()
    with pytest.raises(ValueError, match="already ran in this saga"):
        flow.apply(("dup", True)).get()
    with pytest.raises(RuntimeError, match="inside the running body"):
        Saga(flow)


def test_a_run_whose_saga_was_taken_over_starts_no_further_step(app: Celery) -> None:
    world = World()

    @app.task(base=IdempotentTask, bind=True, shared=False)
    def flow(self: Any, order_id: str) -> Any:
        saga = Saga(self)
        saga.step("a", world.effect("a"))
        # Another run takes the saga over (as after this run's lease ran out)
        store = get_store(app)
        store.release(self.idempotency_key, self.idempotency_token)
        store.claim(self.idempotency_key, owner="other", task_id="other", attempt=0, lease=60, ttl=600)
        saga.step("b", world.effect("b"))

    with pytest.raises(LeaseLost, match="step 'b' was not started"):
        flow.apply(("o7",)).get()
    assert world.log == ["a"]


def test_a_receipt_block_inside_a_step_is_refused_before_it_touches_the_database(
    app: Celery,
) -> None:
    # Given a saga whose step opens idempotent_transaction (keyed by the task, not the step)
    touched: list[str] = []

    class Session:  # never reached: the refusal comes before the session is looked at
        def __getattr__(self, name: str) -> Any:
            touched.append(name)
            raise AssertionError(f"the session was used: {name}")

    @app.task(base=IdempotentTask, bind=True, shared=False, idempotency_fields=("order_id",))
    def checkout(self: Any, order_id: str) -> Any:
        def write_order(step: Step) -> Any:
            with self.idempotent_transaction(Session()):
                return "written"

        return Saga(self).step("order", write_order)

    # When it runs, Then the step fails with an error that names the misuse, and nothing ran
    with pytest.raises(RuntimeError, match="inside a saga step"):
        checkout.apply(("o9",)).get()
    assert touched == []
