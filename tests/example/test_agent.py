"""The scripted agent's runtime without a broker: plan, re-call on error, resume from checkpoint."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from example_app.agent import Agent, ScriptedModel, Tool, order_details


class Done:
    """A finished task result."""

    def __init__(self, value: Any, task_id: str) -> None:
        self.value, self.id = value, task_id

    def ready(self) -> bool:
        return True

    def get(self, **_: Any) -> Any:
        return self.value


class Never(Done):
    """A task that never finishes (the agent's budget runs out)."""

    def ready(self) -> bool:
        return False


class FakeTask:
    def __init__(self, name: str, results: list[type[Done]] | None = None) -> None:
        self.name = name
        self.calls: list[dict[str, Any]] = []
        self.results = list(results or [])

    def apply_async(self, kwargs: dict[str, Any]) -> Done:
        self.calls.append(kwargs)
        cls = self.results.pop(0) if self.results else Done
        return cls({"id": f"{self.name}-{len(self.calls)}", **kwargs}, f"t-{self.name}-{len(self.calls)}")


def tools(**results: list[type[Done]]) -> tuple[dict[str, Tool], dict[str, FakeTask]]:
    fakes = {n: FakeTask(n, results.get(n)) for n in ("charge_card", "create_shipment", "send_email")}
    reg = {"lookup_order": Tool("lookup_order", "read", "", ("order_id",),
                                lambda order_id: order_details(order_id))}
    reg.update({n: Tool(n, "write", "", (), t) for n, t in fakes.items()})
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


def test_a_result_that_looks_like_an_error_makes_the_model_call_the_tool_again() -> None:
    reg, fakes = tools(charge_card=[Never])
    state = Agent(reg, ScriptedModel(), timeouts={"charge_card": 0.1}).run("ord_b")
    assert len(fakes["charge_card"].calls) == 2
    assert fakes["charge_card"].calls[0] == fakes["charge_card"].calls[1]
    assert state["events"] == ["re-called charge_card"]
    errors = [m for m in state["messages"] if m["role"] == "tool" and "error" in m["content"]]
    assert len(errors) == 1 and "0.1 s" in errors[0]["content"]["error"]


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
