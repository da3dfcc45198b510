"""Idempotency keys: one stable string per business action.

A key is ``f"{operation}:{sha256(canonical_json)[:32]}"`` where the canonical JSON is
``json.dumps({"op": operation, "id": business_id, **fields}, sort_keys=True, separators=(",", ":"))``
after each value has been put into its canonical form (:func:`canonical`; the forms are in
docs/concepts.md, "Key"). Numbers follow JSON's one number type, as RFC 8785 does: ``4200``,
``4200.0`` and ``4.2e3`` are one action. Anything without a form raises ``TypeError`` (a NaN or
an infinity ``ValueError``) naming the field, so a key is never built from ``repr()``.
"""

from __future__ import annotations

import base64
import dataclasses
import datetime as dt
import decimal
import enum
import hashlib
import inspect
import json
import math
import sys
import unicodedata
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from .exceptions import InvalidKey

__all__ = ["KeyParts", "bind_arguments", "caller_key", "canonical", "canonical_json", "check_scope",
           "check_text", "idempotency_key", "key_from_fields", "parse_key", "payload_hash",
           "period_slot", "scoped", "signature_of"]

#: Length of the hex digest kept in a key: 128 bits, collision-free for any realistic volume.
DIGEST_CHARS = 32


def idempotency_key(operation: str, business_id: Any = None, **fields: Any) -> str:
    """Return the idempotency key of one business action.

    Args:
        operation: What is done, e.g. ``"charge_card"``; it is also the key's readable prefix.
        business_id: The identity of the thing it is done to, e.g. an order id.
        **fields: More values that identify the action (amount, currency, ...).

    Returns:
        ``"<operation>:<32 hex chars>"``, stable across processes, hosts and Python versions.

    Raises:
        TypeError: A value has no canonical form; the message names the field.
        ValueError: ``operation`` is empty or not a string.

    Example:
        >>> idempotency_key("charge_card", "ord_8891", amount_cents=4200)
        'charge_card:...'
    """
    if not isinstance(operation, str) or not operation:
        raise ValueError(f"idempotency_key: operation must be a non-empty str, got {operation!r}")
    return key_from_fields(operation, fields, business_id)


def key_from_fields(operation: str, fields: Mapping[str, Any], business_id: Any = None) -> str:
    """:func:`idempotency_key` with the fields as a mapping, so arguments named ``operation``
    or ``business_id`` are fields like any other."""
    payload = {"op": operation, "id": business_id, **fields}
    return f"{operation}:{_digest(canonical_json(payload))}"


def canonical_json(payload: Mapping[str, Any]) -> str:
    """Return the canonical JSON text of ``payload`` (see the module docstring for the forms)."""
    return _ENCODE({str(name): value if type(value) in _SCALARS else canonical(value, str(name))
                    for name, value in payload.items()})


def payload_hash(arguments: Mapping[str, Any]) -> str:
    """Return the hash stored with ``idempotency_validate``: the full arguments, canonically."""
    return _digest(canonical_json(arguments))


#: The field a key of a task with ``idempotency_period`` gains: its enqueue's slot (no parameter
#: has this name, and keys without a period are unchanged).
SLOT_FIELD = "$slot"


def period_slot(at: float, period: float, *, nearest: bool = True) -> int | float:
    """The slot of a time: the multiple of ``period`` nearest to ``at`` (Unix seconds), shared by
    a send of the schedule a moment early and one a moment late; with ``nearest=False`` (a call
    that must never take the next scheduled run) the last one at or before ``at``. An ``int``
    when whole, so ``60`` and ``60.0`` agree.

    Example:
        >>> period_slot(1796461199.6, 60), period_slot(1796461200.9, 60)
        (1796461200, 1796461200)
    """
    centre = math.floor(at / period + (0.5 if nearest else 0.0)) * period
    return int(centre) if float(centre).is_integer() else centre


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:DIGEST_CHARS]


#: Types whose values are their own canonical form (exact: an IntEnum goes through canonical()).
_SCALARS = frozenset({str, int, bool, type(None)})

#: The canonical JSON text of a canonical value (no cycle check: a canonical value is built fresh).
_ENCODE: Callable[[Any], str] = json.JSONEncoder(
    sort_keys=True, separators=(",", ":"), check_circular=False).encode

