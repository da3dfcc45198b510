"""Agent tools from Celery tasks: one callable per task, with a JSON Schema and safe outcomes.

:func:`tool` turns a task (or, for a read tool, a plain function) into a :class:`Tool` an LLM
agent can call::

    from celery_idem.tools import Toolbox, tool

    tools = Toolbox([
        tool(lookup_order, kind="read"),        # no effect: runs in this process, not gated
        tool(charge_card, timeout=20),          # an IdempotentTask: enqueued, gated, awaited
    ])
    response = client.chat.completions.create(model=..., messages=..., tools=tools.openai())
    for call in response.choices[0].message.tool_calls or ():
        messages.append(tools.openai_message(call))

The schema comes from the body's signature and type hints, the description from its docstring.
A write tool must be an :class:`~celery_idem.IdempotentTask`: its key is derived when the call
is enqueued, so a model that calls the tool again with the same arguments (after a timeout, a
crash, a doubled turn) gets the same action, done once, and its result.

Every call returns a small JSON-serialisable dict, never an exception or a stack trace::

    {"status": "ok" | "duplicate" | "in_progress" | "error",
     "result": ...,            # the body's return value (None unless ok/duplicate)
     "message": "...",         # one sentence the model can act on
     "tool": "charge_card", "idempotency_key": "...", "task_id": "...",
     "error": "TypeName", "retryable": bool}   # only when status is "error"

``duplicate`` is a success: the action had already been done and this is its recorded result.
``in_progress`` means the bounded wait ran out while the action runs; calling again with the
same arguments is safe and returns the result once it is there.

This module imports neither ``redis`` nor ``sqlalchemy``; LangChain is imported only by
:meth:`Tool.langchain` and pydantic-ai only by :meth:`Tool.pydantic_ai`, each only if it is
installed. Every call has an async twin (:meth:`Tool.acall`, :meth:`Toolbox.acall`) that
never blocks the event loop; :mod:`celery_idem.mcp` serves a toolbox over MCP.
"""

from __future__ import annotations

import asyncio
import enum
import inspect
import json
import logging
import re
import time
import types
import typing
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Literal, Union

from celery import Task
from celery.result import AsyncResult
from celery.states import FAILURE, READY_STATES, REVOKED, SUCCESS

from .exceptions import IdempotencyKeyMismatch, StoreUnavailable, TerminalError
from .keys import canonical
from .task import IdempotentTask, _signature_of, get_store

__all__ = ["OUTCOME_SCHEMA", "Pending", "Tool", "ToolError", "Toolbox", "tool"]

logger = logging.getLogger("celery_idem.tools")

ToolKind = Literal["read", "write"]
#: What a call's ``status`` can be.
STATUSES = ("ok", "duplicate", "in_progress", "error")
#: Tool names both vendors accept (OpenAI and Anthropic: letters, digits, ``_`` and ``-``).
NAME_PATTERN = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
#: Longest error text a model is shown (an exception message can be a whole HTTP body).
MAX_MESSAGE = 500
#: Appended to a write tool's description: the model is told that repeating a call is safe.
WRITE_NOTE = (
    "Safe to call again with the same arguments: the action is done once, and a repeated "
    "call returns the first call's result."
)
#: JSON Schema of a call's outcome dict (MCP's ``outputSchema``; see the module docstring).
OUTCOME_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "status": {"type": "string", "enum": list(STATUSES),
                   "description": "ok: this call did the action; duplicate: it had already been "
                                  "done, result is the first call's (a success); in_progress: "
                                  "still running, safe to call again with the same arguments; "
                                  "error: see error, retryable and message."},
        "result": {"description": "The action's return value (null unless ok or duplicate)."},
        "message": {"type": "string", "description": "One sentence saying what to do next."},
        "tool": {"type": "string"},
        "idempotency_key": {"type": ["string", "null"],
                            "description": "The action's key (write tools)."},
        "task_id": {"type": ["string", "null"]},
        "error": {"type": "string", "description": "The error's type name (status error only)."},
        "retryable": {"type": "boolean",
                      "description": "Whether calling again may help (status error only)."},
    },
    "required": ["status", "result", "message", "tool", "idempotency_key", "task_id"],
}
_SECTIONS = re.compile(
    r"^(Args|Arguments|Parameters|Returns|Return|Yields|Raises|Examples?|Notes?|Attributes|"
    r"See Also|Warnings?):\s*$"
)


class ToolError(TypeError):
    """Raised when a tool cannot be made from the given task or function (the message says why)."""


# ---------------------------------------------------------------------------------------------
# building a tool
# ---------------------------------------------------------------------------------------------


