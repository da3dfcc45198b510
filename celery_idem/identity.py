"""A task's key identity (``IdempotentTask.idempotency_key_for``): the key of a call, bound to
the task's business signature, its fingerprint, and the key a message's header names."""

from __future__ import annotations

import datetime as dt
import functools
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from contextvars import ContextVar
from typing import Any

from celery import signals
from celery.app.task import Context

from . import keys
from .compat import dump_pydantic_arguments
from .exceptions import InvalidKey

__all__ = ["BEAT_HEADER", "ERRBACK_FIELD", "HEADER", "PRINCIPAL_HEADER", "SCOPED_BODY",
           "UNBOUND_ARGS", "UNBOUND_KWARGS", "bind", "failed_request", "fingerprint_of",
           "header_key", "identify", "message_time", "scheduled_send"]

#: Message header that carries the key through retries, redeliveries and canvas.
HEADER = "idempotency_key"
#: Message header Celery beat sets on every message it sends: a send of the schedule.
BEAT_HEADER = "celery_beat_task"
#: Message header naming who asked for the action (``IdempotentTask.idempotency_principal``).
PRINCIPAL_HEADER = "idempotency_principal"
#: Set once a scoped body ran in this thread: only then does an enqueue look its parent up (µs).
SCOPED_BODY: ContextVar[bool] = ContextVar("celery_idem_scoped_body", default=False)
#: Fields of the key of a call that does not bind to the signature (``typing=False``), and the
#: field that marks a new-style errback's key. Not identifiers, so no parameter has these names.
UNBOUND_ARGS = "*args"
UNBOUND_KWARGS = "**kwargs"
ERRBACK_FIELD = "$errback"

_BEAT = threading.local()  # marks a beat service's thread, for a beat that sets no header
for _signal in (signals.beat_init, signals.beat_embedded_init):
    _signal.connect(lambda **_: setattr(_BEAT, "on", True), weak=False)


def scheduled_send(headers: Mapping[str, Any]) -> bool:
    """Whether a publish is beat's send of the schedule (beat's header, or a beat thread's)."""
    return bool(headers.get(BEAT_HEADER)) or getattr(_BEAT, "on", False)


def identify(
    task: Any, args: Sequence[Any] | None, kwargs: Mapping[str, Any] | None, explicit: Any,
    scope: Any, at: float | dt.datetime | None = None, scheduled: bool = False,
) -> tuple[str, Callable[[], str | None]]:
    """The call's key, and a function computing its fingerprint (None: not checked) when asked.

    With ``idempotency_period`` a derived key gains the slot of ``at`` (default: now): the nearest
    one for a send of the schedule (``scheduled``), the current one for any other call."""
    cfg = task.idempotency_config
    args, kwargs = tuple(args or ()), dict(kwargs or {})
    if scope is not None:
        keys.check_scope(scope)
    if explicit is not None:
        key = keys.caller_key(cfg.operation, explicit, scope)
        return key, functools.cache(functools.partial(fingerprint_of, task, args, kwargs, True))
    slot = {} if cfg.period is None else {
        keys.SLOT_FIELD: keys.period_slot(_unix_time(at), cfg.period, nearest=scheduled)}
    if cfg.key_func is not None:
        identity = cfg.key_func(*args, **kwargs)
        if not isinstance(identity, str) or not identity:
            raise TypeError(f"{task.name}: idempotency_key_func returned {identity!r}; it must "
                            f"return a non-empty str")
        key = keys.key_from_fields(cfg.operation, slot, identity)
        fingerprint: Callable[[], str | None] = functools.partial(fingerprint_of, task, args, kwargs, False)
    else:
        bound = bind(task, args, kwargs)
        fields = dict(bound) if UNBOUND_ARGS in bound else keys.select_fields(bound, cfg.fields)
        if failed_request(args) is not None:  # handling a failure is an action of its own
            fields[ERRBACK_FIELD] = True
        key = keys.key_from_fields(cfg.operation, {**fields, **slot} if slot else fields)
        # The arguments are bound once, for the key and (when validating) the fingerprint.
        fingerprint = functools.partial(keys.payload_hash, bound) if cfg.validate else lambda: None
    key = keys.scoped(key, cfg.operation, scope)
    if len(key) > keys.MAX_KEY_LENGTH:  # a derived key, as long as its operation makes it
        raise InvalidKey(f"{task.name}: the key {key[:60]!r}... is {len(key)} characters; the "
                         f"limit is {keys.MAX_KEY_LENGTH}: set a shorter idempotency_operation")
    return key, functools.cache(fingerprint)  # asked by the check, the reservation and the memory


