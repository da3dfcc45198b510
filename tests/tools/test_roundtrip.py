"""A model's arguments reach the task unchanged, for every parameter type the schema supports.

``echo_types`` (tests/tools/app.py) has one parameter per supported annotation and returns
what its body received, with each value's Python type. The arguments are what a model sends:
JSON values that match the derived schema. They go through the tool (sync, async and MCP) to
the real worker, and come back equal, as the JSON types the schema promised.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import anyio
import jsonschema
import pytest
from mcp import Client

from celery_idem.contrib.mcp import server
from tests.tools.app import echo_types, toolbox
from tests.tools.conftest import Env

pytestmark = pytest.mark.worker

#: Python type the body gets for each JSON type (the task's JSON serializer).
JSON_TYPES = {"str": "string", "int": "integer", "float": "number", "bool": "boolean",
              "NoneType": "null", "list": "array", "dict": "object"}


def model_arguments() -> dict[str, Any]:
    """One real value per parameter, as a model writes it (a fresh ``text`` per call)."""
    return {
        "text": f"héllo \"quoted\" ✓ {uuid.uuid4().hex[:6]}", "count": -42, "ratio": 0.125,
        "flag": False, "nothing": None, "numbers": [3, 1, 2], "tags": ["b", "a"],
        "pair": [7, "seven"], "many": [1.5, 2.0, -0.25], "names": ["x", "y"],
        "scores": {"a": 1, "b": 2}, "weights": {"w": 0.5}, "maybe": None, "either": "two",
        "size": "m", "speed": "express", "priority": 2, "note": "leave at the door",
        "when": "2026-12-03T10:15:00+00:00", "day": "2026-12-03", "at": "10:15:00",
        "ref": "6f1c2b9e-3d4a-4c7b-9a1e-2b3c4d5e6f70", "price": "19.99",
        "anything": {"nested": [1, {"deep": True}]}, "untyped": [None, 1.0, "s"],
        "rows": [{"q": 1}, {"q": 2}], "optional_default": 5,
    }


def check(sent: dict[str, Any], outcome: dict[str, Any]) -> None:
    assert outcome["status"] == "ok", outcome
    received, types = outcome["result"]["values"], outcome["result"]["types"]
    assert received == sent
    properties = toolbox["echo_types"].parameters["properties"]
    for name, value in sent.items():
        # The body got the JSON value itself (no tuple, set, Enum, datetime or Decimal made
        # of it), and it is valid for the parameter's schema.
        assert types[name] == type(value).__name__, (name, types[name], value)
        assert types[name] in JSON_TYPES
        jsonschema.Draft202012Validator(properties[name]).validate(received[name])
    assert outcome["idempotency_key"] == echo_types.idempotency_key_for(kwargs=sent)


def test_the_arguments_are_valid_for_the_derived_schema() -> None:
    jsonschema.Draft202012Validator(toolbox["echo_types"].parameters).validate(model_arguments())
    assert set(model_arguments()) == set(toolbox["echo_types"].parameters["properties"])


def test_every_supported_type_round_trips_through_a_sync_call(live: Env) -> None:
    sent = model_arguments()
    check(sent, toolbox.call("echo_types", sent))


def test_every_supported_type_round_trips_through_an_async_call(live: Env) -> None:
    sent = model_arguments()
    check(sent, asyncio.run(toolbox.acall("echo_types", sent)))


def test_every_supported_type_round_trips_through_mcp(live: Env) -> None:
    sent = model_arguments()

    async def main() -> Any:
        async with Client(server(toolbox)) as client:
            return await client.call_tool("echo_types", sent)

    result = anyio.run(main)
    check(sent, result.structured_content)
    assert result.is_error is False
