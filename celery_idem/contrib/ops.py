"""Operator verbs shared by the ``celery idem`` CLI and the Django admin: release, forget, outcome.

Each verb reads the record, checks what the operator saw (the token shown on their screen) and
then writes through the store's fenced verb, so a claim taken over or recorded since the
operator looked is never touched. The interfaces (a confirmation prompt, an admin page) ask
before calling; the verbs log what they changed at WARNING on the ``celery_idem`` logger with
who asked (an :class:`Operator`: :func:`audit`), whichever interface it was, and the interfaces
send it as an ``idem-operator`` event when the app sends events (:func:`send_operator_event`).

Errors are :class:`Refused` with a machine-readable ``reason``; an interface maps it to its own
way of saying no (the CLI's exit codes: ``not_found`` 1, ``wrong_state`` 2, ``token_mismatch``
and ``changed`` 3).

Stored strings (keys, owners, task ids, error text) are whatever was written to the store, by
celery_idem or by anyone else with access to it: every interface shows them through
:func:`printable` or :func:`shown`, so a control character never reaches a terminal or a log
line as itself. Stored results are decoded only on request (:func:`outcome` with
``decode=True``): decoding runs the app's serializer, and with pickle that runs code.
"""

from __future__ import annotations

import contextlib
import getpass
import json
import logging
import os
import socket
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any, Final

from ..codec import ERROR_CONTENT_TYPE, KombuCodec
from ..config import settings
from ..exceptions import CorruptRecord, LeaseLost
from ..records import Record, State
from ..stores.base import Store

__all__ = ["OPERATOR_EVENT_TYPE", "LeaseView", "Operator", "Refused", "audit", "forget_outcome",
           "lease_view", "outcome", "printable", "release_claim", "send_operator_event", "shown"]

logger = logging.getLogger("celery_idem")

#: The longest one-line summary of a result.
SUMMARY_LENGTH: Final = 200
#: The longest ``reason`` kept (log line and event); longer ones are cut.
REASON_LENGTH: Final = 500
#: The Celery event type of an operator's change (release, forget, purge).
OPERATOR_EVENT_TYPE: Final = "idem-operator"

#: A live holder renews its claim every third of its lease (celery_idem.lease), so at least two
#: thirds of the lease are left at any time. A claim with less than that, by more than this share
#: of the lease (and at least RENEWAL_MARGIN_MIN seconds, for a slow round trip or a late
#: thread), is not being renewed.
RENEWAL_MARGIN: Final = 0.1
RENEWAL_MARGIN_MIN: Final = 2.0

#: How characters that are not printable are written (the rest: ``\\xHH``, ``\\uHHHH``).
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(ch: str) -> str:
    if ch in _NAMED:
        return _NAMED[ch]
    code = ord(ch)
    # \xHH only below 0x80: in a shell's $'...' it is a byte, so U+0085 must be \u0085.
    if code < 0x80:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"


def printable(text: Any) -> str:
    """``text`` (made a str) with every character that is not printable written as an escape.

    Control characters (newline, ESC of an ANSI sequence, DEL), format characters (the
    bidirectional overrides such as U+202E), line and paragraph separators and non-ASCII spaces
    become ``\\n``, ``\\x1b``, ``\\u202e``...: a stored string can neither start a forged log line
    nor recolour, move or reorder what a terminal shows. For prose (messages, log lines); a value
    an operator may paste back into a command goes through :func:`shown`.
    """
    string = str(text)
    if string.isprintable():  # the common case: one C-level scan, no copy
        return string
    return "".join(ch if ch.isprintable() else _escape(ch) for ch in string)


def shown(text: Any) -> str:
    """``text`` as an operator should see it: as it is, or quoted as a shell's ``$'...'``.

    Printable text without a backslash is shown as it is. Anything else is written as bash's
    ANSI-C quoting, ``$'op:key=a\\x1b[31m'``, with the backslash and the quote escaped too: the
    output is unambiguous (shown text never holds a backslash escape unless it is quoted) and
    pasting it into a shell gives back the exact stored string.
    """
    string = str(text)
    if string.isprintable() and "\\" not in string and not string.startswith("$'"):
        return string
    body = "".join(
        "\\\\" if ch == "\\" else "\\'" if ch == "'" else ch if ch.isprintable() else _escape(ch)
        for ch in string
    )
    return f"$'{body}'"


