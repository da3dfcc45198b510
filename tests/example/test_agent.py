"""The scripted agent's runtime without a broker: plan, re-call on error, resume from checkpoint."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from celery_idem.contrib.tools import tool
from example_app.agent import Agent, NaiveTool, ScriptedModel, order_details


class Done:
    """A started call that finishes: the tool's outcome is ``ok``."""

    answered_at_enqueue = False

    def __init__(self, name: str, value: Any, task_id: str) -> None:
        self.name, self.value, self.task_id = name, value, task_id
        self.idempotency_key = f"key-{name}"

    def wait(self, timeout: float) -> dict[str, Any]:
        return {"status": "ok", "result": self.value, "message": "", "tool": self.name,
                "task_id": self.task_id, "idempotency_key": self.idempotency_key}


class Never(Done):
    """A call whose task never finishes: the agent's budget runs out."""

    def wait(self, timeout: float) -> dict[str, Any]:
        return {"status": "in_progress", "result": None, "tool": self.name,
                "message": f"{self.name} is still in progress after {timeout:g} s",
                "task_id": self.task_id, "idempotency_key": self.idempotency_key}


class FakeTool:
    """A write tool (the interface of celery_idem.contrib.tools.Tool) that records its calls."""

    kind = "write"

    def __init__(self, name: str, results: list[type[Done]] | None = None) -> None:
        self.name = name
        self.calls: list[dict[str, Any]] = []
        self.results = list(results or [])

    def start(self, arguments: dict[str, Any]) -> Done:
        self.calls.append(arguments)
        cls = self.results.pop(0) if self.results else Done
        n = len(self.calls)
        return cls(self.name, {"id": f"{self.name}-{n}", **arguments}, f"t-{self.name}-{n}")


def tools(**results: list[type[Done]]) -> tuple[dict[str, Any], dict[str, FakeTool]]:
    fakes = {n: FakeTool(n, results.get(n)) for n in ("charge_card", "create_shipment", "send_email")}
    reg: dict[str, Any] = {"lookup_order": tool(order_details, kind="read", name="lookup_order")}
    reg.update(fakes)
    return reg, fakes


def test_the_script_looks_up_then_charges_ships_and_confirms(tmp_path: Path) -> None:
    reg, fakes = tools()
    state = Agent(reg, ScriptedModel(), checkpoint=tmp_path / "c.json").run("ord_a")
    order = order_details("ord_a")
    assert fakes["charge_card"].calls == [{"order_id": "ord_a", "amount_cents": order["amount_cents"],
                                           "currency": "usd"}]
    assert fakes["create_shipment"].calls == [{"order_id": "ord_a", "address": order["address"]}]
    assert fakes["send_email"].calls == [{"to": order["email"], "template": "order_confirmed",
                                          "order_id": "ord_a"}]
    assert state["messages"][-1]["role"] == "assistant" and "is paid" in state["messages"][-1]["content"]
    assert json.loads((tmp_path / "c.json").read_text()) == state
    assert state["events"] == []


def test_an_in_progress_answer_makes_the_model_call_the_tool_again() -> None:
    reg, fakes = tools(charge_card=[Never])
    state = Agent(reg, ScriptedModel(), timeouts={"charge_card": 0.1}).run("ord_b")
    assert len(fakes["charge_card"].calls) == 2
    assert fakes["charge_card"].calls[0] == fakes["charge_card"].calls[1]
    assert state["events"] == ["re-called charge_card"]
    waiting = [m for m in state["messages"]
               if m["role"] == "tool" and m["content"]["status"] == "in_progress"]
    assert len(waiting) == 1 and "0.1 s" in waiting[0]["content"]["message"]
    assert all(m.get("idempotency_key") == "key-charge_card" for m in state["messages"]
               if m.get("name") == "charge_card")


def test_the_model_gives_up_after_two_calls() -> None:
    reg, fakes = tools(charge_card=[Never, Never])
    state = Agent(reg, ScriptedModel(), timeouts={"charge_card": 0.05}, default_timeout=0.05).run("ord_c")
    assert len(fakes["charge_card"].calls) == 2 and fakes["create_shipment"].calls == []
    assert state["messages"][-1]["content"].startswith("Sorry, charge_card failed")


