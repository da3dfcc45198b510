"""Agent tools from Celery tasks, under their first import path.

The code lives in :mod:`celery_idem.contrib.tools` (an add-on built on the core's public API);
this module re-exports every public name, so ``from celery_idem.tools import Toolbox, tool``
keeps working.
"""

from __future__ import annotations

from .contrib.tools import (
    MAX_ARGUMENT_DEPTH,
    MAX_ARGUMENTS_SIZE,
    MAX_MESSAGE,
    NAME_PATTERN,
    OUTCOME_SCHEMA,
    STATUSES,
    WRITE_NOTE,
    Pending,
    Tool,
    Toolbox,
    ToolError,
    ToolKind,
    schema_for,
    tool,
    validate,
)

__all__ = ["MAX_ARGUMENTS_SIZE", "MAX_ARGUMENT_DEPTH", "MAX_MESSAGE", "NAME_PATTERN",
           "OUTCOME_SCHEMA", "STATUSES", "WRITE_NOTE", "Pending", "Tool", "ToolError", "ToolKind",
           "Toolbox", "schema_for", "tool", "validate"]
