"""Operator verbs shared by the ``celery idem`` CLI and the Django admin: release, forget, outcome.

Each verb reads the record, checks what the operator saw (the token shown on their screen) and
then writes through the store's fenced verb, so a claim taken over or recorded since the
operator looked is never touched. The interfaces (a confirmation prompt, an admin page) ask
before calling; the verbs log what they changed at WARNING on the ``celery_idem`` logger with
who asked (``by``), whichever interface it was.

Errors are :class:`Refused` with a machine-readable ``reason``; an interface maps it to its own
way of saying no (the CLI's exit codes: ``not_found`` 1, ``wrong_state`` 2, ``token_mismatch``
and ``changed`` 3).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Collection
from typing import Any, Final

from .codec import ERROR_CONTENT_TYPE, KombuCodec
from .exceptions import CorruptRecord, LeaseLost
from .records import Record, State
from .stores.base import Store

__all__ = ["Refused", "forget_outcome", "outcome", "release_claim"]

logger = logging.getLogger("celery_idem")

#: The longest one-line summary of a result.
SUMMARY_LENGTH: Final = 200


class Refused(Exception):
    """The verb changed nothing; ``reason`` says why.

    Attributes:
        reason: ``not_found``, ``wrong_state`` (not in progress for a release, not an outcome
            for a forget), ``token_mismatch`` (the record has another token than the one the
            operator saw) or ``changed`` (it changed between the read and the fenced write).
        record: The record as read, when there was one.
    """

    def __init__(self, reason: str, message: str, record: Record | None = None) -> None:
        super().__init__(message)
        self.reason = reason
        self.record = record


def _read(store: Store, key: str, seen_token: int | None, verb: str) -> Record:
    rec = store.get(key)
    if rec is None:
        raise Refused("not_found", f"no record for {key!r}; nothing was {verb}")
    if seen_token is not None and rec.token != seen_token:
        raise Refused(
            "token_mismatch",
            f"token mismatch: {key!r} changed meanwhile: it has token {rec.token}, and the token "
            f"seen was {seen_token} (it was claimed again, or taken over, since); nothing was "
            f"{verb}", rec)
    return rec


def release_claim(store: Store, key: str, seen_token: int | None, *, by: str) -> Record:
    """Give back the in-progress claim of ``key``, fenced on the token the operator saw.

    Args:
        store: The store (for the Django admin, one with an empty prefix and the stored key).
        key: The key as ``store`` names it.
        seen_token: The token shown to the operator; None releases whatever claim is there
            (still fenced by the token and claim id read here).
        by: Who asked, for the log (``cli``, ``admin:alice``).

    Returns:
        The record that was released (as it was before).

    Raises:
        Refused: Nothing was released (see :class:`Refused`).
        StoreUnavailable: The store could not be reached.
    """
    rec = _read(store, key, seen_token, "released")
    if rec.state is not State.IN_PROGRESS:
        raise Refused("wrong_state", f"{key!r} is {rec.state.value}, not in_progress: only a claim can "
                                     f"be released (a done or failed record is the outcome)", rec)
    try:
        # Fenced by the token and the claim id read: exactly the claim the operator saw.
        if rec.claim_id:
            store.release(key, rec.token, claim_id=rec.claim_id)
        else:
            store.release(key, rec.token)
    except LeaseLost as exc:
        raise Refused("changed", f"{key!r} changed meanwhile; nothing was released ({exc})", rec) from exc
    logger.warning("celery_idem released key=%s token=%s task_id=%s owner=%s by=%s",
                   key, rec.token, rec.task_id, rec.owner, by)
    return rec


def forget_outcome(store: Store, key: str, seen_token: int | None, *, by: str) -> Record:
    """Forget the done or failed outcome of ``key``, fenced on the token the operator saw.

    The next attempt of the action runs the body again (with the next token).

    Returns:
        The record that was forgotten (as it was before).

    Raises:
        Refused: Nothing was forgotten (see :class:`Refused`).
        StoreUnavailable: The store could not be reached.
    """
    rec = _read(store, key, seen_token, "forgotten")
    if rec.state not in (State.DONE, State.FAILED):
        raise Refused("wrong_state", f"{key!r} is {rec.state.value}, not done or failed: only an "
                                     f"outcome can be forgotten (a claim in progress: release)", rec)
    try:
        store.forget(key, rec.token)
    except LeaseLost as exc:
        raise Refused("changed", f"{key!r} changed meanwhile; nothing was forgotten ({exc})", rec) from exc
    logger.warning("celery_idem forgotten key=%s token=%s original_task_id=%s state=%s by=%s",
                   key, rec.token, rec.task_id, rec.state.value, by)
    return rec


def outcome(rec: Record, serializer: str = "json",
            accept: Collection[str] | None = None) -> tuple[dict[str, Any], str]:
    """The recorded result or error of ``rec``, decoded: as a JSON-able dict and one line.

    Args:
        rec: The record.
        serializer: The app's ``result_serializer``.
        accept: The app's ``result_accept_content`` (else ``accept_content``).

    Returns:
        ``({"result": ...}, summary)`` for a done record, ``({"error": {"type", "message"}},
        summary)`` for a failed one, ``({}, "-")`` otherwise. A value that cannot be decoded
        gives ``result_error`` instead of raising.
    """
    data = rec.data or b""
    ctype = rec.content_type or ""
    if rec.state is State.FAILED:
        if ctype == ERROR_CONTENT_TYPE:
            try:
                err = json.loads(data)
                error = {"type": f"{err['module']}.{err['type']}", "message": err["message"]}
                return {"error": error}, f"{err['type']}: {err['message']}"
            except (ValueError, TypeError, KeyError):
                pass
        return {"error": None}, f"<{len(data)} bytes of {ctype or 'unknown type'}, not readable>"
    if rec.state is not State.DONE:
        return {}, "-"
    codec = KombuCodec(serializer, accept)
    try:
        value = codec.decode_result(rec.key, ctype, data)
    except CorruptRecord as exc:
        return {"result": None, "result_error": str(exc)}, f"<not decoded: {exc}>"
    text = repr(value)
    if len(text) > SUMMARY_LENGTH:
        text = text[: SUMMARY_LENGTH - 1] + "…"
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        value = repr(value)
    return {"result": value, "content_type": ctype, "result_bytes": len(data)}, text
