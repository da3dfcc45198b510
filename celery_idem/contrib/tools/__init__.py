"""Agent tools from Celery tasks: one callable per task, with a JSON Schema and safe outcomes.

:func:`tool` turns a task (or, for a read tool, a plain function) into a :class:`Tool` an LLM
agent can call::

    from celery_idem.contrib.tools import Toolbox, tool

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
     "error": "TypeName", "retryable": bool,   # only when status is "error"
     "error_id": "..."}                        # when the error's text went to the log only

``duplicate`` is a success: the action had already been done and this is its recorded result.
A body's error shows the model its type and an ``error_id`` (the text is logged under that id
on the ``celery_idem.contrib.tools`` logger), unless it is a :class:`~celery_idem.TerminalError` or
marked safe to show (``tool(..., expose_errors=...)``). ``Toolbox(..., scope=...)`` and
``call(..., scope=...)`` put a write call's key in the caller's scope.
``in_progress`` means the bounded wait ran out while the action runs; calling again with the
same arguments is safe and returns the result once it is there.

This package imports neither ``redis`` nor ``sqlalchemy``; LangChain is imported only by
:meth:`Tool.langchain` and pydantic-ai only by :meth:`Tool.pydantic_ai`, each only if it is
installed. Every call has an async twin (:meth:`Tool.acall`, :meth:`Toolbox.acall`) that
never blocks the event loop; :mod:`celery_idem.contrib.mcp` serves a toolbox over MCP.

The package, along its seams:

- :mod:`~celery_idem.contrib.tools.schema`: the JSON Schema of a signature (pydantic) and the
  description from a docstring;
- :mod:`~celery_idem.contrib.tools.validation`: a model's arguments checked against that
  schema (jsonschema), each problem one sentence naming the argument;
- :mod:`~celery_idem.contrib.tools.factory` (:func:`tool`), :mod:`~celery_idem.contrib.tools.runtime`
  (:class:`Tool`, :class:`Pending`) and :mod:`~celery_idem.contrib.tools.toolbox`
  (:class:`Toolbox`): making and calling tools;
- :mod:`~celery_idem.contrib.tools.formats`: OpenAI, Anthropic, MCP, LangChain, pydantic-ai;
- :mod:`~celery_idem.contrib.tools.outcome`: the outcome dict's schema and limits.

Building a tool needs the ``[tools]`` extra (pydantic and jsonschema); both are imported when
the first tool is built or called, not with this package.
"""

from __future__ import annotations

from .factory import tool
from .outcome import (
    MAX_ARGUMENT_DEPTH,
    MAX_ARGUMENTS_SIZE,
    MAX_MESSAGE,
    NAME_PATTERN,
    OUTCOME_SCHEMA,
    STATUSES,
    WRITE_NOTE,
    ToolKind,
)
from .runtime import Pending, Tool
from .schema import ToolError, schema_for
from .toolbox import Toolbox
from .validation import validate

__all__ = ["MAX_ARGUMENTS_SIZE", "MAX_ARGUMENT_DEPTH", "MAX_MESSAGE", "NAME_PATTERN",
           "OUTCOME_SCHEMA", "STATUSES", "WRITE_NOTE", "Pending", "Tool", "ToolError", "ToolKind",
           "Toolbox", "schema_for", "tool", "validate"]