def tool(
    target: Any,
    *,
    kind: ToolKind = "write",
    name: str | None = None,
    description: str | None = None,
    timeout: float = 30.0,
    parameters: Mapping[str, Any] | None = None,
    options: Mapping[str, Any] | None = None,
    destructive: bool = True,
    open_world: bool = True,
    key_argument: str | None = None,
    title: str | None = None,
) -> Tool:
    """Make an agent tool from a Celery task or, for ``kind="read"``, a plain function.

    Args:
        target: For ``write``: an :class:`~celery_idem.IdempotentTask` (registered on an app).
            For ``read``: a plain function (run in this process) or a plain Celery task (sent
            to a worker and awaited; not gated).
        kind: ``"write"`` (the call has an effect: enqueued and gated, so it is done once per
            action) or ``"read"`` (no effect, safe to repeat: not gated).
        name: The name the model calls (default: the function's name, or the last dotted
            part of the task name). Letters, digits, ``_`` and ``-``, at most 64.
        description: What the model is told (default: the docstring without its ``Args:``
            and later sections; write tools get :data:`WRITE_NOTE` appended).
        timeout: Seconds a call waits for the task's result before answering ``in_progress``.
        parameters: A JSON Schema (``{"type": "object", ...}``) to use instead of the one
            derived from the signature.
        options: Extra ``apply_async`` options for every call (``queue``, ``priority``...).
        destructive: A write tool may overwrite or delete what was there (MCP's
            ``destructiveHint``); False for one that only adds (a charge, a new shipment).
        open_world: The tool reaches beyond this system: a payment provider, e-mail, the web
            (MCP's ``openWorldHint``); False for one that works on this system's own data.
        key_argument: For a write tool, the name of an argument whose value is the action's
            idempotency key, used verbatim instead of the key derived from the other
            arguments. If the task has no such parameter it is added to the schema as an
            optional string and not passed to the task.
        title: A human-readable title (MCP's ``title`` annotation).

    Raises:
        ToolError: ``target`` cannot be this kind of tool, or its signature cannot be
            described in JSON Schema (the message names the parameter).
        ValueError: ``kind``, ``name``, ``timeout`` or ``key_argument`` is invalid.
    """
    if kind not in ("read", "write"):
        raise ValueError(f"kind must be 'read' or 'write', got {kind!r}")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout < 0:
        raise ValueError(f"timeout must be a number of seconds >= 0, got {timeout!r}")
    label = str(getattr(target, "name", None) or getattr(target, "__qualname__", repr(target)))
    if isinstance(target, Task):
        if kind == "write" and not isinstance(target, IdempotentTask):
            raise ToolError(
                f"{label}: a write tool must be an IdempotentTask (base=IdempotentTask), so a "
                f"repeated call is done once; this is a plain {type(target).__mro__[1].__name__}. "
                f"Use kind='read' only if the task has no effect."
            )
        if kind == "read" and isinstance(target, IdempotentTask):
            raise ToolError(
                f"{label}: an IdempotentTask is gated by its worker, so it cannot be a read "
                f"tool; make it kind='write', or pass the plain function for a read tool"
            )
        if target.ignore_result:
            raise ToolError(f"{label}: ignore_result=True, so the tool could never see a result")
        fn: Callable[..., Any] = target.run
        signature = _signature_of(fn)
        default_name = str(target.name).rsplit(".", 1)[-1]
    elif callable(target):
        if kind == "write":
            raise ToolError(
                f"{label}: a write tool must be an IdempotentTask (base=IdempotentTask), not a "
                f"plain function: an effect must go through the gate"
            )
        fn = target
        try:
            signature = inspect.signature(fn)
        except (TypeError, ValueError):
            signature = None
        default_name = getattr(fn, "__name__", "")
    else:
        raise ToolError(f"{label!r} is neither a Celery task nor a function")

    name = name or default_name
    if not isinstance(name, str) or not NAME_PATTERN.match(name):
        raise ValueError(
            f"{label}: tool name {name!r} is not accepted by OpenAI or Anthropic (letters, "
            f"digits, '_' and '-', 1 to 64 characters); pass name="
        )
    doc_text, arg_docs = _parse_docstring(inspect.getdoc(fn) or "")
    if description is None:
        description = doc_text
        if kind == "write":
            description = f"{description}\n\n{WRITE_NOTE}" if description else WRITE_NOTE
    if parameters is None:
        if signature is None:
            raise ToolError(f"{label}: its signature cannot be read; pass parameters=")
        schema = schema_for(fn, signature, arg_docs, label)
    else:
        if not isinstance(parameters, Mapping) or parameters.get("type") != "object":
            raise ToolError(f"{label}: parameters must be a JSON Schema with \"type\": \"object\"")
        schema = json.loads(json.dumps(dict(parameters)))
    passed_on = True
    if key_argument is not None:
        if kind != "write":
            raise ValueError(f"{label}: key_argument is for write tools (a read tool has no key)")
        properties = schema.setdefault("properties", {})
        if key_argument in properties:
            if properties[key_argument].get("type") not in (None, "string"):
                raise ValueError(f"{label}: key_argument {key_argument!r} must be a string "
                                 f"parameter")
        else:
            # Not one of the task's parameters: the tool takes it, the task never sees it.
            passed_on = False
            properties[key_argument] = {
                "type": "string", "minLength": 1, "maxLength": 200,
                "description": "Optional: your own key for this action, used as given. Calls "
                               "with the same key are the same action, done once."}
    return Tool(target, kind=kind, name=name, description=description, parameters=schema,
                timeout=float(timeout), options=dict(options or {}), destructive=destructive,
                open_world=open_world, key_argument=key_argument,
                key_passed_on=passed_on, title=title)


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
        if param.kind in (param.POSITIONAL_ONLY, param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise ToolError(
                f"{label}: parameter {param.name!r} is {param.kind.description}; a tool is called "
                f"with named arguments only (pass parameters= and a wrapper if you need it)"
            )
        hint = hints.get(param.name, param.annotation)
        if isinstance(hint, str):
            hint = _resolve(fn, hint, f"{label}: parameter {param.name!r}")
        try:
            prop = _schema_of(hint)
        except ToolError as exc:
            raise ToolError(f"{label}: parameter {param.name!r}: {exc}") from None
        if param.name in docs and "description" not in prop:
            prop = {**prop, "description": docs[param.name]}
        if param.default is param.empty:
            required.append(param.name)
        else:
            default = _json_default(param.default)
            if default is not _NO_DEFAULT:
                prop = {**prop, "default": default}
        properties[param.name] = prop
    return {"type": "object", "properties": properties, "required": required,
            "additionalProperties": False}


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


_NO_DEFAULT = object()
_SIMPLE: dict[Any, str] = {str: "string", int: "integer", float: "number", bool: "boolean",
                           type(None): "null"}
_FORMATS: dict[str, str] = {"datetime": "date-time", "date": "date", "time": "time", "UUID": "uuid"}


def _schema_of(hint: Any) -> dict[str, Any]:
    """JSON Schema of one type hint (the subset both vendors accept)."""
    if hint is inspect.Parameter.empty or hint is Any or hint is object:
        return {}
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin is typing.Annotated:
        schema = _schema_of(args[0])
        notes = [m for m in args[1:] if isinstance(m, str)]
        return {**schema, "description": " ".join(notes)} if notes else schema
    if hint in _SIMPLE:
        return {"type": _SIMPLE[hint]}
    if hint is None:
        return {"type": "null"}
    if origin is Literal:
        return _enum_schema(list(args))
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return _enum_schema([member.value for member in hint])
    if origin in (Union, types.UnionType):
        members = [_schema_of(a) for a in args]
        if any(m == {} for m in members):
            return {}
        if all(set(m) == {"type"} and isinstance(m["type"], str) for m in members):
            return {"type": [m["type"] for m in members]}
        return {"anyOf": members}
    if hint in (list, tuple, set, frozenset) or origin in (list, set, frozenset) or (
        origin is not None and isinstance(origin, type) and issubclass(origin, Sequence)
        and origin not in (str, bytes, tuple)
    ):
        return {"type": "array", "items": _schema_of(args[0])} if args else {"type": "array"}
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return {"type": "array", "items": _schema_of(args[0])}
        items = [_schema_of(a) for a in args]
        unique = [i for n, i in enumerate(items) if i not in items[:n]]
        item = unique[0] if len(unique) == 1 else {"anyOf": unique}
        return {"type": "array", "items": item, "minItems": len(args), "maxItems": len(args)}
    if hint is dict or origin is dict or (
        origin is not None and isinstance(origin, type) and issubclass(origin, Mapping)
    ):
        if len(args) == 2:
            if args[0] is not str:
                raise ToolError(f"{hint!r}: JSON objects have str keys only")
            return {"type": "object", "additionalProperties": _schema_of(args[1])}
        return {"type": "object"}
    if isinstance(hint, type) and hint.__name__ in _FORMATS and hint.__module__ in (
        "datetime", "uuid"
    ):
        # Passed as JSON text; the body gets the string and parses it.
        return {"type": "string", "format": _FORMATS[hint.__name__]}
    if isinstance(hint, type) and hint.__name__ == "Decimal" and hint.__module__ == "decimal":
        return {"type": "string", "description": "a decimal number, as text"}
    raise ToolError(
        f"type {getattr(hint, '__qualname__', hint)!r} has no JSON Schema here (supported: str, "
        f"int, float, bool, None, list/tuple/set[...], dict[str, ...], Optional/Union, Literal, "
        f"Enum, Annotated, datetime, date, time, UUID, Decimal, Any); pass parameters="
    )


def _strict(schema: Mapping[str, Any], where: str) -> dict[str, Any]:
    """``schema`` as OpenAI's strict mode wants it (see :meth:`Tool.openai`)."""
    out = {k: v for k, v in schema.items() if k != "default"}
    if out == {} or (out.keys() <= {"description"}):
        raise ToolError(f"{where}: strict mode needs a type here (annotate it, or strict=False)")
    if "anyOf" in out:
        out["anyOf"] = [_strict(s, where) for s in out["anyOf"]]
    if isinstance(out.get("items"), Mapping):
        out["items"] = _strict(out["items"], f"{where}[]")
    kinds = out.get("type")
    if kinds == "object" or (isinstance(kinds, list) and "object" in kinds):
        if "properties" not in out:
            raise ToolError(f"{where}: strict mode cannot describe a free-form object "
                            f"(dict); use strict=False or a hand-written parameters=")
        required = set(out.get("required", ()))
        props = {}
        for name, original in out["properties"].items():
            prop = _strict(original, f"{where}.{name}")
            if name not in required:
                prop = _nullable(prop)
                if "default" in original and original["default"] is not None:
                    # The schema cannot say it any more; the model still should know it.
                    note = f"null means the default, {json.dumps(original['default'])}."
                    text = str(prop.get("description") or "").rstrip(". ")
                    prop["description"] = f"{text}; {note}" if text else note.capitalize()
            props[name] = prop
        out.update(properties=props, required=list(props), additionalProperties=False)
    return out


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


def _enum_schema(values: list[Any]) -> dict[str, Any]:
    values = [canonical(v) for v in values]
    kinds = {_SIMPLE.get(type(v)) for v in values}
    if len(kinds) == 1 and None not in kinds:
        return {"type": kinds.pop(), "enum": values}
    return {"enum": values}


def _json_default(value: Any) -> Any:
    try:
        out = canonical(value)
        json.dumps(out)
    except (TypeError, ValueError):
        return _NO_DEFAULT
    return out


_ARG_ENTRY = re.compile(r"^(\s+)\*{0,2}(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")


def _parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
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


# ---------------------------------------------------------------------------------------------
# the tool
# ---------------------------------------------------------------------------------------------


class Tool:
    """An agent tool: callable with keyword arguments, described in JSON Schema.

    Made by :func:`tool`. Calling it never raises for the model's mistakes or the task's
    errors: it returns the outcome dict described in this module's docstring.

    Attributes:
        name: The name the model calls.
        kind: ``"read"`` or ``"write"``.
        description: What the model is told.
        parameters: The JSON Schema of the arguments.
        timeout: Seconds a call waits for a task's result before answering ``in_progress``.
        target: The task or function.
        destructive: May overwrite or delete (MCP's ``destructiveHint``, write tools).
        open_world: Reaches beyond this system (MCP's ``openWorldHint``).
        key_argument: The argument used verbatim as the key, or None (derived key).
        title: A human-readable title, or None.
    """

    def __init__(self, target: Any, *, kind: ToolKind, name: str, description: str,
                 parameters: dict[str, Any], timeout: float, options: dict[str, Any],
                 destructive: bool = True, open_world: bool = True,
                 key_argument: str | None = None, key_passed_on: bool = True,
                 title: str | None = None) -> None:
        self.target = target
        self.kind: ToolKind = kind
        self.name = name
        self.description = description
        self.parameters = parameters
        self.timeout = timeout
        self.options = options
        self.destructive = destructive
        self.open_world = open_world
        self.key_argument = key_argument
        self._key_passed_on = key_passed_on
        self.title = title

    def __repr__(self) -> str:
        return f"<Tool {self.name} ({self.kind})>"

    # -- calling ---------------------------------------------------------------------------

    def __call__(self, **arguments: Any) -> dict[str, Any]:
        """Call the tool with keyword arguments and wait up to :attr:`timeout` seconds."""
        return self.invoke(arguments)

    def invoke(self, arguments: str | Mapping[str, Any] | None,
               timeout: float | None = None) -> dict[str, Any]:
        """Call the tool with a model's arguments (a JSON object text, or a dict).

        Args:
            arguments: The model's arguments: a JSON text (OpenAI's ``arguments``) or a
                mapping (Anthropic's ``input``); None for no arguments.
            timeout: Seconds to wait for the result (default :attr:`timeout`).

        Returns:
            The outcome dict (``status``, ``result``, ``message``, ...).
        """
        return self.start(arguments).wait(timeout)

    async def acall(self, **arguments: Any) -> dict[str, Any]:
        """Async :meth:`__call__`: enqueue and wait without blocking the event loop."""
        return await self.ainvoke(arguments)

    async def ainvoke(self, arguments: str | Mapping[str, Any] | None,
                      timeout: float | None = None) -> dict[str, Any]:
        """Async :meth:`invoke`: the enqueue and every poll of the result run in a thread.

        Cancelling the awaiting coroutine stops only the wait: the task goes on running and
        its key stays claimed, so a later call with the same arguments gets its result.

        Args:
            arguments: The model's arguments (JSON text or a mapping; None for none).
            timeout: Seconds to wait for the result (default :attr:`timeout`).

        Returns:
            The outcome dict, as :meth:`invoke` returns it.
        """
        # The enqueue talks to the store and the broker (blocking sockets): off the loop. A
        # cancellation while it runs leaves the thread to finish the publish.
        pending = await asyncio.to_thread(self.start, arguments)
        return await pending.wait_async(timeout)

    def start(self, arguments: str | Mapping[str, Any] | None) -> Pending:
        """Check the arguments and start the call, without waiting for its result.

        A write tool's task is enqueued (or answered from the store at once, when the action
        is already done); a read function runs to its end here. Save
        :attr:`Pending.task_id` and :attr:`Pending.idempotency_key` (to a checkpoint, say)
        before calling :meth:`Pending.wait`.
        """
        parsed, problems = self._parse(arguments)
        if problems:
            # Nothing was enqueued: the model can fix the call and try again.
            return Pending(self, outcome=self._error(
                "InvalidArguments", f"{self.name}: {'; '.join(problems)}. Nothing was done; "
                f"call it again with corrected arguments.", retryable=True))
        if not isinstance(self.target, Task):
            return Pending(self, outcome=self._run_here(parsed))
        key: str | None = None
        options = dict(self.options)
        if self.key_argument is not None and parsed.get(self.key_argument) is not None:
            # The caller's own key, verbatim (the task's apply_async checks its length).
            key = str(parsed[self.key_argument])
            options["idempotency_key"] = key
            if not self._key_passed_on:
                del parsed[self.key_argument]
        elif self.key_argument is not None and not self._key_passed_on:
            parsed.pop(self.key_argument, None)
        try:
            if key is None and isinstance(self.target, IdempotentTask):
                key = self.target.idempotency_key_for(kwargs=parsed)
            result = self.target.apply_async(kwargs=parsed, **options)
        except IdempotencyKeyMismatch as exc:
            return Pending(self, outcome=self._mismatch(exc, key))
        except (TypeError, ValueError) as exc:
            return Pending(self, outcome=self._error(
                "InvalidArguments", f"{self.name}: {_short(exc)}. Nothing was done; call it "
                f"again with corrected arguments.", retryable=True, key=key))
        except Exception as exc:  # broker down, ...: nothing (or nothing known) was sent
            logger.warning("celery_idem.tools %s: enqueue failed: %s", self.name, exc,
                           exc_info=True)
            return Pending(self, outcome=self._error(
                type(exc).__name__, f"{self.name} could not be started: {_short(exc)}. Calling "
                f"it again with the same arguments is safe.", retryable=True, key=key))
        key = getattr(result, "idempotency_key", None) or key
        return Pending(self, result=result, key=key)

    def _parse(self, arguments: str | Mapping[str, Any] | None) -> tuple[dict[str, Any], list[str]]:
        if arguments is None or arguments == "":
            arguments = {}
        if isinstance(arguments, (str, bytes)):
            try:
                arguments = json.loads(arguments)
            except ValueError as exc:
                return {}, [f"the arguments are not valid JSON ({exc})"]
        if not isinstance(arguments, Mapping):
            return {}, [f"the arguments must be a JSON object, got {type(arguments).__name__}"]
        parsed = dict(arguments)
        properties = self.parameters.get("properties", {})
        for name in [n for n, v in parsed.items() if v is None]:
            prop = properties.get(name)
            if isinstance(prop, Mapping) and "default" in prop and validate(
                {k: v for k, v in prop.items() if k != "default"}, None
            ):
                # null for an optional argument that cannot be null: OpenAI's strict mode
                # sends it for "not given" (see openai(strict=True)). Use the default.
                del parsed[name]
        return parsed, validate(self.parameters, parsed)

    def _run_here(self, arguments: dict[str, Any]) -> dict[str, Any]:
        try:
            value = self.target(**arguments)
        except Exception as exc:
            logger.info("celery_idem.tools %s failed: %s", self.name, exc, exc_info=True)
            return self._error(type(exc).__name__, f"{self.name} failed: {_short(exc)}",
                               retryable=True)
        return self._success("ok", value, None, None)

    # -- outcomes --------------------------------------------------------------------------

    def _outcome(self, status: str, result: Any, message: str, key: str | None,
                 task_id: str | None) -> dict[str, Any]:
        return {"status": status, "result": result, "message": message, "tool": self.name,
                "idempotency_key": key, "task_id": task_id}

    def _success(self, status: str, value: Any, key: str | None, task_id: str | None,
                 original: str | None = None) -> dict[str, Any]:
        try:
            value = json.loads(json.dumps(value, default=canonical))
        except (TypeError, ValueError):
            return self._error("UnserializableResult", f"{self.name} finished, but its result "
                               f"({type(value).__name__}) cannot be shown as JSON.",
                               retryable=False, key=key, task_id=task_id)
        if status == "duplicate":
            message = (f"{self.name} had already been done with these arguments (task "
                       f"{original}); this is its recorded result. It was not done again.")
        else:
            message = f"{self.name} succeeded."
        return self._outcome(status, value, message, key, task_id)

    def _error(self, error: str, message: str, *, retryable: bool, key: str | None = None,
               task_id: str | None = None) -> dict[str, Any]:
        return {**self._outcome("error", None, message, key, task_id), "error": error,
                "retryable": retryable}

    def _mismatch(self, exc: BaseException, key: str | None, task_id: str | None = None
                  ) -> dict[str, Any]:
        return self._error(
            "IdempotencyKeyMismatch",
            f"{self.name} was already called for this action with different arguments, and "
            f"the first call stands ({_short(exc)}). To do a different action, change the "
            f"arguments that identify it.", retryable=False, key=key, task_id=task_id)

    def _failure(self, exc: BaseException, key: str | None, task_id: str | None) -> dict[str, Any]:
        if isinstance(exc, IdempotencyKeyMismatch):
            return self._mismatch(exc, key, task_id)
        terminal: tuple[type[BaseException], ...] = (TerminalError,)
        if isinstance(self.target, IdempotentTask):
            terminal += self.target.idempotency_config.terminal_on
        text = f"{type(exc).__name__}: {_short(exc)}"
        if isinstance(exc, terminal):
            return self._error(
                type(exc).__name__, f"{self.name} failed for good: {text}. Calling it again with "
                f"the same arguments returns the same error; change the arguments or tell the "
                f"user.", retryable=False, key=key, task_id=task_id)
        again = ("it will not run twice at the same time" if self.kind == "write"
                 else "it has no effect")
        return self._error(
            type(exc).__name__, f"{self.name} failed: {text}. The error is not marked "
            f"permanent: calling it again with the same arguments is allowed ({again}).",
            retryable=True, key=key, task_id=task_id)

    def _in_progress(self, waited: float, key: str | None, task_id: str | None) -> dict[str, Any]:
        if self.kind == "write":
            message = (f"{self.name} is still in progress after {waited:g} s. It is safe to call "
                       f"it again with the same arguments: the action will not be done twice, "
                       f"and the call returns its result once it is ready.")
        else:
            message = (f"{self.name} gave no result within {waited:g} s; it has no effect, so "
                       f"calling it again is safe.")
        return self._outcome("in_progress", None, message, key, task_id)

    # -- vendor formats --------------------------------------------------------------------

    def openai(self, api: Literal["chat", "responses"] = "chat", *,
               strict: bool = False) -> dict[str, Any]:
        """The tool in OpenAI's format.

        Args:
            api: ``"chat"`` (Chat Completions: ``{"type": "function", "function": {...}}``)
                or ``"responses"`` (Responses API: the same fields, not nested, and
                ``strict`` always present, as that API requires).
            strict: Add ``"strict": true`` and the schema OpenAI's strict mode needs: every
                property required (an optional one becomes nullable: a null argument means
                "use the default"), no ``default``, ``additionalProperties: false`` on every
                object.

        Raises:
            ToolError: ``strict`` and a parameter strict mode cannot describe (a free-form
                ``dict`` or an untyped value): the message names it.
        """
        function: dict[str, Any] = {"name": self.name, "description": self.description,
                                    "parameters": self.parameters}
        if strict:
            function["parameters"] = _strict(self.parameters, self.name)
            function["strict"] = True
        if api == "responses":
            # The Responses API requires "strict" (and applies strict mode when it is left
            # out), so a non-strict schema must say strict: false.
            return {"type": "function", **function, "strict": bool(strict)}
        if api != "chat":
            raise ValueError(f"api must be 'chat' or 'responses', got {api!r}")
        return {"type": "function", "function": function}

    def anthropic(self) -> dict[str, Any]:
        """The tool in Anthropic's Messages API format: ``name``, ``description``, ``input_schema``."""
        return {"name": self.name, "description": self.description,
                "input_schema": self.parameters}

    def annotations(self) -> dict[str, Any]:
        """MCP tool annotations (hints for the client).

        A write tool (an ``IdempotentTask``) is ``idempotentHint: true``: a repeated call
        with the same arguments has no further effect. A read tool is ``readOnlyHint: true``.
        ``destructiveHint`` and ``openWorldHint`` come from :func:`tool`'s ``destructive``
        and ``open_world``.
        """
        hints: dict[str, Any] = {"title": self.title} if self.title else {}
        if self.kind == "read":
            hints.update(readOnlyHint=True, openWorldHint=self.open_world)
        else:
            hints.update(readOnlyHint=False, destructiveHint=self.destructive,
                         idempotentHint=True, openWorldHint=self.open_world)
        return hints

    def mcp(self) -> dict[str, Any]:
        """The tool as an MCP ``Tool`` (JSON, as ``tools/list`` sends it).

        ``outputSchema`` is :data:`OUTCOME_SCHEMA`: a call's ``structuredContent`` is its
        outcome dict.
        """
        return {"name": self.name, "description": self.description,
                "inputSchema": self.parameters,
                "outputSchema": json.loads(json.dumps(OUTCOME_SCHEMA)),  # a copy per caller
                "annotations": self.annotations()}

    def langchain(self) -> Any:
        """The tool as a LangChain ``StructuredTool`` (needs ``langchain-core``).

        The LangChain tool returns the same outcome dict.

        Raises:
            ImportError: ``langchain-core`` is not installed (the message says what to install).
        """
        try:
            from langchain_core.tools import StructuredTool
        except ImportError as exc:
            raise ImportError(
                "Tool.langchain() needs langchain-core: pip install langchain-core"
            ) from exc

        def run(**arguments: Any) -> dict[str, Any]:
            return self.invoke(arguments)

        async def arun(**arguments: Any) -> dict[str, Any]:
            return await self.ainvoke(arguments)

        return StructuredTool.from_function(func=run, coroutine=arun, name=self.name,
                                            description=self.description,
                                            args_schema=self.parameters)

    def pydantic_ai(self) -> Any:
        """The tool as a pydantic-ai ``Tool`` (needs ``pydantic-ai-slim``).

        Built with ``Tool.from_schema`` from this tool's JSON Schema; it awaits
        :meth:`ainvoke`, so an agent's run never blocks its event loop, and returns the same
        outcome dict.

        Raises:
            ImportError: pydantic-ai is not installed (the message says what to install).
        """
        try:
            from pydantic_ai import Tool as AgentTool
        except ImportError as exc:
            raise ImportError(
                "Tool.pydantic_ai() needs pydantic-ai: pip install pydantic-ai-slim"
            ) from exc

        async def run(**arguments: Any) -> dict[str, Any]:
            return await self.ainvoke(arguments)

        return AgentTool.from_schema(run, name=self.name, description=self.description,
                                     json_schema=self.parameters)


class Pending:
    """A started tool call: enqueued (or already answered), not yet awaited.

    Attributes:
        tool: The tool.
        task_id: The Celery task id (None for a call answered without a task).
        idempotency_key: The action's key (write tools).
        answered_at_enqueue: True when the action was already done and nothing was enqueued.
    """

    def __init__(self, tool: Tool, *, result: AsyncResult | None = None,
                 key: str | None = None, outcome: dict[str, Any] | None = None) -> None:
        self.tool = tool
        self.result = result
        self.idempotency_key = key
        self.task_id: str | None = result.id if result is not None else None
        self.answered_at_enqueue = getattr(result, "original_task_id", None) is not None
        self.outcome = outcome

    def wait(self, timeout: float | None = None) -> dict[str, Any]:
        """Wait up to ``timeout`` seconds (default the tool's) and return the outcome dict.

        Never raises: a result not there in time gives ``in_progress``.
        """
        if self.outcome is not None:
            return self.outcome
        assert self.result is not None
        timeout = self.tool.timeout if timeout is None else timeout
        result, tool, key = self.result, self.tool, self.idempotency_key
        try:
            # Polling reads the state from the backend too: inside the try, so a backend that
            # is down gives an error outcome, not an exception.
            if not _ready_within(result, timeout):
                return tool._in_progress(timeout, key, self.task_id)
            state, value = result.state, result.result
        except Exception as exc:  # the result backend is down, or the result unreadable
            logger.warning("celery_idem.tools %s: result of %s unreadable: %s", tool.name,
                           self.task_id, exc, exc_info=True)
            return tool._error(type(exc).__name__, f"{tool.name}: its result could not be read "
                               f"({_short(exc)}); calling it again with the same arguments is "
                               f"safe.", retryable=True, key=key, task_id=self.task_id)
        if state == SUCCESS:
            if self.answered_at_enqueue:  # a CachedResult: its id is the original task's
                status, original = "duplicate", self.task_id
            else:
                original = self._original_task_id()
                status = "duplicate" if original and original != self.task_id else "ok"
            self.outcome = tool._success(status, value, key, self.task_id, original)
        elif state == FAILURE and isinstance(value, BaseException):
            self.outcome = tool._failure(value, key, self.task_id)
        elif state == REVOKED:
            self.outcome = tool._error("Revoked", f"{tool.name} was cancelled (revoked) before it "
                                       f"finished.", retryable=True, key=key, task_id=self.task_id)
        else:
            self.outcome = tool._error(str(state), f"{tool.name} ended in state {state}.",
                                       retryable=True, key=key, task_id=self.task_id)
        return self.outcome

    async def wait_async(self, timeout: float | None = None) -> dict[str, Any]:
        """Async :meth:`wait`: polls the result in a thread and sleeps on the event loop.

        Cancelling the coroutine stops the wait only; the task is not revoked.
        """
        if self.outcome is not None:
            return self.outcome
        assert self.result is not None
        timeout = self.tool.timeout if timeout is None else timeout
        result = self.result
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        interval = 0.02
        while True:
            try:
                ready = await asyncio.to_thread(lambda: result.state in READY_STATES)
            except Exception:
                ready = True  # wait() reads it again and turns the failure into an outcome
            remaining = deadline - loop.time()
            if ready or remaining <= 0:
                break
            await asyncio.sleep(min(interval, remaining))
            interval = min(interval * 2, 0.25)
        if not ready:
            return self.tool._in_progress(timeout, self.idempotency_key, self.task_id)
        # Ready: wait(0) reads the state and value and builds the outcome (the store read that
        # tells a duplicate apart is a blocking call too).
        return await asyncio.to_thread(self.wait, 0.0)

    def _original_task_id(self) -> str | None:
        """The task id whose body ran for this key (a worker-side duplicate answers with it)."""
        target = self.tool.target
        if self.idempotency_key is None or not isinstance(target, IdempotentTask):
            return None
        try:
            record = get_store(target.app).get(self.idempotency_key)
        except StoreUnavailable:
            return None  # the result itself is right; only the label "duplicate" is unknown
        return record.task_id if record is not None else None


def _ready_within(result: AsyncResult, timeout: float) -> bool:
    """Poll ``result.ready()`` until ``timeout`` (Celery's own ``get(timeout=)`` waits in whole
    seconds on the Redis backend, and raises instead of answering)."""
    deadline = time.monotonic() + timeout
    interval = 0.02
    while True:
        if result.state in READY_STATES:
            return True
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        time.sleep(min(interval, remaining))
        interval = min(interval * 2, 0.25)


def _short(exc: BaseException) -> str:
    # One line (no traceback-like layout), no final period: it is put inside a sentence.
    text = " ".join(str(exc).split()).rstrip(".") or type(exc).__name__
    return text if len(text) <= MAX_MESSAGE else text[: MAX_MESSAGE - 3] + "..."


# ---------------------------------------------------------------------------------------------
# validation (the keywords the schema above uses)
# ---------------------------------------------------------------------------------------------


def validate(schema: Mapping[str, Any], value: Any, path: str = "") -> list[str]:
    """Check ``value`` against ``schema``; return the problems, each naming the argument.

    Covers the keywords :func:`schema_for` writes: ``type``, ``enum``, ``anyOf``,
    ``properties``, ``required``, ``additionalProperties``, ``items``, ``minItems`` and
    ``maxItems``. Other keywords (from a hand-written ``parameters=``) are not checked.
    """
    problems: list[str] = []
    where = f"argument {path!r}" if path else "the arguments"
    if "anyOf" in schema:
        if not any(not validate(s, value, path) for s in schema["anyOf"]):
            problems.append(f"{where}: {_show(value)} matches none of the allowed types")
        return problems
    expected = schema.get("type")
    if expected is not None:
        kinds = [expected] if isinstance(expected, str) else list(expected)
        if not any(_is_type(value, k) for k in kinds):
            return [f"{where} must be {' or '.join(kinds)}, got {_show(value)}"]
    if "enum" in schema and value not in schema["enum"]:
        return [f"{where} must be one of {json.dumps(schema['enum'])}, got {_show(value)}"]
    if isinstance(value, Mapping):
        props = schema.get("properties", {})
        missing = [n for n in schema.get("required", ()) if n not in value]
        if missing:
            problems.append("missing required argument" + ("s " if len(missing) > 1 else " ")
                            + ", ".join(repr(f"{path}.{n}" if path else n) for n in missing))
        extra = schema.get("additionalProperties", True)
        unknown = [n for n in value if n not in props and extra is False]
        if unknown:
            problems.append("unknown argument" + ("s " if len(unknown) > 1 else " ")
                            + ", ".join(repr(n) for n in unknown)
                            + f" (expected: {', '.join(props) or 'none'})")
        for n, item in value.items():
            sub = props.get(n, extra if isinstance(extra, Mapping) else None)
            if sub is not None:
                problems += validate(sub, item, f"{path}.{n}" if path else str(n))
    elif isinstance(value, list):
        if "minItems" in schema and len(value) < schema["minItems"]:
            problems.append(f"{where} needs at least {schema['minItems']} items")
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            problems.append(f"{where} takes at most {schema['maxItems']} items")
        if isinstance(schema.get("items"), Mapping):
            for i, item in enumerate(value):
                problems += validate(schema["items"], item, f"{path}[{i}]")
    return problems


def _is_type(value: Any, kind: str) -> bool:
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == "string":
        return isinstance(value, str)
    if kind == "boolean":
        return isinstance(value, bool)
    if kind == "null":
        return value is None
    if kind == "array":
        return isinstance(value, list)
    if kind == "object":
        return isinstance(value, Mapping)
    return True


def _show(value: Any) -> str:
    text = json.dumps(value, default=repr)
    return text if len(text) <= 60 else text[:57] + "..."


# ---------------------------------------------------------------------------------------------
# a set of tools
# ---------------------------------------------------------------------------------------------


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
