"""A write tool's call as an action: what defines it, and how it differs from the recorded call.

A ``duplicate`` answer names the values that defined the action (``order_id="ord_1",
amount_cents=4200``), and the arguments outside the key whose values differ from the call that
did it (a ``currency`` that is not part of the key). For that, a call that starts an action
leaves a digest of each such argument in the result backend, next to its result (one write,
tool calls only, key-value backends such as Redis); a duplicate reads the original's.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ...keys import bind_arguments, payload_hash, signature_of

if TYPE_CHECKING:
    from .runtime import Tool

__all__ = ["duplicate_message", "remember"]

logger = logging.getLogger("celery_idem.tools")

#: Appended to the result's backend key (``celery-task-meta-<id>``) for the digests.
SUFFIX = ":tool-arguments"


def _bound(tool: Tool, arguments: Mapping[str, Any]) -> dict[str, Any]:
    """The call's arguments with the task's defaults, as its key binds them."""
    signature = signature_of(tool.target.run)
    try:
        return dict(arguments) if signature is None else bind_arguments(signature, (), arguments)
    except TypeError:  # the task refused them already; nothing to describe
        return dict(arguments)


def _outside_key(tool: Tool, bound: Mapping[str, Any]) -> dict[str, Any]:
    """The arguments that are not part of the action's key."""
    config = tool.target.idempotency_config
    if tool.key_argument is None and config.key_func is None:
        fields = config.fields if config.fields is not None else bound
        return {n: v for n, v in bound.items() if n not in fields}
    return {n: v for n, v in bound.items() if n != tool.key_argument}


def _digests(tool: Tool, arguments: Mapping[str, Any]) -> dict[str, str]:
    try:
        return {n: payload_hash({n: v})[:16]
                for n, v in _outside_key(tool, _bound(tool, arguments)).items()}
    except (TypeError, ValueError):  # no canonical form: nothing to compare it by
        return {}


def _slot(tool: Tool, task_id: str) -> tuple[Any, str] | None:
    backend = tool.target.backend
    if not (hasattr(backend, "set") and hasattr(backend, "get_key_for_task")):
        return None  # not a key-value backend (a database): no comparison
    return backend, backend.get_key_for_task(task_id, SUFFIX)


def remember(tool: Tool, task_id: str | None, arguments: Mapping[str, Any]) -> None:
    """Keep the digests of the call that started an action (best effort: never raises)."""
    digests = _digests(tool, arguments)
    slot = _slot(tool, task_id) if task_id and digests else None
    if slot is not None:
        try:
            slot[0].set(slot[1], json.dumps(digests))  # expires with the results
        except Exception as exc:  # the answer does not depend on it
            logger.debug("celery_idem.tools %s: arguments not kept: %r", tool.name, exc)


def _differing(tool: Tool, original: str, arguments: Mapping[str, Any]) -> list[str]:
    slot = _slot(tool, original)
    try:
        raw = slot[0].get(slot[1]) if slot is not None else None
        recorded = json.loads(raw) if raw else None
    except Exception:  # unreadable: say nothing rather than something false
        return []
    if not isinstance(recorded, dict):
        return []
    mine = _digests(tool, arguments)
    return sorted(n for n in mine.keys() | recorded.keys() if mine.get(n) != recorded.get(n))


def _show(value: Any) -> str:
    text = json.dumps(value, default=str, ensure_ascii=False)
    return text if len(text) <= 40 else text[:37] + "..."


def duplicate_message(tool: Tool, original: str | None, arguments: Mapping[str, Any]) -> str:
    """The ``duplicate`` message: what the action is, and what this call has that it had not."""
    config = tool.target.idempotency_config
    bound = _bound(tool, arguments)
    if tool.key_argument is not None:
        what = f"the key {tool.key_argument}={_show(arguments.get(tool.key_argument))}"
    elif config.key_func is not None:
        what = "the identity its idempotency_key_func gives these arguments"
    else:
        names = config.fields if config.fields is not None else bound
        what = ", ".join(f"{n}={_show(bound.get(n))}" for n in names) or "these arguments"
    message = (f"{tool.name} had already been done for {what} (task {original}); this is its "
               f"recorded result. It was not done again.")
    differing = _differing(tool, original, arguments) if original else []
    if differing:
        one = len(differing) == 1
        message += (f" {', '.join(differing)} {'differs' if one else 'differ'} from the recorded "
                    f"call; {'it is' if one else 'they are'} not part of this action's key.")
    return message