_SUPPORTED = ("str, int, float, bool, None, list, tuple, dict with str keys, set, frozenset, "
              "datetime, date, time, Decimal, UUID, Enum, dataclass, bytes, bytearray, pydantic model")

#: Tag of the bytes form (JSON has none), and the tag escaping a dict that looks tagged.
BYTES_TAG = "$bytes"
DICT_TAG = "$dict"
_TAGS = frozenset({BYTES_TAG, DICT_TAG})


def canonical(value: Any, path: str = "value") -> Any:
    """Return ``value`` in its canonical JSON-ready form.

    Args:
        value: The value to convert.
        path: Where the value sits (``"items[2].sku"``), used in the error message.

    Raises:
        TypeError: The value (or a value inside it) has no canonical form.
        ValueError: A number is NaN or infinite (JSON has neither).
    """
    if type(value) in _SCALARS:
        return value
    if type(value) is float:  # before the isinstance chain: the common case after str and int
        return _number(value, path)
    if isinstance(value, enum.Enum):  # before its mixin types: an IntEnum is an int
        return canonical(value.value, path)
    if isinstance(value, (str, int)):  # a bool too: it stays true/false
        return value
    if isinstance(value, (float, decimal.Decimal)):
        return _number(value, path)
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for name, item in value.items():
            if not isinstance(name, str):
                raise TypeError(
                    f"idempotency key field {path!r} has a dict key {name!r} of type "
                    f"{type(name).__name__}; only str keys have a canonical form")
            out[name] = canonical(item, f"{path}.{name}")
        if len(out) == 1 and next(iter(out)) in _TAGS:
            # {"$bytes": "AP8="} passed as a dict must not be the same action as b"\x00\xff".
            return {DICT_TAG: out}
        return out
    if isinstance(value, (bytes, bytearray)):
        return {BYTES_TAG: base64.b64encode(value).decode("ascii")}
    if isinstance(value, (list, tuple)):
        return [canonical(item, f"{path}[{i}]") for i, item in enumerate(value)]
    if isinstance(value, (set, frozenset)):
        return sorted((canonical(item, f"{path}{{}}") for item in value), key=_ENCODE)
    if isinstance(value, dt.datetime) and value.utcoffset() is not None:  # aware: in UTC
        value = value.astimezone(dt.timezone.utc)
    if isinstance(value, (dt.date, dt.time)):
        return value.isoformat()
    if isinstance(value, uuid.UUID):
        return str(value)
    # Looked up, not imported: pydantic is optional, and a program that never imported it has no model.
    model = getattr(sys.modules.get("pydantic"), "BaseModel", None)
    if model is not None and isinstance(value, model):
        try:  # Celery's own dump (pydantic=True): the worker, given the dict, derives the same key
            dumped = value.model_dump(mode="json")
        except Exception as exc:
            raise TypeError(
                f"idempotency key field {path!r}: the {type(value).__qualname__} model cannot be "
                f"dumped to JSON ({exc}); pass idempotency_fields to leave it out of the key, or "
                f"idempotency_key_func to build the key yourself") from exc
        return canonical(dumped, path)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: canonical(getattr(value, f.name), f"{path}.{f.name}")
                for f in dataclasses.fields(value)}
    raise TypeError(
        f"idempotency key field {path!r} has type {type(value).__qualname__}, which has no "
        f"canonical form (supported: {_SUPPORTED}); pass idempotency_fields to leave it out of "
        f"the key, or idempotency_key_func to build the key yourself")


def _number(value: float | decimal.Decimal, path: str) -> int | float | str:
    """A number as JSON has it, one value whatever its spelling: an integral value is its
    ``int`` with every digit (``4200.0``, ``4.2e3`` and ``Decimal("4200.00")`` are ``4200``), a
    float otherwise, and a Decimal the float written with its digits, else its exact text."""
    if not (math.isfinite(value) if isinstance(value, float) else value.is_finite()):
        raise ValueError(f"idempotency key field {path!r} is {value}; JSON has no NaN or "
                         f"infinity, so it has no canonical form")
    if (whole := int(value)) == value:
        return whole
    if isinstance(value, float) or decimal.Decimal(repr(float(value))) == value:
        return float(value)  # float(): a plain float, not a subclass the encoder would not know
    # More digits than a float holds: fixed-point text, never rounded to the context's precision.
    return format(value.normalize(decimal.Context(prec=len(value.as_tuple().digits))), "f")


