"""Helpers the agent-tool tests share: the MCP server command, a fake chat model with tools,
and an HTTP client for the vendor SDKs that answers from a script (no network)."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import Any

import httpx2
import pytest
from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from pydantic import Field

from tests.conftest import REDIS_URL
from tests.integration.harness import ROOT
from tests.tools.conftest import Env

#: pydantic-ai 2.55+ needs Python 3.11, so ``[dev]`` installs it on 3.11+ only (pyproject.toml's
#: environment marker). Its tests skip below 3.11; on 3.11+ a missing pydantic-ai is an import
#: error at collection, never a skip.
PYDANTIC_AI = sys.version_info >= (3, 11)
needs_pydantic_ai = pytest.mark.skipif(
    not PYDANTIC_AI, reason="pydantic-ai needs Python 3.11+: [dev] installs it on 3.11+ only")


def server_env(live: Env) -> dict[str, str]:
    """What the server process needs to reach this module's broker, queue and prefix."""
    return {"TOOLS_REDIS": REDIS_URL.rstrip("/") + "/0", "TOOLS_PREFIX": live.prefix,
            "TOOLS_QUEUE": live.queue, "PYTHONPATH": str(ROOT)}


def command(*extra: str) -> list[str]:
    return ["-m", "celery", "-A", "tests.tools.app", "idem", "mcp",
            "--toolbox", "tests.tools.app:toolbox", *extra]


class FakeToolModel(GenericFakeChatModel):
    """LangChain's fake chat model, with ``bind_tools`` (which the base model lacks) recording
    the tools it was given; its replies are the scripted messages."""

    bound: list[Any] = Field(default_factory=list)

    def bind_tools(self, tools: Sequence[Any], **kwargs: Any) -> Any:
        self.bound = list(tools)
        return self


def mock_client(reply: dict[str, Any], sent: list[dict[str, Any]]) -> httpx2.Client:
    """An HTTP client (the SDKs' httpx2) that records each request body and answers ``reply``."""

    def handle(request: httpx2.Request) -> httpx2.Response:
        sent.append(json.loads(request.content))
        return httpx2.Response(200, json=reply)

    return httpx2.Client(transport=httpx2.MockTransport(handle))


def openai_reply(name: str, arguments: dict[str, Any], call_id: str = "call_1") -> dict[str, Any]:
    """A Chat Completions response whose message calls tool ``name``."""
    return {
        "id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m",
        "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
            "role": "assistant", "content": None, "tool_calls": [{
                "id": call_id, "type": "function",
                "function": {"name": name, "arguments": json.dumps(arguments)}}]}}],
    }


def anthropic_reply(name: str, arguments: dict[str, Any], use_id: str = "toolu_1") -> dict[str, Any]:
    """A Messages API response with one ``tool_use`` block for tool ``name``."""
    return {
        "id": "msg_1", "type": "message", "role": "assistant", "model": "m",
        "stop_reason": "tool_use", "stop_sequence": None,
        "usage": {"input_tokens": 1, "output_tokens": 1},
        "content": [{"type": "tool_use", "id": use_id, "name": name, "input": arguments}],
    }
