"""A task's key identity (``IdempotentTask.idempotency_key_for``): the key of a call, bound to
the task's business signature (its arguments as Celery sends them), or the key a message's
header names; its fingerprint; and the argument a serializer refuses."""

from __future__ import annotations

import datetime as dt
import math
import threading
import time
from collections.abc import Mapping, Sequence
from contextvars import ContextVar
from typing import Any

from celery import signals
from celery.app.task import Context
from kombu.serialization import dumps

from . import keys
from .exceptions import InvalidKey

__all__ = ["BEAT_HEADER", "ERRBACK_FIELD", "HEADER", "PRINCIPAL_HEADER", "SCOPED_BODY",
           "UNBOUND_ARGS", "UNBOUND_KWARGS", "CallIdentity", "bind", "dump_pydantic_arguments",
           "failed_request", "header_key", "identify", "message_time", "scheduled_send"]

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


class CallIdentity:
    """One call's identity, as :func:`identify` fills it in: its stored ``key``, its ``scope``,
    whether the key is a caller's (``per_call``), and on demand its fingerprint and why it
    cannot be sent."""

    __slots__ = ("_bound", "_fingerprint", "args", "key", "kwargs", "per_call", "scope", "task")

    def __init__(self, task: Any, args: Sequence[Any] | None, kwargs: Mapping[str, Any] | None,
                 scope: str | None) -> None:
        self.task, self.args, self.kwargs = task, tuple(args or ()), dict(kwargs or {})
        self.key, self.per_call, self.scope = "", False, scope
        self._bound: dict[str, Any] | None = None  # the arguments as sent, once bound for the key
        self._fingerprint: tuple[str | None] | None = None  # (it,) once computed

    def fingerprint(self) -> str | None:
        """The hash stored with the record and compared on every later use of its key (computed
        once: the check, the reservation and the memory ask it): a per-call key's covers the
        identifying arguments; with ``idempotency_validate`` any key's covers the whole call. A
        derived key has its fields in the key, so otherwise none."""
        if self._fingerprint is None:
            cfg = self.task.idempotency_config
            digest = None
            if cfg.validate or (self.per_call and cfg.fingerprint):
                bound = self._bound
                if bound is None:
                    bound = bind(self.task, self.args, self.kwargs)
                if not cfg.validate and UNBOUND_ARGS not in bound:
                    bound = keys.select_fields(bound, cfg.fields)
                digest = keys.payload_hash(bound)
            self._fingerprint = (digest,)
        return self._fingerprint[0]

    def unsendable(self, serializer: str, exc: Exception) -> TypeError:
        """The TypeError naming the argument (as passed) that ``serializer`` could not encode,
        for a message Celery failed to encode with ``exc``."""
        name = self.task.name
        try:
            bound = bind(self.task, self.args, self.kwargs, as_sent=False)
        except TypeError:
            bound = {}  # the call does not bind: the message is blamed as a whole
        for field, value in bound.items():
            try:
                dumps(value, serializer=serializer)  # type: ignore[no-untyped-call]
            except Exception:
                return TypeError(f"{name}: argument {field!r} ({type(value).__qualname__}) cannot "
                                 f"be sent with the {serializer!r} serializer: {exc}; nothing was sent")
        return TypeError(f"{name}: the message cannot be encoded: {exc}; nothing was sent")


def identify(
    task: Any, args: Sequence[Any] | None, kwargs: Mapping[str, Any] | None, explicit: Any = None,
    scope: Any = None, at: float | dt.datetime | None = None, scheduled: bool = False, *,
    header: Any = None, any_scope: bool = False,
) -> CallIdentity:
    """The call's identity: the key a message's key ``header`` names (:func:`header_key`), else
    the caller's ``explicit`` key, else the key derived from the arguments.

    With ``idempotency_period`` a derived key gains the slot of ``at`` (default: now): the nearest
    one for a send of the schedule (``scheduled``), the current one for any other call."""
    cfg = task.idempotency_config
    call = CallIdentity(task, args, kwargs, scope)
    if header is not None:
        call.key, call.per_call, call.scope = header_key(task, header, scope, any_scope=any_scope)
        return call
    if scope is not None:
        keys.check_scope(scope)
    if explicit is not None:
        call.key, call.per_call = keys.caller_key(cfg.operation, explicit, scope), True
        return call
    slot = {} if cfg.period is None else {
        keys.SLOT_FIELD: keys.period_slot(_unix_time(at), cfg.period, nearest=scheduled)}
    if cfg.key_func is not None:
        identity = cfg.key_func(*call.args, **call.kwargs)
        if not isinstance(identity, str) or not identity:
            raise TypeError(f"{task.name}: idempotency_key_func returned {identity!r}; it must "
                            f"return a non-empty str")
        key = keys.key_from_fields(cfg.operation, slot, identity)
    else:
        errback = failed_request(call.args) is not None  # handling a failure is an action of its own
        # Bound once, for the key and (when validating) the fingerprint.
        bound = call._bound = bind(task, call.args, call.kwargs)
        fields = dict(bound) if UNBOUND_ARGS in bound else keys.select_fields(bound, cfg.fields)
        if errback:
            fields[ERRBACK_FIELD] = True
        key = keys.key_from_fields(cfg.operation, {**fields, **slot} if slot else fields)
    call.key = keys.scoped(key, cfg.operation, scope)
    if len(call.key) > keys.MAX_KEY_LENGTH:  # a derived key, as long as its operation makes it
        raise InvalidKey(f"{task.name}: the key {call.key[:60]!r}... is {len(call.key)} characters; "
                         f"the limit is {keys.MAX_KEY_LENGTH}: set a shorter idempotency_operation")
    return call


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
        args, kwargs = dump_pydantic_arguments(task, args, kwargs)
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


def dump_pydantic_arguments(task: Any, args: Sequence[Any],
                            kwargs: Mapping[str, Any]) -> tuple[Sequence[Any], Mapping[str, Any]]:
    """``args`` and ``kwargs`` as Celery's ``apply_async`` sends them for a ``pydantic=True`` task
    (dumped from Celery 5.7; as they are before, as those Celerys send them). Not behind the
    acceleration switch: keys are made of them."""
    dump = getattr(task, "_dump_pydantic_arguments", None)  # Celery >= 5.7
    if dump is None:
        return args, kwargs
    return dump(args, kwargs)  # type: ignore[no-any-return]


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