def bind_arguments(
    signature: inspect.Signature, args: Sequence[Any], kwargs: Mapping[str, Any]
) -> dict[str, Any]:
    """Bind a call to a task's signature with defaults applied, so ``f(1)`` and ``f(1, note="")``
    (``note`` defaulting to ``""``) get the same key; ``*args``/``**kwargs`` keep their names.

    Raises:
        TypeError: The call does not match the signature (as calling the function would).
    """
    plan = _plan(signature)
    if plan is not None and len(args) <= plan[1]:
        # By hand for named parameters: inspect's bind costs a third of a key's derivation. A
        # missing, unknown or repeated argument goes to inspect, which raises the TypeError.
        names, _, defaults = plan
        rest = names[len(args):]
        if sum(n in kwargs for n in rest) == len(kwargs) and all(n in kwargs or n in defaults for n in rest):
            return {**dict(zip(names, args, strict=False)),
                    **{n: kwargs[n] if n in kwargs else defaults[n] for n in rest}}
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


#: Per signature (by id, the signature kept so the id stays its own): its parameter names, how
#: many take a positional argument, and the defaults; None when inspect binds it.
_PLANS: dict[int, tuple[inspect.Signature, tuple[tuple[str, ...], int, dict[str, Any]] | None]] = {}


def _plan(signature: inspect.Signature) -> tuple[tuple[str, ...], int, dict[str, Any]] | None:
    kept = _PLANS.get(id(signature))
    if kept is None or kept[0] is not signature:
        ps = signature.parameters.values()
        kept = (signature, (tuple(p.name for p in ps), sum(p.kind is p.POSITIONAL_OR_KEYWORD for p in ps),
                            {p.name: p.default for p in ps if p.default is not p.empty})
                if all(p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) for p in ps) else None)
        if len(_PLANS) < 4096:  # one per task; signatures made per call are bound by inspect
            _PLANS[id(signature)] = kept
    return kept[1]


def signature_of(run: Any) -> inspect.Signature | None:
    """The business signature of a task's ``run`` (a function, a bound method or a
    ``staticmethod``): what a caller passes, without the ``self`` of an unbound ``bind=True``
    body. None when there is no body or its signature cannot be read (a builtin, say)."""
    if isinstance(run, staticmethod):
        run = run.__func__
    if run is None:
        return None
    try:
        sig = inspect.signature(run)
    except (TypeError, ValueError):
        return None
    params = list(sig.parameters.values())
    if getattr(run, "__self__", None) is None and params and params[0].name == "self":
        # An unbound ``bind=True`` body: ``self`` is the task, not a business argument.
        sig = sig.replace(parameters=params[1:])
    return sig


def select_fields(arguments: Mapping[str, Any], fields: Iterable[str] | None) -> dict[str, Any]:
    """Narrow bound arguments to ``fields`` (all of them when ``fields`` is None)."""
    return dict(arguments) if fields is None else {name: arguments[name] for name in fields}


# -- the key's namespace: ``operation[@scope]:ident`` (docs/concepts.md, "Key") ---------------------
# A caller's key names only an action of its operation, in its scope; derived idents are hex
# digests and per-call idents start with "key", so the two never meet.

#: Longest caller-supplied string: a per-call key, and a message's key header as a whole.
MAX_CALLER_KEY = 200
#: Longest stored key (without the store's prefix): the SQL stores' key column is 255 wide.
MAX_KEY_LENGTH = 240
#: Longest scope; scopes are names (a tenant, a principal), not payloads.
MAX_SCOPE = 64
CALLER_MARK = "key="
CALLER_HASH_MARK = "key#"
SCOPE_MARK = "@"

_SCOPE_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._~+=/-")
_HEX = frozenset("0123456789abcdef")


