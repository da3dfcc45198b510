"""What a ``duplicate`` says: the values that defined the action, and the arguments outside its
key whose values differ from the call that did it (``currency`` when the key is the order and
the amount). A call that starts an action keeps a digest of each such argument next to its result
(one write, tool calls only, key-value result backends such as Redis); a duplicate reads them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ...keys import bind_arguments, payload_hash, signature_of

if TYPE_CHECKING:
    from .runtime import Tool

__all__ = ["duplicate_message", "remember"]


def _bound(tool: Tool, arguments: Mapping[str, Any]) -> dict[str, Any]:
    """The call's arguments with the task's defaults, as its key binds them."""
    signature = signature_of(tool.target.run)
    try:
        return dict(arguments) if signature is None else bind_arguments(signature, (), arguments)
    except TypeError:  # the task refused them already
        return dict(arguments)


def _digests(tool: Tool, arguments: Mapping[str, Any]) -> dict[str, str]:
    """A digest of each argument outside the action's key."""
    bound, config = _bound(tool, arguments), tool.target.idempotency_config
    if tool.key_argument is None and config.key_func is None:
        key = set(bound if config.fields is None else config.fields)
    else:
        key = {tool.key_argument}
    try:
        return {n: payload_hash({n: v})[:16] for n, v in bound.items() if n not in key}
    except (TypeError, ValueError):  # no canonical form: nothing to compare it by
        return {}


def _slot(tool: Tool, task_id: str) -> tuple[Any, str] | None:
    backend = tool.target.backend
    if not hasattr(backend, "set") or not hasattr(backend, "get_key_for_task"):
        return None  # not a key-value backend (a database): no comparison
    return backend, backend.get_key_for_task(task_id, ":tool-arguments")


def remember(tool: Tool, task_id: str | None, arguments: Mapping[str, Any]) -> None:
    """Keep the digests of the call that started an action (best effort: never raises)."""
    digests = _digests(tool, arguments)
    slot = _slot(tool, task_id) if task_id and digests else None
    try:
        if slot is not None:
            slot[0].set(slot[1], json.dumps(digests))  # expires with the results
    except Exception:  # a later duplicate only says less
        return


def _differing(tool: Tool, original: str, arguments: Mapping[str, Any]) -> list[str]:
    slot = _slot(tool, original)
    try:
        recorded = json.loads(slot[0].get(slot[1]) or "null") if slot is not None else None
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
    config, bound = tool.target.idempotency_config, _bound(tool, arguments)
    if tool.key_argument is not None:
        what = f"the key {tool.key_argument}={_show(arguments.get(tool.key_argument))}"
    elif config.key_func is not None:
        what = "the identity its idempotency_key_func gives these arguments"
    else:
        names = bound if config.fields is None else config.fields
        what = ", ".join(f"{n}={_show(bound.get(n))}" for n in names) or "these arguments"
    message = (f"{tool.name} had already been done for {what} (task {original}); this is its "
               f"recorded result. It was not done again.")
    differing = _differing(tool, original, arguments) if original else []
    if len(differing) == 1:
        message += f" {differing[0]} differs from the recorded call; it is not part of this " \
                   f"action's key."
    elif differing:
        message += f" {', '.join(differing)} differ from the recorded call; they are not part " \
                   f"of this action's key."
    return message