@dataclass(frozen=True)
class Operator:
    """Who changes records, for the log line and the event.

    Attributes:
        by: The interface (``cli``, ``admin:alice``).
        user: The OS user (the CLI) or the admin's user name.
        host: The host the change was made from.
        reason: Why, as the operator said it (``--reason``); None when not given.
    """

    by: str
    user: str
    host: str
    reason: str | None = None

    @classmethod
    def here(cls, by: str, reason: str | None = None, user: str | None = None) -> Operator:
        """The operator of this process: ``user`` (default: the OS user) on this host."""
        return cls(by=by, user=user if user is not None else _os_user(), host=_host(),
                   reason=_clean_reason(reason))

    def fields(self) -> dict[str, Any]:
        """The operator as event fields and log ``extra``."""
        return {"by": self.by, "user": self.user, "host": self.host, "reason": self.reason}


def _os_user() -> str:
    # getpass.getuser() reads LOGNAME/USER/... then the password database; in a container
    # with an unnamed uid it raises (OSError, KeyError): the uid is still worth logging.
    try:
        return getpass.getuser()
    except Exception:  # any failure: fall back; the change must not fail on it
        uid = getattr(os, "getuid", None)
        return f"uid:{uid()}" if uid is not None else "unknown"


def _host() -> str:
    try:
        return socket.gethostname() or "unknown"
    except OSError:
        return "unknown"


def _clean_reason(reason: str | None) -> str | None:
    if reason is None:
        return None
    reason = reason.strip()
    if not reason:
        return None
    return reason if len(reason) <= REASON_LENGTH else reason[: REASON_LENGTH - 1] + "…"


def audit(verb: str, operator: Operator, **fields: Any) -> None:
    """Log one operator change at WARNING: the verb, what it touched, who, from where and why.

    One line of ``name=value`` pairs, every value through :func:`printable` (a key or reason
    with a newline cannot forge a second line), the same values in the record's
    ``idem_operator`` attribute for structured log handlers.

    Args:
        verb: What was done (``released``, ``forgotten``, ``purged``).
        operator: Who did it.
        fields: What it touched (``key``, ``token``, ``deleted``...), in the order to log them.
    """
    pairs = {**fields, **operator.fields()}
    line = " ".join(f"{name}={printable('-' if value is None else value)}"
                    for name, value in pairs.items())
    logger.warning("celery_idem %s %s", verb, line,
                   extra={"idem_operator": {"verb": verb, **pairs}})


def send_operator_event(app: Any, verb: str, operator: Operator, **fields: Any) -> str | None:
    """Send an ``idem-operator`` Celery event, when the app sends celery_idem's events.

    Sent when ``idempotency_events`` or ``worker_send_task_events`` is on (the settings a
    producer can see; a worker's ``-E`` is not visible from here). The broker connection is
    tried once (``broker_connection_timeout``), so a broker that is down costs one timeout, not
    Celery's retry loop; the change is already made and stays made.

    Args:
        app: The Celery app.
        verb: ``released``, ``forgotten`` or ``purged``.
        operator: Who did it.
        fields: What it touched, as in :func:`audit`.

    Returns:
        None when the event was sent or events are off; otherwise why it was not sent.
    """
    if not (settings(app).events or app.conf.get("worker_send_task_events")):
        return None
    try:
        with app.connection_for_write() as conn:
            conn.ensure_connection(max_retries=1)
            dispatcher = app.events.Dispatcher(conn, enabled=True, buffer_while_offline=False)
            try:
                dispatcher.send(OPERATOR_EVENT_TYPE, verb=verb, **fields, **operator.fields())
            finally:
                with contextlib.suppress(Exception):
                    dispatcher.close()
    except Exception as exc:  # monitoring never undoes or fails the change
        logger.debug("celery_idem operator event not sent verb=%s: %s", verb, exc)
        return f"{type(exc).__name__}: {printable(exc)}"
    return None


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


