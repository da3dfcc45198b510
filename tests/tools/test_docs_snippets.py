"""Every snippet of docs/agent-tools.md marked ``<!-- snippet: NAME -->`` runs here, as written.

Each is executed (top-level ``await`` allowed) with the names the page assumes bound to the
test app's objects: ``tools``, ``charge_card``, ``lookup_order``, and the frameworks' own
offline models as ``model`` and ``chat_model``. The real worker runs the bodies.
"""

from __future__ import annotations

import ast
import asyncio
import json
import re
import secrets
import sys
from typing import Any

import anthropic
import anyio
import openai
import pytest
from langchain_core.messages import AIMessage, ToolMessage
from mcp import Client, StdioServerParameters
from mcp.server.lowlevel import Server
from starlette.applications import Starlette

from celery_idem import ImproperlyConfigured
from celery_idem.contrib.mcp import http_app
from celery_idem.contrib.tools import Toolbox, tool
from tests.integration.harness import ROOT
from tests.tools.app import charge_card, toolbox
from tests.tools.conftest import Env
from tests.tools.support import (
    PYDANTIC_AI,
    FakeToolModel,
    anthropic_reply,
    command,
    mock_client,
    needs_pydantic_ai,
    openai_reply,
    server_env,
)

if PYDANTIC_AI:  # Python 3.11+ (tests.tools.support)
    from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart, ToolReturnPart
    from pydantic_ai.models.function import AgentInfo, FunctionModel

pytestmark = pytest.mark.worker

PAGE = ROOT / "docs" / "agent-tools.md"
SNIPPET = re.compile(r"<!-- snippet: (?P<name>[\w-]+) -->\n```(?P<lang>\w+)\n(?P<code>.*?)\n```", re.S)


def snippets() -> dict[str, str]:
    return {m["name"]: m["code"] for m in SNIPPET.finditer(PAGE.read_text())}