def fingerprint_of(task: Any, args: Sequence[Any], kwargs: Mapping[str, Any],
                   per_call: bool) -> str | None:
    """The hash stored with the record and compared on every later use of its key: a per-call
    key's covers the identifying arguments; with ``idempotency_validate`` any key's covers the
    whole call. A derived key has its fields in the key, so otherwise none."""
    cfg = task.idempotency_config
    if not (cfg.validate or (per_call and cfg.fingerprint)):
        return None
    bound = bind(task, args, kwargs)
    if not cfg.validate and UNBOUND_ARGS not in bound:
        bound = keys.select_fields(bound, cfg.fields)
    return keys.payload_hash(bound)


def header_key(task: Any, header: Any, scope: str | None = None, *,
               any_scope: bool = False) -> tuple[str, bool, str | None]:
    """The stored key of a message's key header, whether it is a per-call key, and its scope.

    Checked as a caller's key is (``InvalidKey``: nothing is claimed or stored). A key of this
    task's operation in ``scope`` (any scope with ``any_scope``: the worker's message is the
    authority) is used as it is; anything else is a caller's key of this operation in ``scope``."""
    what = f"{task.name}: the message's {HEADER} header"
    keys.check_text(what, header, keys.MAX_KEY_LENGTH)
    operation = task.idempotency_config.operation
    parts = keys.parse_key(header, operation)
    if parts is not None and (any_scope or parts.scope == scope):
        return header, parts.per_call, parts.scope
    if len(header) > keys.MAX_CALLER_KEY:
        keys.check_text(what, header)  # raises: too long for a caller's key
    return keys.caller_key(operation, header, scope), True, scope


def bind(task: Any, args: Sequence[Any], kwargs: Mapping[str, Any], *,
         as_sent: bool = True) -> dict[str, Any]:
    """The call's arguments by parameter name (``as_sent``: as Celery sends them, whoever calls);
    TypeError when they do not bind and the task checks its arguments (``typing``)."""
    if as_sent:
        # An errback's (request, exc, traceback) become (the failed task's id, None, None); a
        # pydantic=True task's models are dumped as apply_async does: apply(), delay() and a
        # worker agree.
        failed = failed_request(args)
        if failed is not None:
            args = (failed.id, *(None for _ in args[1:3]), *args[3:])
        args, kwargs = dump_pydantic_arguments(task, args, kwargs)  # not switched: keys use them
    signature = task._signature
    if signature is None:
        return {"args": list(args), "kwargs": dict(kwargs)}
    try:
        return keys.bind_arguments(signature, args, kwargs)
    except TypeError as exc:
        typing = task.typing if task.typing is not None else task.app.strict_typing
        if not typing:  # Celery sends it (the worker's signature may differ): keyed as passed
            return {UNBOUND_ARGS: list(args), UNBOUND_KWARGS: dict(kwargs)}
        raise TypeError(f"{task.name}{signature}: {exc}") from None


def failed_request(args: Sequence[Any]) -> Context | None:
    """The failed task's ``Context`` when ``args`` are a new-style errback call's (a message
    never carries one), else None."""
    return args[0] if args and isinstance(args[0], Context) else None


def _clock() -> float:
    """The wall clock a period's slot is read from (a function, so tests can replace it)."""
    return time.time()


def _unix_time(at: float | dt.datetime | None) -> float:
    """``at`` as Unix seconds: now when None; an aware datetime converted; a naive one refused."""
    if at is None:
        return _clock()
    if isinstance(at, dt.datetime):
        if at.tzinfo is None or at.utcoffset() is None:
            raise ValueError(f"at={at!r} is a naive datetime; pass an aware one (tzinfo set) "
                             f"or Unix seconds")
        return at.timestamp()
    if isinstance(at, bool) or not isinstance(at, (int, float)):
        raise TypeError(f"at must be Unix seconds or an aware datetime, got {at!r}")
    return float(at)


def message_time(request: Any) -> float | None:
    """The message's ``timestamp`` property as Unix seconds (a naive datetime is UTC), or
    None: Celery's own messages carry no sending time."""
    properties = getattr(request, "properties", None)
    stamp = properties.get("timestamp") if isinstance(properties, Mapping) else None
    if isinstance(stamp, dt.datetime):
        return (stamp if stamp.tzinfo else stamp.replace(tzinfo=dt.timezone.utc)).timestamp()
    if isinstance(stamp, (int, float)) and not isinstance(stamp, bool) and math.isfinite(stamp) \
            and stamp > 0:
        return float(stamp)
    return None

