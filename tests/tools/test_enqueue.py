"""What is (and is not) enqueued, with no worker consuming the queue."""

from __future__ import annotations

import base64
import json
from typing import Any

import anyio
from mcp import Client

from celery_idem.contrib.mcp import server
from celery_idem.contrib.tools import Toolbox, tool
from tests.tools.app import charge_card, toolbox
from tests.tools.conftest import Env


def test_bad_arguments_are_an_error_result_and_nothing_is_enqueued(idle: Env) -> None:
    tools = Toolbox([tool(charge_card, timeout=0.2)])
    bad = [
        ("charge_card", '{"order_id": "o1"}', "missing required argument 'amount_cents'"),
        ("charge_card", '{"order_id": "o1", "amount_cents": 5, "tip": 1}', "unknown argument 'tip'"),
        ("charge_card", '{"order_id": "o1", "amount_cents": "5"}', "must be integer"),
        ("charge_card", '{"order_id": "o1", amount_cents: 5}', "not valid JSON"),
        ("charge_card", '["o1", 5]', "must be a JSON object"),
    ]
    for name, arguments, problem in bad:
        out = tools.call(name, arguments)
        assert out["status"] == "error" and out["error"] == "InvalidArguments", out
        assert problem in out["message"] and "Nothing was done" in out["message"], out
        assert out["task_id"] is None
        json.dumps(out)
    assert idle.queued() == 0
    # The same tool with good arguments does enqueue (so the count above can see a message)
    out = tools.call("charge_card", '{"order_id": "o1", "amount_cents": 5}')
    assert out["status"] == "in_progress" and out["task_id"], out
    assert idle.queued() == 1


def test_pending_exposes_the_task_id_and_key_before_waiting(idle: Env) -> None:
    pending = tool(charge_card).start({"order_id": "o2", "amount_cents": 6})
    assert pending.task_id and not pending.answered_at_enqueue
    assert pending.idempotency_key == charge_card.idempotency_key_for(
        kwargs={"order_id": "o2", "amount_cents": 6})
    assert pending.wait(timeout=0.1)["status"] == "in_progress"


def test_a_broker_that_does_not_answer_is_a_retryable_error() -> None:
    from celery import Celery

    from celery_idem import IdempotentTask
    from tests.integration.harness import free_port

    app = Celery("nobroker", broker=f"redis://127.0.0.1:{free_port()}/0", set_as_current=False)
    app.conf.idempotency_store = "memory://"
    app.conf.broker_connection_timeout = 0.5  # fail fast: nothing listens there
    app.conf.broker_transport_options = {"max_retries": 0}

    @app.task(base=IdempotentTask, name="nobroker.pay")
    def pay(order_id: str) -> str:
        return order_id

    out = tool(pay, options={"retry": False}).invoke({"order_id": "o1"})
    assert out["status"] == "error" and out["retryable"] is True, out
    assert out["error"] == "OperationalError"
    assert "could not be started" in out["message"] and "is safe" in out["message"]
    assert ".." not in out["message"]
    assert out["idempotency_key"] == pay.idempotency_key_for(kwargs={"order_id": "o1"})


def test_bad_arguments_and_unknown_tools_are_tool_errors_and_nothing_is_enqueued(idle: Env) -> None:
    async def main() -> list[Any]:
        async with Client(server(toolbox)) as client:
            return [await client.call_tool("charge_card", {"order_id": "o1"}),
                    await client.call_tool("charge_card", {"order_id": "o1", "amount_cents": "5"}),
                    await client.call_tool("no_such_tool", {})]

    missing, wrong, unknown = anyio.run(main)
    assert missing.is_error and missing.structured_content["error"] == "InvalidArguments"
    assert "missing required argument 'amount_cents'" in missing.content[0].text
    assert wrong.is_error and "must be integer" in wrong.structured_content["message"]
    assert unknown.is_error and unknown.structured_content["error"] == "UnknownTool"
    assert idle.queued() == 0


def test_a_key_argument_the_task_has_is_passed_on_and_used_verbatim(idle: Env) -> None:
    # order_id is one of charge_card's own parameters: it is the key and the task still gets it
    keyed = tool(charge_card, key_argument="order_id", timeout=0.1)
    assert keyed.parameters == tool(charge_card).parameters
    pending = keyed.start({"order_id": "ord-as-key", "amount_cents": 5})
    # The caller's key, in charge_card's namespace (it can name no other task's action)
    assert pending.idempotency_key == charge_card.idempotency_key_for(
        kwargs={"order_id": "ord-as-key", "amount_cents": 5}, idempotency_key="ord-as-key") \
        == "tests.tools.app.charge_card:key=ord-as-key"
    message = json.loads(idle.client.lindex(idle.queue, 0))  # type: ignore[arg-type]
    assert message["headers"]["idempotency_key"] == pending.idempotency_key
    assert json.loads(base64.b64decode(message["body"]))[1] == \
        {"order_id": "ord-as-key", "amount_cents": 5}


def test_a_key_argument_the_task_lacks_is_not_passed_on(idle: Env) -> None:
    keyed = tool(charge_card, key_argument="request_key", timeout=0.1)
    assert "request_key" not in keyed.parameters["required"]
    # Without it, the key is derived as usual
    plain = keyed.start({"order_id": "o3", "amount_cents": 5})
    assert plain.idempotency_key == charge_card.idempotency_key_for(
        kwargs={"order_id": "o3", "amount_cents": 5})
    too_long = keyed.invoke({"order_id": "o3", "amount_cents": 5, "request_key": "k" * 201})
    assert too_long["status"] == "error" and too_long["error"] == "InvalidArguments", too_long
    assert idle.queued() == 1  # only the first call was sent