def check_text(what: str, value: Any, limit: int = MAX_CALLER_KEY) -> str:
    """Return ``value`` if it is a non-empty ``str`` of at most ``limit`` characters with no
    control or format characters (a newline forges a log line, an ANSI escape reaches a terminal,
    a bidi override disguises a key, a lone surrogate no store can encode), else raise
    :class:`InvalidKey` naming it ``what``."""
    if type(value) is not str:
        text = repr(value)
        text = text if len(text) <= 60 else text[:57] + "..."
        raise InvalidKey(f"{what} must be a str, got {type(value).__name__} {text}")
    if not value:
        raise InvalidKey(f"{what} must not be empty")
    if len(value) > limit:
        raise InvalidKey(f"{what} is {len(value)} characters; the limit is {limit} (hash long "
                         f"identities with celery_idem.idempotency_key)")
    if not value.isprintable():
        # str.isprintable() is False for non-ASCII spaces (Zs) too, which a terminal prints.
        bad = next(((i, c) for i, c in enumerate(value)
                    if not c.isprintable() and unicodedata.category(c) != "Zs"), None)
        if bad is not None:
            raise InvalidKey(f"{what} has the control or format character U+{ord(bad[1]):04X} at "
                             f"position {bad[0]}; keys are printable text")
    return value


def check_scope(scope: Any) -> str:
    """Return ``scope`` if it is 1 to 64 characters of ``A-Z a-z 0-9 . _ ~ + = / -`` (a tenant
    id, a principal; hash anything else with :func:`idempotency_key`), else raise InvalidKey."""
    check_text("idempotency_scope", scope, MAX_SCOPE)
    bad = next((c for c in scope if c not in _SCOPE_CHARS), None)
    if bad is not None:
        raise InvalidKey(f"idempotency_scope {scope!r} has the character {bad!r}; a scope is 1 "
                         f"to {MAX_SCOPE} characters of A-Z a-z 0-9 . _ ~ + = / -")
    return str(scope)


def scoped(key: str, operation: str, scope: str | None) -> str:
    """Put a derived key (``operation:<hex>``) in ``scope``; unscoped keys are unchanged."""
    return key if scope is None else f"{operation}{SCOPE_MARK}{scope}{key[len(operation):]}"


def caller_key(operation: str, key: Any, scope: str | None = None) -> str:
    """The stored key of a per-call key ``key`` passed to ``operation`` (in ``scope``).

    Raises:
        InvalidKey: :func:`check_text` refuses ``key``, or ``scope`` is not a valid scope.
    """
    check_text("idempotency_key", key)
    if scope is not None:
        check_scope(scope)
    head = operation if scope is None else f"{operation}{SCOPE_MARK}{scope}"
    full = f"{head}:{CALLER_MARK}{key}"
    if len(full) > MAX_KEY_LENGTH:
        # Still one action per caller key, only no longer readable in the store.
        full = f"{head}:{CALLER_HASH_MARK}{_digest(key)}"
    return full


@dataclasses.dataclass(frozen=True)
class KeyParts:
    """A stored key taken apart (:func:`parse_key`): ``caller`` is a per-call key's caller key
    (None: derived, or hashed), ``per_call`` whether it was passed (``idempotency_key=``)."""

    operation: str
    scope: str | None
    caller: str | None
    per_call: bool


def parse_key(key: str, operation: str) -> KeyParts | None:
    """Take apart ``key`` as a key of ``operation``; None for a key of another operation, a
    malformed scope or ident (the caller checks the whole with :func:`check_text`)."""
    if type(key) is not str or not key.startswith(operation):
        return None
    rest = key[len(operation):]
    scope = None
    if rest.startswith(SCOPE_MARK):
        scope, sep, rest = rest[1:].partition(":")
        if not sep or not scope or len(scope) > MAX_SCOPE or not _SCOPE_CHARS.issuperset(scope):
            return None
        rest = ":" + rest
    if not rest.startswith(":"):
        return None
    ident = rest[1:]
    if len(ident) == DIGEST_CHARS and _HEX.issuperset(ident):
        return KeyParts(operation, scope, None, per_call=False)
    if ident.startswith(CALLER_MARK) and len(ident) > len(CALLER_MARK):
        return KeyParts(operation, scope, ident[len(CALLER_MARK):], per_call=True)
    if ident.startswith(CALLER_HASH_MARK) and len(ident) == len(CALLER_HASH_MARK) + DIGEST_CHARS \
            and _HEX.issuperset(ident[len(CALLER_HASH_MARK):]):
        return KeyParts(operation, scope, None, per_call=True)
    return None