def run(snippet: str, /, **names: Any) -> dict[str, Any]:
    """Execute ``snippet`` with ``names`` bound; return its namespace afterwards."""
    code = compile(snippets()[snippet], f"{PAGE.name}:{snippet}", "exec",
                   flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    namespace: dict[str, Any] = {"__name__": f"snippet_{snippet}", **names}
    result = eval(code, namespace)  # a coroutine when the snippet awaits
    if asyncio.iscoroutine(result):
        asyncio.run(result)
    return namespace


def lookup_order(order_id: str) -> dict[str, Any]:
    """Look up an order."""
    return {"order_id": order_id}


def test_every_marked_snippet_is_tested_here() -> None:
    tested = {"openai", "anthropic", "langchain", "vendor-formats", "checkpoint", "mcp-config",
              "mcp-embed", "annotations", "key-argument", "async", "pydantic-ai", "langgraph"}
    assert set(snippets()) == tested


def charge_tools() -> Toolbox:
    return Toolbox([tool(lookup_order, kind="read"), tool(charge_card, timeout=60)])


def test_the_openai_snippet_answers_the_model_s_tool_call(live: Env) -> None:
    sent: list[dict[str, Any]] = []
    reply = openai_reply("charge_card", {"order_id": "ord_4", "amount_cents": 4200})
    client = openai.OpenAI(api_key="test", base_url="http://127.0.0.1:9/v1", max_retries=0,
                           http_client=mock_client(reply, sent))
    tools = charge_tools()
    ns = run("openai", client=client, MODEL="m", tools=tools,
             messages=[{"role": "user", "content": "charge ord_4"}])
    assert sent[0]["tools"] == tools.openai()
    answer = ns["messages"][-1]
    assert answer["role"] == "tool" and answer["tool_call_id"] == "call_1"
    assert json.loads(answer["content"])["status"] == "ok"
    assert len(live.effects("charge:ord_4")) == 1


def test_the_anthropic_snippet_answers_the_model_s_tool_use(live: Env) -> None:
    sent: list[dict[str, Any]] = []
    reply = anthropic_reply("charge_card", {"order_id": "ord_5", "amount_cents": 4200})
    client = anthropic.Anthropic(api_key="test", base_url="http://127.0.0.1:9", max_retries=0,
                                 http_client=mock_client(reply, sent))
    tools = charge_tools()
    ns = run("anthropic", client=client, MODEL="m", tools=tools,
             messages=[{"role": "user", "content": "charge ord_5"}])
    assert sent[0]["tools"] == tools.anthropic()
    results = ns["messages"][-1]["content"]
    assert results[0]["type"] == "tool_result" and results[0]["is_error"] is False
    assert json.loads(results[0]["content"])["status"] == "ok"
    assert len(live.effects("charge:ord_5")) == 1


def test_the_langchain_snippet_binds_the_tools() -> None:
    chat_model = FakeToolModel(messages=iter([]))
    ns = run("langchain", tools=charge_tools(), chat_model=chat_model)
    assert ns["llm_with_tools"] is chat_model
    assert [t.name for t in chat_model.bound] == ["lookup_order", "charge_card"]


def test_the_vendor_format_snippet() -> None:
    # The formats themselves are checked in test_schema.py; here the lines run as written.
    run("vendor-formats", tool=tool, charge_card=charge_card)


def test_the_checkpoint_snippet(live: Env) -> None:
    saved: list[dict[str, Any]] = []

    class Checkpoint:
        def save(self, **fields: Any) -> None:
            saved.append(fields)

    ns = run("checkpoint", tools=charge_tools(), checkpoint=Checkpoint(), name="charge_card",
             arguments={"order_id": "ord_6", "amount_cents": 4200})
    assert saved == [{"task_id": ns["pending"].task_id, "key": ns["pending"].idempotency_key}]
    assert ns["outcome"]["status"] == "ok" and ns["outcome"]["task_id"] == saved[0]["task_id"]


def test_the_client_configuration_starts_the_server(live: Env) -> None:
    config = json.loads(snippets()["mcp-config"])
    entry = config["mcpServers"]["shop"]
    assert entry["command"] == "celery" and entry["args"][:2] == ["-A", "proj.celery_app"]
    # The same arguments, for this test's app and toolbox, started as the client would.
    args = [a.replace("proj.celery_app", "tests.tools.app").replace("proj.agent:tools",
                                                                     "tests.tools.app:toolbox")
            for a in entry["args"]]
    assert ["-m", "celery", *args] == command()
    params = StdioServerParameters(command=sys.executable, args=["-m", "celery", *args],
                                   env=server_env(live), cwd=str(ROOT))

    async def main() -> list[str]:
        with anyio.fail_after(60):
            async with Client(params) as client:
                return [t.name for t in (await client.list_tools()).tools]

    assert anyio.run(main) == [t.name for t in toolbox]


def test_the_embedding_snippet_gives_a_server_and_an_asgi_app() -> None:
    ns = run("mcp-embed", tools=toolbox, token=secrets.token_urlsafe(32))
    assert isinstance(ns["mcp_server"], Server) and ns["mcp_server"].name == "shop-tools"
    assert isinstance(ns["asgi_app"], Starlette)
    # Not loopback: without a token verifier the app is refused
    with pytest.raises(ImproperlyConfigured, match="CELERY_IDEM_MCP_TOKENS"):
        http_app(ns["mcp_server"], "0.0.0.0", 8765)


def test_the_annotations_snippet() -> None:
    ns = run("annotations", Toolbox=Toolbox, tool=tool, lookup_order=lookup_order,
             charge_card=charge_card)
    tools = ns["tools"]
    assert tools["lookup_order"].annotations() == {"readOnlyHint": True, "openWorldHint": False}
    assert tools["charge_card"].annotations() == {
        "title": "Charge a card", "readOnlyHint": False, "destructiveHint": False,
        "idempotentHint": True, "openWorldHint": True}


def test_the_key_argument_snippet() -> None:
    ns = run("key-argument", tool=tool, charge_card=charge_card)
    prop = ns["keyed"].parameters["properties"]["request_key"]
    assert prop["type"] == "string" and "new key for a new action" in prop["description"]


def test_the_async_snippet(live: Env) -> None:
    ns = run("async", tools=Toolbox([tool(charge_card, timeout=60)]))
    assert ns["outcome"]["status"] == "ok" and ns["again"]["status"] == "duplicate"
    assert len(live.effects("charge:ord_1")) == 1


@needs_pydantic_ai
def test_the_pydantic_ai_snippet(live: Env) -> None:
    statuses: list[str] = []

    def scripted(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        returns = [p for m in messages for p in getattr(m, "parts", ())
                   if isinstance(p, ToolReturnPart)]
        statuses[:] = [r.content["status"] for r in returns]
        if len(returns) < 2:
            return ModelResponse(parts=[ToolCallPart(
                "charge_card", {"order_id": "ord_2", "amount_cents": 4200})])
        return ModelResponse(parts=[TextPart("charged")])

    ns = run("pydantic-ai", tools=Toolbox([tool(charge_card, timeout=60)]),
             model=FunctionModel(scripted))
    assert ns["result"].output == "charged"
    assert statuses == ["ok", "duplicate"]
    assert len(live.effects("charge:ord_2")) == 1


def test_the_langgraph_snippet(live: Env) -> None:
    call = {"name": "charge_card", "args": {"order_id": "ord_3", "amount_cents": 4200}}
    chat_model = FakeToolModel(messages=iter([
        AIMessage("", tool_calls=[{**call, "id": "c1"}]),
        AIMessage("", tool_calls=[{**call, "id": "c2"}]),
        AIMessage("done"),
    ]))
    ns = run("langgraph", tools=Toolbox([tool(charge_card, timeout=60)]), chat_model=chat_model)
    outs = [json.loads(str(m.content)) for m in ns["final"]["messages"]
            if isinstance(m, ToolMessage)]
    assert [o["status"] for o in outs] == ["ok", "duplicate"]
    assert len(live.effects("charge:ord_3")) == 1
