"""A set of tools by name: lists them in each format and dispatches a model's tool calls."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Literal

from .runtime import Pending, Tool

__all__ = ["Toolbox"]


class Toolbox:
    """The tools an agent offers a model, by name; dispatches the model's tool calls.

    Args:
        tools: The tools (names must be unique).

    Raises:
        ValueError: Two tools have the same name.
    """

    def __init__(self, tools: Iterable[Tool]) -> None:
        self._tools: dict[str, Tool] = {}
        for t in tools:
            if not isinstance(t, Tool):
                raise TypeError(f"Toolbox takes Tool objects (from celery_idem.tools.tool), got {t!r}")
            if t.name in self._tools:
                raise ValueError(f"two tools are named {t.name!r}; pass name= to one of them")
            self._tools[t.name] = t

    def __getitem__(self, name: str) -> Tool:
        return self._tools[name]

    def __contains__(self, name: object) -> bool:
        return name in self._tools

    def __iter__(self) -> Iterator[Tool]:
        return iter(self._tools.values())

    def __len__(self) -> int:
        return len(self._tools)

    def start(self, name: str, arguments: str | Mapping[str, Any] | None) -> Pending:
        """Start a model's tool call by name (see :meth:`Tool.start`); an unknown name gives
        a finished :class:`Pending` with an error outcome."""
        t = self._tools.get(name)
        if t is None:
            return Pending(_Unknown(name), outcome={
                "status": "error", "result": None, "tool": name, "idempotency_key": None,
                "task_id": None, "error": "UnknownTool", "retryable": False,
                "message": f"there is no tool named {name!r}; the tools are: "
                           f"{', '.join(self._tools)}"})
        return t.start(arguments)

    def call(self, name: str, arguments: str | Mapping[str, Any] | None = None,
             timeout: float | None = None) -> dict[str, Any]:
        """Run a model's tool call: ``name`` and its arguments (JSON text or a mapping)."""
        return self.start(name, arguments).wait(timeout)

    async def acall(self, name: str, arguments: str | Mapping[str, Any] | None = None,
                    timeout: float | None = None) -> dict[str, Any]:
        """Async :meth:`call`: never blocks the event loop (see :meth:`Tool.ainvoke`)."""
        t = self._tools.get(name)
        if t is None:
            pending = self.start(name, arguments)  # answered at once: nothing blocks
            assert pending.outcome is not None
            return pending.outcome
        return await t.ainvoke(arguments, timeout)

    def mcp(self) -> list[dict[str, Any]]:
        """Every tool as an MCP ``Tool`` (see :meth:`Tool.mcp`)."""
        return [t.mcp() for t in self]

    def openai(self, api: Literal["chat", "responses"] = "chat", *,
               strict: bool = False) -> list[dict[str, Any]]:
        """Every tool in OpenAI's format (the request's ``tools``); see :meth:`Tool.openai`."""
        return [t.openai(api, strict=strict) for t in self]

    def anthropic(self) -> list[dict[str, Any]]:
        """Every tool in Anthropic's format (the request's ``tools``)."""
        return [t.anthropic() for t in self]

    def langchain(self) -> list[Any]:
        """Every tool as a LangChain ``StructuredTool`` (needs ``langchain-core``)."""
        return [t.langchain() for t in self]

    def pydantic_ai(self) -> list[Any]:
        """Every tool as a pydantic-ai ``Tool`` (needs ``pydantic-ai-slim``)."""
        return [t.pydantic_ai() for t in self]

    def openai_message(self, tool_call: Any, timeout: float | None = None) -> dict[str, Any]:
        """Run one OpenAI Chat Completions tool call; return the ``role: tool`` message.

        ``tool_call`` is the SDK object or its dict (``{"id", "function": {"name",
        "arguments"}}``).
        """
        function = _field(tool_call, "function")
        outcome = self.call(_field(function, "name"), _field(function, "arguments"), timeout)
        return {"role": "tool", "tool_call_id": _field(tool_call, "id"),
                "content": json.dumps(outcome)}

    def anthropic_block(self, tool_use: Any, timeout: float | None = None) -> dict[str, Any]:
        """Run one Anthropic ``tool_use`` block; return its ``tool_result`` block.

        ``is_error`` is set for the ``error`` status only: a duplicate or an action still in
        progress is not an error.
        """
        outcome = self.call(_field(tool_use, "name"), _field(tool_use, "input"), timeout)
        return {"type": "tool_result", "tool_use_id": _field(tool_use, "id"),
                "content": json.dumps(outcome), "is_error": outcome["status"] == "error"}


class _Unknown(Tool):
    """Stands for a name the model made up, so its error outcome has a tool to belong to."""

    def __init__(self, name: str) -> None:
        super().__init__(None, kind="read", name=name, description="", parameters={},
                         timeout=0.0, options={})


def _field(obj: Any, name: str) -> Any:
    """``obj[name]`` for a dict, ``obj.name`` for an SDK object."""
    if isinstance(obj, Mapping):
        return obj.get(name)
    return getattr(obj, name, None)
