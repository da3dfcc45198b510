"""Tool calls through a real ``celery worker``: what the model sees, and how often the body ran.

One worker (threads pool) serves the whole module; every test uses its own order ids.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest

from celery_idem.contrib.tools import Toolbox, ToolError, tool
from celery_idem.records import State
from celery_idem.task import get_store
from tests.integration.harness import wait_for
from tests.tools.app import (
    cancel_order,
    charge_card,
    charge_untyped,
    create_shipment,
    refund,
    stock_level,
)
from tests.tools.conftest import Env

pytestmark = pytest.mark.worker

#: A call's wait, generous for a loaded machine; it never delays a passing test.
WAIT = 60.0


def order() -> str:
    return f"ord_{uuid.uuid4().hex[:8]}"


def box() -> Toolbox:
    return Toolbox([tool(charge_card, timeout=WAIT), tool(refund, timeout=WAIT),
                    tool(cancel_order, timeout=WAIT), tool(create_shipment, timeout=WAIT),
                    tool(stock_level, kind="read", timeout=WAIT)])


def no_traceback(out: dict[str, Any]) -> None:
    text = json.dumps(out)
    assert "Traceback" not in text and 'File "' not in text and "\\n" not in out["message"], text


def test_an_openai_tool_call_is_dispatched_and_answered_as_a_tool_message(live: Env) -> None:
    # Given a model's tool call, as the Chat Completions API returns it (arguments: JSON text)
    oid = order()
    call = {"id": "call_1", "type": "function",
            "function": {"name": "charge_card",
                         "arguments": json.dumps({"order_id": oid, "amount_cents": 4200})}}
    # When the toolbox runs it
    message = box().openai_message(call)
    # Then the reply is the tool message the API expects, and the body ran once
    assert message["role"] == "tool" and message["tool_call_id"] == "call_1"
    out = json.loads(message["content"])
    assert out["status"] == "ok", out
    assert out["result"] == {"charge_id": f"ch_{oid}_4200", "amount_cents": 4200,
                             "currency": "usd", "effects": 1}
    assert out["idempotency_key"] == charge_card.idempotency_key_for(
        kwargs={"order_id": oid, "amount_cents": 4200})
    assert live.effects(f"charge:{oid}") == [out["task_id"]]


def test_an_anthropic_tool_use_block_gets_a_tool_result_block(live: Env) -> None:
    oid = order()
    block = {"type": "tool_use", "id": "toolu_1", "name": "charge_card",
             "input": {"order_id": oid, "amount_cents": 100, "currency": "eur"}}
    result = box().anthropic_block(block)
    assert result["type"] == "tool_result" and result["tool_use_id"] == "toolu_1"
    assert result["is_error"] is False
    assert json.loads(result["content"])["result"]["currency"] == "eur"


def test_a_repeated_call_is_a_success_with_the_first_result_and_the_body_ran_once(live: Env) -> None:
    oid = order()
    charge = box()["charge_card"]
    first = charge(order_id=oid, amount_cents=500)
    again = charge(order_id=oid, amount_cents=500)
    assert first["status"] == "ok" and again["status"] == "duplicate", (first, again)
    assert again["result"] == first["result"]
    assert again["task_id"] == first["task_id"]  # answered from the record: nothing enqueued
    assert again["idempotency_key"] == first["idempotency_key"]
    assert "was not done again" in again["message"]
    assert live.effects(f"charge:{oid}") == [first["task_id"]]


def test_two_calls_at_once_run_the_body_once_and_both_get_its_result(live: Env) -> None:
    # Given two calls of the same action enqueued while neither has finished (two agent turns)
    oid = order()
    charge = box()["charge_card"]
    arguments = {"order_id": oid, "amount_cents": 700, "hold": True}
    a, b = charge.start(arguments), charge.start(arguments)
    # The second attached to the first: one message, the same task id
    assert b.attached and not a.attached and b.task_id == a.task_id
    assert not a.answered_at_enqueue and not b.answered_at_enqueue
    # When the body is let go
    live.release(oid)
    outs = [a.wait(), b.wait()]
    # Then one ran it, the other got its result by following it (a success too)
    assert sorted(o["status"] for o in outs) == ["duplicate", "ok"], outs
    assert outs[0]["result"] == outs[1]["result"]
    assert len(live.effects(f"charge:{oid}")) == 1


def test_a_wait_that_runs_out_says_in_progress_and_a_later_call_gets_the_result(live: Env) -> None:
    oid = order()
    charge = box()["charge_card"]
    arguments = {"order_id": oid, "amount_cents": 900, "hold": True}
    # The body is still running when the tool's wait runs out
    first = charge.invoke(arguments, timeout=0.5)
    assert first["status"] == "in_progress", first
    assert first["result"] is None and first["task_id"] and first["idempotency_key"]
    assert "safe to call it again with the same arguments" in first["message"]
    assert live.effects(f"charge:{oid}") == []
    # The model calls again (as the message invites) after the action finished
    live.release(oid)
    wait_for(lambda: live.effects(f"charge:{oid}"), timeout=WAIT, what="the charge")
    again = charge.invoke(json.dumps(arguments))
    assert again["status"] == "duplicate", again
    assert again["result"]["charge_id"] == f"ch_{oid}_900"
    assert again["idempotency_key"] == first["idempotency_key"]
    assert live.effects(f"charge:{oid}") == [first["task_id"]]


def test_a_call_repeated_while_in_progress_waits_for_the_first_one(live: Env) -> None:
    oid = order()
    charge = box()["charge_card"]
    arguments = {"order_id": oid, "amount_cents": 901, "hold": True}
    first = charge.invoke(arguments, timeout=0.3)
    assert first["status"] == "in_progress"
    # The first call's body holds the claim (on a loaded machine the worker may take a while)
    store = get_store(charge_card.app)
    wait_for(lambda: (rec := store.get(first["idempotency_key"])) is not None
             and rec.state is State.IN_PROGRESS, timeout=WAIT, what="the first call's claim")
    second = charge.start(arguments)  # enqueued: the key is still in progress
    live.release(oid)
    out = second.wait()
    assert out["status"] == "duplicate" and out["result"]["amount_cents"] == 901, out
    assert live.effects(f"charge:{oid}") == [first["task_id"]]


def test_a_terminal_error_is_an_error_the_model_should_not_retry(live: Env) -> None:
    charge_id = f"ch_{uuid.uuid4().hex[:8]}"
    tools = box()
    out = tools.call("refund", {"charge_id": charge_id})
    assert out["status"] == "error" and out["error"] == "TerminalError", out
    assert out["retryable"] is False and out["result"] is None
    assert f"charge {charge_id} was already refunded" in out["message"]
    assert "returns the same error" in out["message"]
    no_traceback(out)
    # Calling again gives the same error from the record; the body does not run again
    again = tools.call("refund", {"charge_id": charge_id})
    assert {k: again[k] for k in ("status", "error", "retryable")} == \
        {"status": "error", "error": "TerminalError", "retryable": False}
    assert tools.anthropic_block({"id": "t", "name": "refund",
                                  "input": {"charge_id": charge_id}})["is_error"] is True
    assert live.effects(f"refund:{charge_id}") == ["1"]


def test_an_unexpected_error_is_retryable_and_shows_no_stack_trace(live: Env) -> None:
    oid = order()
    out = box().call("cancel_order", {"order_id": oid})
    assert out["status"] == "error" and out["error"] == "RuntimeError", out
    assert out["retryable"] is True
    # Its text stays in the server's log (tests/tools/test_edge.py): the model gets an id
    assert oid not in out["message"] and out["error_id"] in out["message"]
    no_traceback(out)


def test_reusing_an_action_with_other_arguments_is_refused_before_enqueue(live: Env) -> None:
    oid = order()
    ship = box()["create_shipment"]
    first = ship(order_id=oid, address="1 Main St")
    assert first["status"] == "ok", first
    out = ship(order_id=oid, address="2 Other Rd")
    assert out["status"] == "error" and out["error"] == "IdempotencyKeyMismatch", out
    assert out["retryable"] is False and out["task_id"] is None
    assert "different arguments" in out["message"]
    assert live.effects(f"shipment:{oid}") == ["1"]


def test_a_read_tool_on_a_plain_task_is_not_gated(live: Env) -> None:
    sku = f"sku_{uuid.uuid4().hex[:8]}"
    stock = box()["stock_level"]
    outs = [stock(sku=sku), stock(sku=sku)]
    assert [o["status"] for o in outs] == ["ok", "ok"], outs
    assert [o["result"]["lookups"] for o in outs] == [1, 2]  # it ran twice
    assert all(o["idempotency_key"] is None for o in outs)
    assert outs[0]["task_id"] != outs[1]["task_id"]
    # and no record was written for it
    assert list(live.client.scan_iter(match=f"{live.prefix}*stock_level*")) == []


def test_a_read_function_runs_in_process_every_time(live: Env) -> None:
    calls: list[str] = []

    def lookup_order(order_id: str) -> dict[str, Any]:
        """Look up an order."""
        calls.append(order_id)
        return {"order_id": order_id, "paid": False}

    read = tool(lookup_order, kind="read")
    assert read(order_id="o1")["status"] == "ok" and read(order_id="o1")["status"] == "ok"
    assert calls == ["o1", "o1"]


def test_the_langchain_tool_runs_the_same_call(live: Env) -> None:
    import langchain_core  # noqa: F401  (in the dev extra: a missing one fails, never skips)
    oid = order()
    lc = box()["charge_card"].langchain()
    assert lc.name == "charge_card" and "Safe to call again" in lc.description
    message = lc.invoke({"type": "tool_call", "id": "c9", "name": "charge_card",
                         "args": {"order_id": oid, "amount_cents": 42}})
    assert message.tool_call_id == "c9"
    assert json.loads(message.content)["status"] == "ok"
    again = lc.invoke({"order_id": oid, "amount_cents": 42})
    assert again["status"] == "duplicate"
    assert len(live.effects(f"charge:{oid}")) == 1



# -- a number's spelling, untyped arguments, and what a duplicate says ---------------------------


def test_every_spelling_of_a_number_is_one_charge_and_text_is_refused(live: Env) -> None:
    oid, tools = order(), box()
    # Given the spellings a model, an HTTP client or another SDK may send for 4200 cents
    first = tools.call("charge_card", {"order_id": oid, "amount_cents": 4200})
    as_float = tools.call("charge_card", {"order_id": oid, "amount_cents": 4200.0})
    as_exponent = tools.call("charge_card", f'{{"order_id": "{oid}", "amount_cents": 4.2e3}}')
    as_text = tools.call("charge_card", {"order_id": oid, "amount_cents": "4200"})
    # Then the numbers are one action, charged once; its body got an int
    assert first["status"] == "ok", first
    assert as_float["status"] == as_exponent["status"] == "duplicate", (as_float, as_exponent)
    assert as_float["idempotency_key"] == first["idempotency_key"]
    assert as_float["result"] == first["result"] == {
        "charge_id": f"ch_{oid}_4200", "amount_cents": 4200, "currency": "usd", "effects": 1}
    # And text for an int is refused before anything is sent, naming the type expected
    assert as_text["status"] == "error" and as_text["error"] == "InvalidArguments", as_text
    assert "argument 'amount_cents' must be integer (a JSON number, not text)" in as_text["message"]
    assert "Nothing was done" in as_text["message"]
    assert live.effects(f"charge:{oid}") == [first["task_id"]]


def test_a_write_tool_refuses_untyped_arguments_unless_told(live: Env) -> None:
    # The README's task has no type hints: a model's "4200" would reach its body
    with pytest.raises(ToolError, match=r"parameters order_id, amount_cents, note have no type "
                                        r"annotation.*amount_cents: int.*untyped=True"):
        tool(charge_untyped)
    # Told so, it takes any JSON value; the numbers are still one action (the key's number form)
    untyped = tool(charge_untyped, untyped=True, timeout=WAIT)
    oid = order()
    first = untyped(order_id=oid, amount_cents=4200)
    again = untyped(order_id=oid, amount_cents=4200.0)
    assert [first["status"], again["status"]] == ["ok", "duplicate"], (first, again)
    assert len(live.effects(f"untyped:{oid}")) == 1


def test_a_duplicate_says_what_defined_the_action_and_what_differs(live: Env) -> None:
    # Given the quick start's task: the key is the order and the amount, not the currency
    oid, tools = order(), box()
    usd = tools.call("charge_card", {"order_id": oid, "amount_cents": 4200})
    # When the same order and amount come again in another currency
    eur = tools.call("charge_card", {"order_id": oid, "amount_cents": 4200, "currency": "eur"})
    # Then the answer is the recorded USD charge, and the message says so truthfully
    assert eur["status"] == "duplicate" and eur["result"]["currency"] == "usd", eur
    assert f'already been done for order_id="{oid}", amount_cents=4200' in eur["message"]
    assert "with these arguments" not in eur["message"]
    assert "currency differs from the recorded call; it is not part of this action's key" \
        in eur["message"]
    # And a repeat that spells the default out differs in nothing
    same = tools.call("charge_card", {"order_id": oid, "amount_cents": 4200, "currency": "usd"})
    assert same["status"] == "duplicate" and "differs" not in same["message"], same
    assert live.effects(f"charge:{oid}") == [usd["task_id"]]


def test_an_attached_call_says_what_defined_the_action_and_what_differs(live: Env) -> None:
    # Given a USD charge still running, and the same order and amount in EUR while it runs
    oid, charge = order(), box()["charge_card"]
    usd = charge.start({"order_id": oid, "amount_cents": 800, "hold": True})
    eur = charge.start({"order_id": oid, "amount_cents": 800, "hold": True, "currency": "eur"})
    # The second follows the first: nothing was sent for it
    assert eur.attached and eur.task_id == usd.task_id
    live.release(oid)
    first, second = usd.wait(), eur.wait()
    # Then it answers with the USD charge, and says which values defined the action and which
    # of its arguments were not part of it
    assert first["status"] == "ok" and second["status"] == "duplicate", (first, second)
    assert second["result"]["currency"] == "usd"
    assert f'already been done for order_id="{oid}", amount_cents=800' in second["message"], second
    assert "with these arguments" not in second["message"]
    assert "currency differs from the recorded call; it is not part of this action's key" \
        in second["message"], second
    assert live.effects(f"charge:{oid}") == [usd.task_id]