def test_a_call_without_a_result_in_the_checkpoint_is_issued_again(tmp_path: Path) -> None:
    # Given a checkpoint written by a process that died right after enqueueing create_shipment
    reg, fakes = tools()
    checkpoint = tmp_path / "c.json"
    Agent(reg, ScriptedModel(), checkpoint=checkpoint).run("ord_d")
    state = json.loads(checkpoint.read_text())
    cut = next(i for i, m in enumerate(state["messages"])
               if m.get("tool_call", {}).get("name") == "create_shipment")
    state["messages"] = state["messages"][: cut + 1]
    checkpoint.write_text(json.dumps(state))
    # When a new agent starts from it
    reg2, fakes2 = tools()
    resumed = Agent(reg2, ScriptedModel(), checkpoint=checkpoint).run("ord_d")
    # Then it issues the same call again, does not repeat the finished charge, and finishes
    assert fakes2["charge_card"].calls == []
    assert fakes2["create_shipment"].calls == fakes["create_shipment"].calls
    assert len(fakes2["send_email"].calls) == 1
    assert resumed["events"] == ["resumed from checkpoint", "re-issued create_shipment"]


class Declined(Done):
    """A call that fails for good (a terminal error)."""

    def wait(self, timeout: float) -> dict[str, Any]:
        return {"status": "error", "result": None, "tool": self.name, "error": "TerminalError",
                "retryable": False, "message": f"{self.name} failed for good: card declined",
                "task_id": self.task_id, "idempotency_key": self.idempotency_key}


def test_an_error_that_is_not_retryable_is_not_called_again() -> None:
    reg, fakes = tools(charge_card=[Declined])
    state = Agent(reg, ScriptedModel()).run("ord_e")
    assert len(fakes["charge_card"].calls) == 1 and fakes["create_shipment"].calls == []
    assert "card declined" in state["messages"][-1]["content"]


class FinishedResult:
    """A Celery result that is ready after ``polls`` not-ready polls, each taking ``stall`` s."""

    id = "t-naive"

    def __init__(self, polls: int = 0, stall: float = 0.0) -> None:
        self.polls, self.stall = polls, stall

    def ready(self) -> bool:
        _busy(self.stall)  # the process is too busy to look sooner
        self.polls -= 1
        return self.polls < 0

    def get(self, timeout: float, interval: float) -> dict[str, str]:
        return {"id": "ch_1"}


class SlowPublish:
    """A plain task whose ``apply_async`` returns ``publish`` s late, its result ready by then."""

    def __init__(self, result: FinishedResult, publish: float = 0.0) -> None:
        self.result, self.publish = result, publish

    def apply_async(self, kwargs: dict[str, Any]) -> FinishedResult:
        _busy(self.publish)
        return self.result


def _busy(seconds: float) -> None:
    """Take ``seconds`` of wall time, as a loaded machine does (a stand-in, not a wait on anything)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(0.01)


def test_a_naive_call_is_ok_when_its_result_comes_within_the_budget() -> None:
    pending = NaiveTool("charge_card", SlowPublish(FinishedResult(polls=2))).start({})
    outcome = pending.wait(5.0)
    assert outcome["status"] == "ok" and outcome["result"] == {"id": "ch_1"}, outcome


def test_a_naive_calls_budget_runs_from_the_enqueue_not_from_the_wait() -> None:
    # The publish returns after the budget, with the task already done: the wait ran out.
    pending = NaiveTool("charge_card", SlowPublish(FinishedResult(), publish=0.3)).start({})
    outcome = pending.wait(0.1)
    assert outcome["status"] == "error" and outcome["error"] == "Timeout", outcome
    assert outcome["message"] == "charge_card gave no result within 0.1 s"


def test_a_naive_result_first_seen_after_the_deadline_is_late() -> None:
    # The only poll starts in time but returns after the deadline, with the result there.
    pending = NaiveTool("charge_card", SlowPublish(FinishedResult(stall=0.3))).start({})
    outcome = pending.wait(0.1)
    assert outcome["status"] == "error" and outcome["error"] == "Timeout", outcome