def _read(store: Store, key: str, seen_token: int | None, verb: str, states: tuple[State, ...],
          wrong_state: str) -> Record:
    rec = store.get(key)
    if rec is None:
        raise Refused("not_found", f"no record for {key!r}; nothing was {verb}")
    if seen_token is not None and rec.token != seen_token:
        raise Refused(
            "token_mismatch",
            f"token mismatch: {key!r} changed meanwhile: it has token {rec.token}, and the token "
            f"seen was {seen_token} (it was claimed again, or taken over, since); nothing was "
            f"{verb}", rec)
    if rec.state not in states:
        raise Refused("wrong_state", f"{key!r} is {rec.state.value}, not {wrong_state}", rec)
    return rec


def _fenced(write: Callable[[], None], key: str, verb: str, rec: Record) -> None:
    """Run the store's fenced ``write``; a record that changed since it was read is Refused."""
    try:
        write()
    except LeaseLost as exc:
        raise Refused("changed", f"{key!r} changed meanwhile; nothing was {verb} ({exc})", rec) from exc


def release_claim(store: Store, key: str, seen_token: int | None, *, by: str | Operator) -> Record:
    """Give back the in-progress claim of ``key``, fenced on the token the operator saw.

    Args:
        store: The store (for the Django admin, one with an empty prefix and the stored key).
        key: The key as ``store`` names it.
        seen_token: The token shown to the operator; None releases whatever claim is there
            (still fenced by the token and claim id read here).
        by: Who asked, for the log: an :class:`Operator`, or just the interface (``cli``,
            ``admin:alice``) for an operator of this process without a reason.

    Returns:
        The record that was released (as it was before).

    Raises:
        Refused: Nothing was released (see :class:`Refused`).
        StoreUnavailable: The store could not be reached.
    """
    rec = _read(store, key, seen_token, "released", (State.IN_PROGRESS,),
                "in_progress: only a claim can be released (a done or failed record is the outcome)")
    # Fenced by the token and the claim id read: exactly the claim the operator saw.
    _fenced(lambda: store.release(key, rec.token, claim_id=rec.claim_id or None), key, "released", rec)
    audit("released", _operator(by), key=key, token=rec.token, task_id=rec.task_id,
          owner=rec.owner)
    return rec


def forget_outcome(store: Store, key: str, seen_token: int | None, *, by: str | Operator) -> Record:
    """Forget the done or failed outcome of ``key``, fenced on the token the operator saw.

    The next attempt of the action runs the body again (with the next token). Arguments as
    :func:`release_claim`'s.

    Returns:
        The record that was forgotten (as it was before).

    Raises:
        Refused: Nothing was forgotten (see :class:`Refused`).
        StoreUnavailable: The store could not be reached.
    """
    rec = _read(store, key, seen_token, "forgotten", (State.DONE, State.FAILED),
                "done or failed: only an outcome can be forgotten (a claim in progress: release)")
    _fenced(lambda: store.forget(key, rec.token), key, "forgotten", rec)
    audit("forgotten", _operator(by), key=key, token=rec.token, original_task_id=rec.task_id,
          state=rec.state.value)
    return rec


def _operator(by: str | Operator) -> Operator:
    return by if isinstance(by, Operator) else Operator.here(by)


