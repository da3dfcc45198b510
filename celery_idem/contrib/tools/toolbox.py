"""A set of tools by name: lists them in each format and dispatches a model's tool calls."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Literal

from ...keys import check_scope
from .runtime import Pending, Tool

__all__ = ["Authorize", "Toolbox"]

logger = logging.getLogger("celery_idem.tools")

#: ``authorize(principal, tool, arguments) -> bool``: whether a caller may make this call.
Authorize = Callable[[str | None, str, Mapping[str, Any]], bool]


class Toolbox:
    """The tools an agent offers a model, by name; dispatches the model's tool calls.

    Args:
        tools: The tools (names must be unique).
        scope: The scope of every call that does not name one (``call(..., scope=)``): a
            tenant, a principal. A write tool's key is in its call's scope, so the same
            arguments or key in two scopes are two actions. None: no scope.
        authorize: ``authorize(principal, tool, arguments) -> bool``, asked with the parsed
            arguments before each call is started (a duplicate skips the body: a check there
            comes too late); principal None is a local caller. False, or an exception, is a
            logged ``forbidden`` outcome, and nothing is enqueued.

    Raises:
        ValueError: Two tools have the same name.
        InvalidKey: ``scope`` is not a valid scope (1 to 64 characters of
            ``A-Z a-z 0-9 . _ ~ + = / -``).

    Attributes:
        scope: The default scope.
    """

    def __init__(self, tools: Iterable[Tool], *, scope: str | None = None,
                 authorize: Authorize | None = None) -> None:
        self.scope = None if scope is None else check_scope(scope)
        self.authorize = authorize
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
              scope: str | None = None, principal: str | None = None) -> Pending:
        """Start a model's tool call by name (see :meth:`Tool.start`), arguments as for
        :meth:`call`; an unknown name, or a call ``authorize`` refuses, gives a finished
        :class:`Pending` with its outcome."""
        scope = self.scope if scope is None else check_scope(scope)
        t = self._tools.get(name)
        if t is None:
            unknown = _Unknown(name)
            return Pending(unknown, outcome=unknown._error(
                "UnknownTool", f"there is no tool named {name!r}; the tools are: "
                f"{', '.join(self._tools)}", retryable=False))
        refused = self._refusal(t, arguments, principal)
        return (Pending(t, outcome=refused) if refused
                else t.start(arguments, scope=scope, principal=principal))

    def call(self, name: str, arguments: str | Mapping[str, Any] | None = None,
             timeout: float | None = None, *, scope: str | None = None,
             principal: str | None = None) -> dict[str, Any]:
        """Run a model's tool call: ``name`` and its arguments (JSON text or a mapping).

        Args:
            name: The tool's name, as the model gave it.
            arguments: The model's arguments (JSON text or a mapping; None for none).
            timeout: Seconds to wait for the result (default: the tool's).
            scope: The caller's scope (default: the toolbox's :attr:`scope`), the task's
                ``idempotency_scope``: the same key in two scopes is two actions.
            principal: Who calls: asked of the ``authorize`` hook, and the body's
                ``self.idempotency_principal`` (None: a local caller).

        Returns:
            The outcome dict; never raises for the model's mistakes or the task's errors.

        Raises:
            InvalidKey: ``scope`` is not a valid scope (the caller's mistake).
        """
        return self.start(name, arguments, scope=scope, principal=principal).wait(timeout)

    async def acall(self, name: str, arguments: str | Mapping[str, Any] | None = None,
                    timeout: float | None = None, *, scope: str | None = None,
                    principal: str | None = None) -> dict[str, Any]:
        """Async :meth:`call` (same arguments): never blocks the event loop (see
        :meth:`Tool.ainvoke`)."""
        scope = self.scope if scope is None else scope
        t = self._tools.get(name)
        if t is None:
            pending = self.start(name, arguments, scope=scope)  # answered at once: no blocking
            assert pending.outcome is not None
            return pending.outcome
        # The hook may look things up (a database, a policy service): off the event loop.
        if self.authorize is not None:
            refused = await asyncio.to_thread(self._refusal, t, arguments, principal)
            if refused is not None:
                return refused
        return await t.ainvoke(arguments, timeout, scope=scope, principal=principal)

    def _refusal(self, t: Tool, arguments: str | Mapping[str, Any] | None,
                 principal: str | None) -> dict[str, Any] | None:
        """The ``forbidden`` outcome when :attr:`authorize` refuses the call, else None."""
        if self.authorize is None:
            return None
        parsed, problems = t._parse(arguments)
        if problems:
            return None  # refused as invalid by the tool itself, before any enqueue
        try:
            allowed = self.authorize(principal, t.name, parsed) is True
        except Exception:  # a broken policy refuses: it never lets a call through
            logger.exception("celery_idem.tools %s: authorize raised for principal %r; refused",
                             t.name, principal)
            allowed = False
        if allowed:
            return None
        logger.warning("celery_idem.tools %s: forbidden for principal %r", t.name, principal)
        return {**t._error("Forbidden", f"{t.name} is not allowed for this caller with these "
                           f"arguments; nothing was done. Do not call it again: ask the user.",
                           retryable=False), "status": "forbidden"}

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
