"""Making a tool: :func:`tool` checks a task or function and derives what the model is told."""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Mapping
from typing import Any

from celery import Task

from ...keys import signature_of
from ...task import IdempotentTask
from .outcome import NAME_PATTERN, WRITE_NOTE, ToolKind
from .runtime import Tool
from .schema import ToolError, parse_docstring, schema_for
from .validation import check_schema

__all__ = ["tool"]

#: What a ``key_argument`` the task does not take is described as (the tool takes it, the task
#: never sees it).
_OWN_KEY = {
    "type": "string", "minLength": 1, "maxLength": 200,
    "description": "Optional: your own key for this action (printable text). Calls with the "
                   "same key and the same arguments are the same action, done once; a key "
                   "used again with other arguments is refused: use a new key for a new "
                   "action."}


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
    expose_errors: tuple[type[BaseException], ...] = (),
    untyped: bool = False,
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
        key_argument: For a write tool, the name of an argument whose value is the call's own
            idempotency key (``apply_async(idempotency_key=...)``) instead of the key derived
            from the other arguments. It names an action of this task only, in the call's
            scope; used again with other arguments it is refused (a ``mismatch``). If the
            task has no such parameter it is added to the schema as an optional string and
            not passed to the task.
        title: A human-readable title (MCP's ``title`` annotation).
        expose_errors: Exception types whose text the model may see when the body raises
            them. By default the model sees only the type of an error and an error id (the
            text, which can hold secrets or other callers' data, goes to the log), except
            for a :class:`~celery_idem.TerminalError` or a class with
            ``expose_to_model = True``.
        untyped: Let a write tool take parameters without a type annotation (any JSON value,
            passed on as the model sends it). By default it is refused: the annotation is
            what refuses a model's ``"4200"`` for an ``int`` before the body runs.

    Raises:
        ToolError: ``target`` cannot be this kind of tool, its signature cannot be
            described in JSON Schema (the message names the parameter), a write tool has
            parameters without annotations (the message names them) and ``untyped`` is not
            set, or ``parameters`` is not a valid JSON Schema.
        ImportError: The ``[tools]`` extra (pydantic, jsonschema) is not installed.
        ValueError: ``kind``, ``name``, ``timeout``, ``key_argument`` or ``expose_errors``
            is invalid.
    """
    _check_options(kind, timeout)
    expose_errors = _exception_types(expose_errors)
    label = str(getattr(target, "name", None) or getattr(target, "__qualname__", repr(target)))
    fn, signature, default_name = _body_of(target, kind, label)
    name = name or default_name
    if not isinstance(name, str) or not NAME_PATTERN.match(name):
        raise ValueError(
            f"{label}: tool name {name!r} is not accepted by OpenAI or Anthropic (letters, "
            f"digits, '_' and '-', 1 to 64 characters); pass name="
        )
    doc_text, arg_docs = parse_docstring(inspect.getdoc(fn) or "")
    if description is None:
        description = _with_write_note(doc_text) if kind == "write" else doc_text
    if parameters is None:
        if signature is None:
            raise ToolError(f"{label}: its signature cannot be read; pass parameters=")
        if kind == "write" and not untyped:
            _check_typed(signature, label)
        schema = schema_for(fn, signature, arg_docs, label)
    else:
        schema = _hand_written(parameters, label)
    passed_on = _add_key_argument(schema, key_argument, kind, label)
    return Tool(target, kind=kind, name=name, description=description, parameters=schema,
                timeout=float(timeout), options=dict(options or {}), destructive=destructive,
                open_world=open_world, key_argument=key_argument,
                key_passed_on=passed_on, title=title, expose_errors=expose_errors)


def _exception_types(value: Any) -> tuple[type[BaseException], ...]:
    types = tuple(value) if isinstance(value, (tuple, list)) else (value,)
    for t in types:
        if not (isinstance(t, type) and issubclass(t, BaseException)):
            raise ValueError(f"expose_errors takes exception classes, got {t!r}")
    return types


def _check_options(kind: Any, timeout: Any) -> None:
    if kind not in ("read", "write"):
        raise ValueError(f"kind must be 'read' or 'write', got {kind!r}")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout < 0:
        raise ValueError(f"timeout must be a number of seconds >= 0, got {timeout!r}")


def _body_of(target: Any, kind: ToolKind, label: str
             ) -> tuple[Callable[..., Any], inspect.Signature | None, str]:
    """The function whose signature and docstring describe the tool, its signature (None when
    it cannot be read) and the tool's default name."""
    if isinstance(target, Task):
        _check_task(target, kind, label)
        return target.run, signature_of(target.run), str(target.name).rsplit(".", 1)[-1]
    if not callable(target):
        raise ToolError(f"{label!r} is neither a Celery task nor a function")
    if kind == "write":
        raise ToolError(
            f"{label}: a write tool must be an IdempotentTask (base=IdempotentTask), not a "
            f"plain function: an effect must go through the gate"
        )
    try:
        signature: inspect.Signature | None = inspect.signature(target)
    except (TypeError, ValueError):
        signature = None
    return target, signature, getattr(target, "__name__", "")


def _check_task(target: Task, kind: ToolKind, label: str) -> None:
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


def _check_typed(signature: inspect.Signature, label: str) -> None:
    bare = [p.name for p in signature.parameters.values() if p.annotation is p.empty]
    if bare:
        these = f"parameter {bare[0]} has" if len(bare) == 1 else f"parameters {', '.join(bare)} have"
        raise ToolError(
            f"{label}: the {these} no type annotation, so a model's \"4200\" for a number "
            f"would reach the body as text; annotate each (amount_cents: int), or pass "
            f"untyped=True to take any JSON value as it comes")


def _with_write_note(description: str) -> str:
    return f"{description}\n\n{WRITE_NOTE}" if description else WRITE_NOTE


def _hand_written(parameters: Mapping[str, Any], label: str) -> dict[str, Any]:
    """A copy of a ``parameters=`` schema, checked now so a mistake fails here, not per call."""
    if not isinstance(parameters, Mapping) or parameters.get("type") != "object":
        raise ToolError(f"{label}: parameters must be a JSON Schema with \"type\": \"object\"")
    schema: dict[str, Any] = json.loads(json.dumps(dict(parameters)))
    try:
        check_schema(schema)
    except Exception as exc:  # jsonschema's SchemaError: the message says which keyword
        raise ToolError(f"{label}: parameters is not a valid JSON Schema: "
                        f"{str(exc).splitlines()[0]}") from None
    return schema


def _add_key_argument(schema: dict[str, Any], key_argument: str | None, kind: ToolKind,
                      label: str) -> bool:
    """Describe ``key_argument`` in ``schema``; return whether the task takes it too."""
    if key_argument is None:
        return True
    if kind != "write":
        raise ValueError(f"{label}: key_argument is for write tools (a read tool has no key)")
    properties = schema.setdefault("properties", {})
    if key_argument not in properties:
        # Not one of the task's parameters: the tool takes it, the task never sees it.
        properties[key_argument] = dict(_OWN_KEY)
        return False
    if properties[key_argument].get("type") not in (None, "string"):
        raise ValueError(f"{label}: key_argument {key_argument!r} must be a string parameter")
    return True
