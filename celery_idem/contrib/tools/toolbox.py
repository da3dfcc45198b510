"""A set of tools by name: lists them in each format and dispatches a model's tool calls."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Literal

from ...keys import check_scope
from .runtime import Pending, Tool

__all__ = ["Toolbox"]


class Toolbox:
    """The tools an agent offers a model, by name; dispatches the model's tool calls.

    Args:
        tools: The tools (names must be unique).
        scope: The scope of every call that does not name one (``call(..., scope=)``): a
            tenant, a principal. A write tool's key is in its call's scope, so the same
            arguments or key in two scopes are two actions. None: no scope.

    Raises:
        ValueError: Two tools have the same name.
        InvalidKey: ``scope`` is not a valid scope (1 to 64 characters of
            ``A-Z a-z 0-9 . _ ~ + = / -``).

    Attributes:
        scope: The default scope.
    """

    def __init__(self, tools: Iterable[Tool], *, scope: str | None = None) -> None:
        self.scope = None if scope is None else check_scope(scope)
        self._tools: dict[str, Tool] = {}
        for t in tools:
            if not isinstance(t, Tool):
                raise TypeError(
                    f"Toolbox takes Tool objects (from celery_idem.contrib.tools.tool), got {t!r}")
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

    def start(self, name: str, arguments: str | Mapping[str, Any] | None, *,
              scope: str | None = None) -> Pending:
        """Start a model's tool call by name, as :meth:`call` takes it, without waiting (see
        :meth:`Tool.start`); an unknown name gives a finished :class:`Pending` with an error
        outcome."""
        scope = self.scope if scope is None else check_scope(scope)
        t = self._tools.get(name)
        if t is None:
            return Pending(_Unknown(name), outcome={
                "status": "error", "result": None, "tool": name, "idempotency_key": None,
                "task_id": None, "error": "UnknownTool", "retryable": False,
                "message": f"there is no tool named {name!r}; the tools are: "
                           f"{', '.join(self._tools)}"})
        return t.start(arguments, scope=scope)

    def call(self, name: str, arguments: str | Mapping[str, Any] | None = None,
             timeout: float | None = None, *, scope: str | None = None) -> dict[str, Any]:
        """Run a model's tool call: ``name`` and its arguments (JSON text or a mapping).

        Args:
            name: The tool's name, as the model gave it.
            arguments: The model's arguments (JSON text or a mapping; None for none).
            timeout: Seconds to wait for the result (default: the tool's).
            scope: The caller's scope (a tenant, a principal; default: the toolbox's
                :attr:`scope`), passed to the task as ``idempotency_scope``: the same key in
                two scopes is two actions.

        Returns:
            The outcome dict; never raises for the model's mistakes or the task's errors.

        Raises:
            InvalidKey: ``scope`` is not a valid scope (the caller's mistake).
        """
        return self.start(name, arguments, scope=scope).wait(timeout)

    async def acall(self, name: str, arguments: str | Mapping[str, Any] | None = None,
                    timeout: float | None = None, *, scope: str | None = None
                    ) -> dict[str, Any]:
        """Async :meth:`call` (the same arguments, outcome and ``InvalidKey``): never blocks the
        event loop (see :meth:`Tool.ainvoke`)."""
        scope = self.scope if scope is None else scope
        t = self._tools.get(name)
        if t is None:
            pending = self.start(name, arguments, scope=scope)  # answered at once: no blocking
            assert pending.outcome is not None
            return pending.outcome
        return await t.ainvoke(arguments, timeout, scope=scope)

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

    def langchain(self, *, scope: str | None = None) -> list[Any]:
        """Every tool as a LangChain ``StructuredTool`` (needs ``langchain-core``), calling in
        ``scope`` (default: the toolbox's :attr:`scope`)."""
        scope = self.scope if scope is None else scope
        return [t.langchain(scope=scope) for t in self]

    def pydantic_ai(self, *, scope: str | None = None) -> list[Any]:
        """Every tool as a pydantic-ai ``Tool`` (needs ``pydantic-ai-slim``), calling in
        ``scope`` (default: the toolbox's :attr:`scope`)."""
        scope = self.scope if scope is None else scope
        return [t.pydantic_ai(scope=scope) for t in self]

    def openai_message(self, tool_call: Any, timeout: float | None = None, *,
                       scope: str | None = None) -> dict[str, Any]:
        """Run one OpenAI Chat Completions tool call; return the ``role: tool`` message.

        ``tool_call`` is the SDK object or its dict (``{"id", "function": {"name",
        "arguments"}}``); ``scope`` as for :meth:`call`.
        """
        function = _field(tool_call, "function")
        outcome = self.call(_field(function, "name"), _field(function, "arguments"), timeout,
                            scope=scope)
        return {"role": "tool", "tool_call_id": _field(tool_call, "id"),
                "content": json.dumps(outcome)}

    def anthropic_block(self, tool_use: Any, timeout: float | None = None, *,
                        scope: str | None = None) -> dict[str, Any]:
        """Run one Anthropic ``tool_use`` block; return its ``tool_result`` block.

        ``is_error`` is set for the ``error`` status only: a duplicate or an action still in
        progress is not an error. ``scope`` as for :meth:`call`.
        """
        outcome = self.call(_field(tool_use, "name"), _field(tool_use, "input"), timeout,
                            scope=scope)
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
