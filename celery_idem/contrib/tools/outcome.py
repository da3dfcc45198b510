"""The shape of a tool call's answer: the outcome dict, its JSON Schema, and the limits on its text.

Every call returns a small JSON-serialisable dict, never an exception or a stack trace (the
package docstring shows it); :data:`OUTCOME_SCHEMA` is its JSON Schema (MCP's
``outputSchema``).
"""

from __future__ import annotations

import re
from typing import Any, Literal

__all__ = ["MAX_ARGUMENTS_SIZE", "MAX_ARGUMENT_DEPTH", "MAX_MESSAGE", "NAME_PATTERN",
           "OUTCOME_SCHEMA", "STATUSES", "WRITE_NOTE", "ToolError", "ToolKind", "short"]

ToolKind = Literal["read", "write"]
#: What a call's ``status`` can be.
STATUSES = ("ok", "duplicate", "in_progress", "error", "forbidden")
#: Tool names both vendors accept (OpenAI and Anthropic: letters, digits, ``_`` and ``-``).
NAME_PATTERN = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
#: Longest error text a model is shown (an exception message can be a whole HTTP body).
MAX_MESSAGE = 500
#: Deepest nesting of lists and objects a tool's arguments may have (the arguments object itself
#: is level 1). Real tool arguments are a few levels deep; a bound keeps the parser, the schema
#: check and the key's canonical form from recursing without end on a hostile input.
MAX_ARGUMENT_DEPTH = 32
#: Largest arguments a tool accepts, in characters of their JSON text (for a mapping: of its
#: strings, plus a few per value). A model's arguments are a few kilobytes.
MAX_ARGUMENTS_SIZE = 1_000_000
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
                                  "error: see error, retryable and message; forbidden: "
                                  "this caller may not do this, nothing was done."},
        "result": {"description": "The action's return value (null unless ok or duplicate)."},
        "message": {"type": "string", "description": "One sentence saying what to do next."},
        "tool": {"type": "string"},
        "idempotency_key": {"type": ["string", "null"],
                            "description": "The action's key (write tools)."},
        "task_id": {"type": ["string", "null"]},
        "error": {"type": "string", "description": "The error's type name (status error only)."},
        "retryable": {"type": "boolean",
                      "description": "Whether calling again may help (status error only)."},
        "error_id": {"type": "string",
                     "description": "The failure's id in the server's log (status error only, "
                                    "when the details are kept there): quote it to the user."},
    },
    "required": ["status", "result", "message", "tool", "idempotency_key", "task_id"],
}


class ToolError(TypeError):
    """Raised when a tool cannot be made from the given task or function (the message says why)."""


def short(exc: BaseException) -> str:
    """An exception as one line of at most :data:`MAX_MESSAGE` characters, for a model to read."""
    # One line (no traceback-like layout), no final period: it is put inside a sentence.
    text = " ".join(str(exc).split()).rstrip(".") or type(exc).__name__
    return text if len(text) <= MAX_MESSAGE else text[: MAX_MESSAGE - 3] + "..."