def outcome(rec: Record, serializer: str = "json", accept: Collection[str] | None = None, *,
            decode: bool = False) -> tuple[dict[str, Any], str]:
    """The recorded result or error of ``rec``: as a JSON-able dict, and one printable line.

    A failed record's error is celery_idem's own JSON (module, type, message), read with the
    standard library's ``json``, which runs no code: it is always shown. A done record's result
    is shown only with ``decode=True``: decoding runs the app's serializer on bytes anyone with
    write access to the store could have put there, and with pickle in ``accept`` that is code
    execution. Without it the dict has the content type and size of the stored value
    (``decoded: False``).

    Args:
        rec: The record.
        serializer: The app's ``result_serializer``.
        accept: The app's ``result_accept_content`` (else ``accept_content``).
        decode: Decode a done record's result with ``serializer``/``accept``.

    Returns:
        ``({"error": {"type", "message"}}, summary)`` for a failed record, ``({"content_type",
        "result_bytes", "decoded": False}, summary)`` for a done one, plus ``result`` (or
        ``result_error`` when it cannot be decoded or is not accepted) with ``decode=True``;
        ``({}, "-")`` otherwise. The summary is cut at :data:`SUMMARY_LENGTH` and escaped with
        :func:`printable`; the dict holds the values as stored.
    """
    data = rec.data or b""
    ctype = rec.content_type or ""
    if rec.state is State.FAILED:
        if ctype == ERROR_CONTENT_TYPE:
            try:
                err = json.loads(data)
                error = {"type": f"{err['module']}.{err['type']}", "message": err["message"]}
                return {"error": error}, _summary(f"{err['type']}: {err['message']}")
            except (ValueError, TypeError, KeyError):
                pass
        return {"error": None}, f"<{len(data)} bytes of {printable(ctype or 'unknown type')}, not readable>"
    if rec.state is not State.DONE:
        return {}, "-"
    meta: dict[str, Any] = {"content_type": ctype, "result_bytes": len(data), "decoded": decode}
    if not decode:
        return meta, f"<{len(data)} bytes of {printable(ctype or 'unknown type')}, not decoded>"
    codec = KombuCodec(serializer, accept)
    try:
        value = codec.decode_result(rec.key, ctype, data)
    except CorruptRecord as exc:
        return {**meta, "result": None, "result_error": str(exc)}, _summary(f"<not decoded: {exc}>")
    text = _summary(repr(value))
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        value = repr(value)
    return {**meta, "result": value}, text


def _summary(text: str) -> str:
    text = printable(text)
    return text if len(text) <= SUMMARY_LENGTH else text[: SUMMARY_LENGTH - 1] + "…"


@dataclass(frozen=True)
class LeaseView:
    """What an in-progress claim's lease says about its holder (:func:`lease_view`).

    Attributes:
        status: ``"live"`` (at least what a renewing holder keeps is left), ``"not_renewed"``
            (less: held after an unclassified error, or its holder is gone or stalled),
            ``"expired"``, or ``"unknown"`` (the lease is not expired, and the task's lease
            duration is not known, so no verdict).
        remaining: Seconds of lease left (negative: since it expired), on the store's clock.
        lease: The task's lease duration, when known.
        not_renewed_for: For ``not_renewed``: seconds since the claim was taken or last renewed.
    """

    status: str
    remaining: float
    lease: float | None = None
    not_renewed_for: float | None = None


def lease_view(rec: Record, now: float, lease: float | None) -> LeaseView | None:
    """Whether ``rec``'s holder is renewing its claim, as far as the record can tell.

    The record does not say why a claim is held: a holder that is running renews it every third
    of ``lease``; one that ended with an error the task does not classify (``held``) keeps it
    without renewing it until it runs out; so does a holder that died or is stalled. Only the
    time left tells them apart, and only once a renewal is overdue: for up to a third of the
    lease (plus the margin) after the last renewal, every claim reads ``live``.

    Args:
        rec: The record (None is returned unless it is an in-progress claim with a lease).
        now: The store's clock.
        lease: The lease duration of the record's task (``idempotency_lease``), or None.
    """
    if rec.state is not State.IN_PROGRESS or rec.lease_expires is None:
        return None
    remaining = rec.lease_expires - now
    if remaining <= 0:
        return LeaseView("expired", remaining, lease)
    if lease is None or lease <= 0:
        return LeaseView("unknown", remaining)
    margin = max(RENEWAL_MARGIN_MIN, lease * RENEWAL_MARGIN)
    # Since the claim was taken or last renewed, if it was taken with this lease (a renewal
    # resets the lease and leaves ``updated``, the claim's time, as it is).
    since = lease - remaining
    if rec.updated is not None:
        # A claim younger than a renewal period is never overdue (it was taken with a shorter
        # lease: an older setting of the task's).
        since = min(since, now - rec.updated)
    if remaining < lease * 2 / 3 - margin and since > lease / 3 + margin:
        return LeaseView("not_renewed", remaining, lease, since)
    return LeaseView("live", remaining, lease)
