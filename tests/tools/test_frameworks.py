"""Real agent frameworks run their own loop with their own offline models, calling our tools.

pydantic-ai with ``FunctionModel`` and LangGraph (a ``StateGraph`` with its ``ToolNode``)
with LangChain's ``GenericFakeChatModel``: no model service, no weights. In each, the model
calls the charge tool twice with the same arguments (as a model does after a doubled turn)
and the real worker charges the card once.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

import pytest
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition

from celery_idem.contrib.tools import Toolbox, tool
from tests.tools.app import charge_card, stock_level
from tests.tools.conftest import Env
from tests.tools.support import PYDANTIC_AI, FakeToolModel, needs_pydantic_ai

if PYDANTIC_AI:  # Python 3.11+ (tests.tools.support)
    from pydantic_ai import Agent
    from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart, ToolReturnPart
    from pydantic_ai.models.function import AgentInfo, FunctionModel

pytestmark = pytest.mark.worker

WAIT = 60.0


def order() -> str:
    return f"ord_{uuid.uuid4().hex[:8]}"


def shop_tools() -> Toolbox:
    return Toolbox([tool(charge_card, timeout=WAIT), tool(stock_level, kind="read", timeout=WAIT)])


@needs_pydantic_ai
def test_pydantic_ai_function_model_calls_the_charge_twice_and_one_charge_results(live: Env) -> None:
    oid = order()
    arguments = {"order_id": oid, "amount_cents": 1250, "currency": "eur"}
    seen: list[dict[str, Any]] = []

    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        # The framework hands the model the tool definitions built from our schema.
        assert {t.name for t in info.function_tools} == {"charge_card", "stock_level"}
        returns = [p for m in messages for p in getattr(m, "parts", ())
                   if isinstance(p, ToolReturnPart)]
        seen[:] = [r.content for r in returns]
        if len(returns) < 2:  # the same call twice, one turn after the other
            return ModelResponse(parts=[ToolCallPart("charge_card", dict(arguments),
                                                     tool_call_id=f"call_{len(returns)}")])
        return ModelResponse(parts=[TextPart(f"charged: {returns[-1].content['status']}")])

    agent = Agent(FunctionModel(model), tools=shop_tools().pydantic_ai())
    result = asyncio.run(agent.run(f"Charge order {oid}, 12.50 EUR"))

    assert result.output == "charged: duplicate"
    assert [r["status"] for r in seen] == ["ok", "duplicate"], seen
    assert seen[0]["result"] == seen[1]["result"]
    assert seen[0]["result"]["currency"] == "eur"
    assert len(live.effects(f"charge:{oid}")) == 1


def test_langgraph_tool_node_runs_the_charge_twice_and_one_charge_results(live: Env) -> None:
    oid = order()
    arguments = {"order_id": oid, "amount_cents": 990}
    script = iter([
        AIMessage("", tool_calls=[{"id": "c1", "name": "charge_card", "args": arguments}]),
        # Two calls of the same action in one turn: LangGraph's ToolNode runs them at once.
        AIMessage("", tool_calls=[{"id": "c2", "name": "charge_card", "args": arguments},
                                  {"id": "c3", "name": "charge_card", "args": arguments}]),
        AIMessage("Done: the order is charged."),
    ])
    lc_tools = shop_tools().langchain()
    llm = FakeToolModel(messages=script).bind_tools(lc_tools)

    async def agent(state: MessagesState) -> dict[str, list[BaseMessage]]:
        return {"messages": [await llm.ainvoke(state["messages"])]}

    graph = StateGraph(MessagesState)
    graph.add_node("agent", agent)
    graph.add_node("tools", ToolNode(lc_tools))
    graph.add_edge(START, "agent")
    graph.add_conditional_edges("agent", tools_condition)
    graph.add_edge("tools", "agent")
    app = graph.compile()
    final = asyncio.run(app.ainvoke({"messages": [HumanMessage(f"Charge order {oid}")]}))

    assert [t.name for t in llm.bound] == ["charge_card", "stock_level"]
    outs = [json.loads(str(m.content)) for m in final["messages"] if isinstance(m, ToolMessage)]
    assert [o["status"] for o in outs] == ["ok", "duplicate", "duplicate"], outs
    assert len({json.dumps(o["result"]) for o in outs}) == 1
    assert final["messages"][-1].content == "Done: the order is charged."
    assert len(live.effects(f"charge:{oid}")) == 1
