"""Helpers the agent-tool tests share: the MCP server command, and a fake chat model with tools."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from pydantic import Field

from tests.conftest import REDIS_URL
from tests.integration.harness import ROOT
from tests.tools.conftest import Env


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
