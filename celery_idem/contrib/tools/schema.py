"""What the model is told: a tool's JSON Schema from the body's signature, and its docstring.

Each parameter's type hint gets its JSON Schema from pydantic, through
:mod:`~celery_idem.contrib.tools.typeschema` (imported when the first tool is built, so this
module does not import pydantic: the ``[tools]`` extra). This module adds what a signature and
a docstring say: which parameters are required, their defaults, and their descriptions.
"""

from __future__ import annotations

import inspect
import json
import re
import typing
from collections.abc import Callable, Mapping
from typing import Any

from ...keys import canonical
from .outcome import ToolError

__all__ = ["ToolError", "parse_docstring", "schema_for", "schema_of"]

_SECTIONS = re.compile(
    r"^(Args|Arguments|Parameters|Returns|Return|Yields|Raises|Examples?|Notes?|Attributes|"
    r"See Also|Warnings?):\s*$"
)
_ARG_ENTRY = re.compile(r"^(\s+)\*{0,2}(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")
_NO_DEFAULT = object()


def schema_for(
    fn: Callable[..., Any],
    signature: inspect.Signature,
    docs: Mapping[str, str] | None = None,
    label: str = "",
) -> dict[str, Any]:
    """The JSON Schema of ``fn``'s keyword arguments (``self`` of a bound task left out).

    Raises:
        ToolError: A parameter cannot be passed by keyword, or its type has no JSON Schema.
    """
    docs = docs or {}
    try:
        hints = typing.get_type_hints(fn, include_extras=True)
    except Exception:  # one hint names something unknown here: resolve them one by one below
        hints = {}
    properties: dict[str, Any] = {}
    required: list[str] = []
    for param in signature.parameters.values():
        properties[param.name] = _property(fn, param, hints, docs, f"{label}: parameter {param.name!r}")
        if param.default is param.empty:
            required.append(param.name)
    return {"type": "object", "properties": properties, "required": required,
            "additionalProperties": False}


def _property(fn: Callable[..., Any], param: inspect.Parameter, hints: Mapping[str, Any],
              docs: Mapping[str, str], where: str) -> dict[str, Any]:
    """One parameter's schema, with its description and default."""
    if param.kind in (param.POSITIONAL_ONLY, param.VAR_POSITIONAL, param.VAR_KEYWORD):
        raise ToolError(
            f"{where} is {param.kind.description}; a tool is called with named arguments "
            f"only (pass parameters= and a wrapper if you need it)"
        )
    hint = hints.get(param.name, param.annotation)
    if isinstance(hint, str):
        hint = _resolve(fn, hint, where)
    try:
        prop = schema_of(hint)
    except ToolError as exc:
        raise ToolError(f"{where}: {exc}") from None
    if param.name in docs and "description" not in prop:
        prop = {**prop, "description": docs[param.name]}
    if param.default is not param.empty and (default := _json_default(param.default)) is not _NO_DEFAULT:
        prop = {**prop, "default": default}
    return prop


def schema_of(hint: Any) -> dict[str, Any]:
    """JSON Schema of one type hint, in the subset both vendors accept.

    ``Annotated[X, "text"]`` gives ``X`` with ``description: "text"``; no annotation, ``Any``
    and ``object`` give ``{}`` (any value).

    Raises:
        ToolError: The type has no JSON Schema (pydantic's reason is in the message).
        ImportError: pydantic is not installed (the message says what to install).
    """
    if hint is inspect.Parameter.empty or hint is Any or hint is object:
        return {}
    try:
        from .typeschema import type_schema
    except ImportError as exc:
        raise ImportError("celery_idem tools derive their JSON Schema with pydantic: "
                          "pip install 'celery-idem[tools]'") from exc
    schema = type_schema(hint)
    notes = [m for m in typing.get_args(hint)[1:] if isinstance(m, str)] if (
        typing.get_origin(hint) is typing.Annotated) else []
    return {**schema, "description": " ".join(notes)} if notes else schema


def _resolve(fn: Callable[..., Any], annotation: str, where: str) -> Any:
    """Evaluate a string annotation in the function's module, as ``get_type_hints`` would."""
    namespace = dict(getattr(inspect.unwrap(fn), "__globals__", {}))
    try:
        return eval(annotation, namespace)  # the same evaluation typing.get_type_hints does
    except Exception as exc:
        raise ToolError(
            f"{where}: its annotation {annotation!r} cannot be resolved ({exc}); import the "
            f"type at module level (not only under TYPE_CHECKING), or pass parameters="
        ) from None


def _json_default(value: Any) -> Any:
    try:
        out = canonical(value)
        json.dumps(out)
    except (TypeError, ValueError):
        return _NO_DEFAULT
    return out


def parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """Split a Google-style docstring into its text and its ``Args:`` descriptions."""
    text: list[str] = []
    args: dict[str, str] = {}
    section: str | None = None
    current: str | None = None
    indent = 0  # of the entries: a line indented deeper continues the current entry
    for line in doc.splitlines():
        header = None if line.startswith((" ", "\t")) else _SECTIONS.match(line.strip())
        if header:
            section, current, indent = header.group(1), None, 0
        elif section is None:
            text.append(line)
        elif section in ("Args", "Arguments", "Parameters") and line.strip():
            entry = _ARG_ENTRY.match(line)
            depth = len(line) - len(line.lstrip())
            if entry and (current is None or depth <= indent):
                indent, current = depth, entry.group(2)
                args[current] = entry.group(3).strip()
            elif current is not None:
                args[current] = f"{args[current]} {line.strip()}".strip()
    return "\n".join(text).strip(), args
