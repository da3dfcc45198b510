"""The tool schemas checked by what consumes them, not by our own expectations.

- the JSON Schema 2020-12 metaschema (``jsonschema``), for every input schema and the outcome
  schema;
- the request types of the official ``openai`` and ``anthropic`` SDKs (their TypedDicts,
  validated by pydantic), and a real request through each SDK's client, answered by a mock
  transport on no network;
- the ``mcp`` SDK's ``Tool`` model.

No worker: nothing here runs a task.
"""

from __future__ import annotations

import json
from typing import Any

import anthropic
import jsonschema
import openai
import pytest
from anthropic.types import ToolParam
from mcp import types as mcp_types
from openai.types.chat import ChatCompletionToolParam
from openai.types.responses import FunctionToolParam
from pydantic import TypeAdapter

from celery_idem.contrib.tools import OUTCOME_SCHEMA, Tool, Toolbox, tool
from tests.tools.app import charge_card, toolbox
from tests.tools.support import anthropic_reply, mock_client, openai_reply


def every_tool() -> list[Tool]:
    def lookup_order(order_id: str, include_payments: bool = True) -> dict[str, Any]:
        """Look up an order."""
        return {"order_id": order_id, "payments": [] if include_payments else None}

    return [*toolbox, tool(lookup_order, kind="read")]


def keys_allowed(value: dict[str, Any], typed: Any) -> None:
    """A TypedDict ignores unknown keys when validated; the API would refuse them."""
    unknown = set(value) - set(typed.__annotations__)
    assert not unknown, f"{sorted(unknown)} are not fields of {typed.__name__}"


@pytest.mark.parametrize("t", every_tool(), ids=lambda t: t.name)
def test_every_input_schema_is_valid_json_schema_2020_12(t: Tool) -> None:
    jsonschema.Draft202012Validator.check_schema(t.parameters)
    if t.name == "charge_card":
        jsonschema.Draft202012Validator.check_schema(t.openai(strict=True)["function"]["parameters"])


def test_the_outcome_schema_is_valid_and_matches_real_outcomes() -> None:
    jsonschema.Draft202012Validator.check_schema(OUTCOME_SCHEMA)
    validator = jsonschema.Draft202012Validator(OUTCOME_SCHEMA)
    t = every_tool()[-1]
    outcomes = [t.invoke({"order_id": "o1"}), t.invoke({"order_id": 5}),
                Toolbox([t]).call("nope", {})]
    assert [o["status"] for o in outcomes] == ["ok", "error", "error"]
    for outcome in outcomes:
        validator.validate(outcome)


@pytest.mark.parametrize("t", every_tool(), ids=lambda t: t.name)
def test_openai_chat_and_responses_tool_params_accept_the_tool(t: Tool) -> None:
    chat = TypeAdapter(ChatCompletionToolParam).validate_python(t.openai())
    keys_allowed(chat, ChatCompletionToolParam)
    keys_allowed(chat["function"], openai.types.shared_params.FunctionDefinition)
    flat = TypeAdapter(FunctionToolParam).validate_python(t.openai(api="responses"))
    keys_allowed(flat, FunctionToolParam)


@pytest.mark.parametrize("t", every_tool(), ids=lambda t: t.name)
def test_the_anthropic_tool_param_accepts_the_tool(t: Tool) -> None:
    spec = TypeAdapter(ToolParam).validate_python(t.anthropic())
    keys_allowed(spec, ToolParam)
    assert spec["input_schema"]["type"] == "object"


@pytest.mark.parametrize("t", every_tool(), ids=lambda t: t.name)
def test_the_mcp_tool_model_accepts_the_tool(t: Tool) -> None:
    listed = mcp_types.Tool.model_validate(t.mcp())
    assert listed.input_schema == t.parameters
    assert listed.model_dump(by_alias=True, exclude_none=True)["inputSchema"] == t.parameters


def test_the_openai_client_sends_the_tools_and_its_tool_call_is_answered() -> None:
    lookup = every_tool()[-1]
    tools = Toolbox([lookup, tool(charge_card)])
    reply = openai_reply("lookup_order", {"order_id": "o7"})
    sent: list[dict[str, Any]] = []
    client = openai.OpenAI(api_key="test", base_url="http://127.0.0.1:9/v1",
                           http_client=mock_client(reply, sent), max_retries=0)
    response = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "look up o7"}], tools=tools.openai())
    assert sent[0]["tools"] == tools.openai()
    message = tools.openai_message(response.choices[0].message.tool_calls[0])  # type: ignore[index]
    assert message["tool_call_id"] == "call_1"
    assert json.loads(message["content"])["result"]["order_id"] == "o7"


def test_the_anthropic_client_sends_the_tools_and_its_tool_use_is_answered() -> None:
    lookup = every_tool()[-1]
    tools = Toolbox([lookup, tool(charge_card)])
    reply = anthropic_reply("lookup_order", {"order_id": "o8", "include_payments": False})
    sent: list[dict[str, Any]] = []
    client = anthropic.Anthropic(api_key="test", base_url="http://127.0.0.1:9",
                                 http_client=mock_client(reply, sent), max_retries=0)
    response = client.messages.create(model="m", max_tokens=64, tools=tools.anthropic(),
                                      messages=[{"role": "user", "content": "look up o8"}])
    assert sent[0]["tools"] == tools.anthropic()
    block = tools.anthropic_block(response.content[0])
    assert block["tool_use_id"] == "toolu_1" and block["is_error"] is False
    assert json.loads(block["content"])["result"] == {"order_id": "o8", "payments": None}
