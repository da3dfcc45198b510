"""Idempotency keys: one stable string per business action.

A key is ``f"{operation}:{sha256(canonical_json)[:32]}"`` where the canonical JSON is
``json.dumps({"op": operation, "id": business_id, **fields}, sort_keys=True, separators=(",", ":"))``
after each value has been put into its canonical form:

=================  =============================================================================
value              canonical form
=================  =============================================================================
str, int, float,   themselves (JSON); ``bool`` stays ``true``/``false``, never ``1``/``0``
bool, None
list, tuple        a JSON array (a tuple and a list with the same items are the same action)
dict               a JSON object; keys must be ``str``
set, frozenset     a JSON array of the canonical items, sorted by their canonical JSON text
datetime           ISO 8601; an aware datetime is first converted to UTC
                   (``2026-12-02T16:35:00+00:00``); a naive one is written as it is
date               ``YYYY-MM-DD``
time               ISO 8601 (``16:35:00``)
Decimal            fixed-point text of the normalized value (``Decimal("42.50")`` -> ``"42.5"``)
UUID               lower-case hyphenated text
Enum               the canonical form of its ``.value``
dataclass          a JSON object of its fields (recursively)
bytes, bytearray   ``{"$bytes": "<base64>"}``: standard base64 with padding (``b"\\x00\\xff"`` ->
                   ``{"$bytes":"AP8="}``); bytes and a bytearray with the same content are the
                   same action (a serializer may turn one into the other), never equal to a str
pydantic model     the canonical form of ``model.model_dump(mode="json")`` (so a model and the
                   dict Celery sends for it are the same action)
=================  =============================================================================

A dict whose only key is ``"$bytes"`` or ``"$dict"`` is written as ``{"$dict": {...}}``, so a
dict never takes the form of a bytes value, and bytes never share a key with a str or a dict.
Only such single-key dicts are escaped; every other dict is written as it is.

Anything else raises ``TypeError`` naming the field, so a key is never built from ``repr()``
(which differs between processes). The forms are pinned by golden vectors in the test suite.
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
import sys
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

__all__ = [
    "bind_arguments",
    "canonical",
    "canonical_json",
    "idempotency_key",
    "key_from_fields",
    "payload_hash",
]

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
    """:func:`idempotency_key` with the fields as a mapping (a task's bound arguments).

    A mapping, not keywords, so arguments named ``operation`` or ``business_id`` are fields
    like any other.
    """
    payload = {"op": operation, "id": business_id, **fields}
    return f"{operation}:{_digest(canonical_json(payload))}"


def canonical_json(payload: Mapping[str, Any]) -> str:
    """Return the canonical JSON text of ``payload`` (see the module docstring for the forms)."""
    return json.dumps(
        {str(name): canonical(value, str(name)) for name, value in payload.items()},
        sort_keys=True,
        separators=(",", ":"),
    )


def payload_hash(arguments: Mapping[str, Any]) -> str:
    """Return the hash stored with ``idempotency_validate``: the full arguments, canonically."""
    return _digest(canonical_json(arguments))


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:DIGEST_CHARS]


_SUPPORTED = (
    "str, int, float, bool, None, list, tuple, dict with str keys, set, frozenset, datetime, "
    "date, time, Decimal, UUID, Enum, dataclass, bytes, bytearray, pydantic model"
)

#: Tag of the bytes form, and the tag that escapes a user dict that would look like a tagged
#: form. JSON has no bytes, so bytes need a tag; the escape keeps the forms one-to-one.
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
    """
    # Order matters: bool before int (bool is an int), Enum before its mixin types (an IntEnum
    # is an int), datetime before date (a datetime is a date).
    if value is None or isinstance(value, (str, bool)):
        return value
    if isinstance(value, enum.Enum):
        return canonical(value.value, path)
    if isinstance(value, (int, float)):
        return value
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for name, item in value.items():
            if not isinstance(name, str):
                raise TypeError(
                    f"idempotency key field {path!r} has a dict key {name!r} of type "
                    f"{type(name).__name__}; only str keys have a canonical form"
                )
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
        items = [canonical(item, f"{path}{{}}") for item in value]
        return sorted(items, key=lambda item: json.dumps(item, sort_keys=True, separators=(",", ":")))
    if isinstance(value, dt.datetime):
        if value.tzinfo is not None and value.utcoffset() is not None:
            value = value.astimezone(dt.timezone.utc)
        return value.isoformat()
    if isinstance(value, (dt.date, dt.time)):
        return value.isoformat()
    if isinstance(value, decimal.Decimal):
        if not value.is_finite():
            return str(value)
        if not value:
            return "0"  # Decimal("-0") == Decimal("0.00") == 0
        # Strip trailing zeros without rounding: normalize() rounds to the context's precision,
        # so give it a context exactly as precise as the value (the thread's context is ignored).
        exact = decimal.Context(prec=max(len(value.as_tuple().digits), 1))
        return format(value.normalize(exact), "f")
    if isinstance(value, uuid.UUID):
        return str(value)
    if _is_pydantic_model(value):
        try:
            # mode="json" is Celery's own dump (pydantic=True): the worker, which gets the dict,
            # derives the same key as the producer, which had the model.
            dumped = value.model_dump(mode="json")
        except Exception as exc:
            raise TypeError(
                f"idempotency key field {path!r}: the {type(value).__qualname__} model cannot be "
                f"dumped to JSON ({exc}); pass idempotency_fields to leave it out of the key, or "
                f"idempotency_key_func to build the key yourself"
            ) from exc
        return canonical(dumped, path)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {
            f.name: canonical(getattr(value, f.name), f"{path}.{f.name}")
            for f in dataclasses.fields(value)
        }
    raise TypeError(
        f"idempotency key field {path!r} has type {type(value).__qualname__}, which has no "
        f"canonical form (supported: {_SUPPORTED}); pass idempotency_fields to leave it out of "
        f"the key, or idempotency_key_func to build the key yourself"
    )


def _is_pydantic_model(value: Any) -> bool:
    # Look pydantic up instead of importing it: it is optional, and a program that never
    # imported it cannot pass a model.
    pydantic = sys.modules.get("pydantic")
    model = getattr(pydantic, "BaseModel", None)
    return model is not None and isinstance(value, model)


def bind_arguments(
    signature: inspect.Signature, args: Sequence[Any], kwargs: Mapping[str, Any]
) -> dict[str, Any]:
    """Bind a call to a task's signature with defaults applied.

    ``f(1)`` and ``f(1, note="")`` where ``note`` defaults to ``""`` bind to the same mapping,
    so they get the same key. ``*args`` and ``**kwargs`` of the signature are kept under their
    parameter names.

    Raises:
        TypeError: The call does not match the signature (as calling the function would).
    """
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def select_fields(
    arguments: Mapping[str, Any], fields: Iterable[str] | None
) -> dict[str, Any]:
    """Narrow bound arguments to ``fields`` (all of them when ``fields`` is None)."""
    if fields is None:
        return dict(arguments)
    return {name: arguments[name] for name in fields}


KeyFunc = Callable[..., str]
