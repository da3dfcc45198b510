"""A tool in each vendor's and framework's format: OpenAI, Anthropic, MCP, LangChain, pydantic-ai.

:class:`~celery_idem.contrib.tools.Tool`'s methods (``openai()``, ``anthropic()``, ``mcp()``,
``langchain()``, ``pydantic_ai()``) call these. LangChain and pydantic-ai are imported only by
the function that needs them, and only if they are installed.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Literal, Protocol

from .outcome import OUTCOME_SCHEMA, ToolKind
from .schema import ToolError
from .validation import validate

__all__ = ["anthropic_spec", "langchain_tool", "mcp_annotations", "mcp_spec", "openai_spec",
           "pydantic_ai_tool", "strict_schema"]


class FormattedTool(Protocol):
    """What a format reads of a :class:`~celery_idem.contrib.tools.Tool` (a Protocol, so this
    module imports nothing of the runtime that calls it)."""

    kind: ToolKind
    name: str
    description: str
    parameters: dict[str, Any]
    title: str | None
    destructive: bool
    open_world: bool

    def invoke(self, arguments: Any, timeout: float | None = None, *,
               scope: str | None = None) -> dict[str, Any]: ...

    async def ainvoke(self, arguments: Any, timeout: float | None = None, *,
                      scope: str | None = None) -> dict[str, Any]: ...


def openai_spec(tool: FormattedTool, api: Literal["chat", "responses"] = "chat", *,
                strict: bool = False) -> dict[str, Any]:
    """The tool in OpenAI's format (see :meth:`~celery_idem.contrib.tools.Tool.openai`)."""
    function: dict[str, Any] = {"name": tool.name, "description": tool.description,
                                "parameters": tool.parameters}
    if strict:
        function["parameters"] = strict_schema(tool.parameters, tool.name)
        function["strict"] = True
    if api == "responses":
        # The Responses API requires "strict" (and applies strict mode when it is left
        # out), so a non-strict schema must say strict: false.
        return {"type": "function", **function, "strict": bool(strict)}
    if api != "chat":
        raise ValueError(f"api must be 'chat' or 'responses', got {api!r}")
    return {"type": "function", "function": function}


def anthropic_spec(tool: FormattedTool) -> dict[str, Any]:
    """The tool in Anthropic's Messages API format: ``name``, ``description``, ``input_schema``."""
    return {"name": tool.name, "description": tool.description, "input_schema": tool.parameters}


def mcp_annotations(tool: FormattedTool) -> dict[str, Any]:
    """MCP tool annotations (see :meth:`~celery_idem.contrib.tools.Tool.annotations`)."""
    hints: dict[str, Any] = {"title": tool.title} if tool.title else {}
    if tool.kind == "read":
        hints.update(readOnlyHint=True, openWorldHint=tool.open_world)
    else:
        hints.update(readOnlyHint=False, destructiveHint=tool.destructive,
                     idempotentHint=True, openWorldHint=tool.open_world)
    return hints


def mcp_spec(tool: FormattedTool) -> dict[str, Any]:
    """The tool as an MCP ``Tool`` (JSON, as ``tools/list`` sends it)."""
    return {"name": tool.name, "description": tool.description,
            "inputSchema": tool.parameters,
            "outputSchema": json.loads(json.dumps(OUTCOME_SCHEMA)),  # a copy per caller
            "annotations": mcp_annotations(tool)}


def langchain_tool(tool: FormattedTool, scope: str | None = None) -> Any:
    """The tool as a LangChain ``StructuredTool`` (see :meth:`~celery_idem.contrib.tools.Tool.langchain`)."""
    try:
        from langchain_core.tools import StructuredTool
    except ImportError as exc:
        raise ImportError("Tool.langchain() needs langchain-core: pip install langchain-core") from exc

    def run(**arguments: Any) -> dict[str, Any]:
        return tool.invoke(arguments, scope=scope)

    async def arun(**arguments: Any) -> dict[str, Any]:
        return await tool.ainvoke(arguments, scope=scope)

    return StructuredTool.from_function(func=run, coroutine=arun, name=tool.name,
                                        description=tool.description,
                                        args_schema=tool.parameters)


def pydantic_ai_tool(tool: FormattedTool, scope: str | None = None) -> Any:
    """The tool as a pydantic-ai ``Tool`` (see :meth:`~celery_idem.contrib.tools.Tool.pydantic_ai`)."""
    try:
        from pydantic_ai import Tool as AgentTool
    except ImportError as exc:
        raise ImportError("Tool.pydantic_ai() needs pydantic-ai: pip install pydantic-ai-slim") from exc

    async def run(**arguments: Any) -> dict[str, Any]:
        return await tool.ainvoke(arguments, scope=scope)

    return AgentTool.from_schema(run, name=tool.name, description=tool.description,
                                 json_schema=tool.parameters)


# ---------------------------------------------------------------------------------------------
# OpenAI's strict mode
# ---------------------------------------------------------------------------------------------


def strict_schema(schema: Mapping[str, Any], where: str) -> dict[str, Any]:
    """``schema`` as OpenAI's strict mode wants it: every property required (an optional one
    nullable), no ``default``, ``additionalProperties: false`` on every object.

    Raises:
        ToolError: A part strict mode cannot describe (an untyped value, a free-form object);
            ``where`` and the path below it name it.
    """
    out = {k: v for k, v in schema.items() if k != "default"}
    if out.keys() <= {"description"}:
        raise ToolError(f"{where}: strict mode needs a type here (annotate it, or strict=False)")
    if "anyOf" in out:
        out["anyOf"] = [strict_schema(s, where) for s in out["anyOf"]]
    if isinstance(out.get("items"), Mapping):
        out["items"] = strict_schema(out["items"], f"{where}[]")
    kinds = out.get("type")
    if kinds == "object" or (isinstance(kinds, list) and "object" in kinds):
        if "properties" not in out:
            raise ToolError(f"{where}: strict mode cannot describe a free-form object "
                            f"(dict); use strict=False or a hand-written parameters=")
        required = set(out.get("required", ()))
        props = {name: _strict_property(original, f"{where}.{name}", name in required)
                 for name, original in out["properties"].items()}
        out.update(properties=props, required=list(props), additionalProperties=False)
    return out


def _strict_property(original: Mapping[str, Any], where: str, required: bool) -> dict[str, Any]:
    prop = strict_schema(original, where)
    if required:
        return prop
    prop = _nullable(prop)  # strict mode requires it: null stands for "not given"
    if original.get("default") is not None:
        # The schema cannot say it any more; the model still should know it.
        note = f"null means the default, {json.dumps(original['default'])}."
        text = str(prop.get("description") or "").rstrip(". ")
        prop["description"] = f"{text}; {note}" if text else note.capitalize()
    return prop


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    if not validate(schema, None):
        return schema  # already accepts null
    kinds = schema.get("type")
    if isinstance(kinds, str) and "enum" not in schema:
        return {**schema, "type": [kinds, "null"]}
    if isinstance(kinds, list) and "enum" not in schema:
        return {**schema, "type": [*kinds, "null"]}
    meta = {k: schema[k] for k in ("description",) if k in schema}
    return {"anyOf": [{k: v for k, v in schema.items() if k != "description"},
                      {"type": "null"}], **meta}
