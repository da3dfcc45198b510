"""The Redis store's record format (:class:`~celery_idem.stores.redis.RedisStore`).

Each record is ONE string at ``<prefix><key>`` (not a hash: a string has no per-field overhead
and no listpack-to-hashtable cliff for results over 64 bytes), packed as::

    0xC1 <state> <t> [. <n>] NUL <u> NUL <i> NUL <h> NUL <tail>

=====  ==========================================  ==========================================
0xC1   format marker (version 1); a value without   it is not a celery_idem record
       it under the prefix is foreign
state  ``i`` in_progress, ``d`` done, ``f`` failed, ``r`` released (one byte)
t      fencing token (decimal): max(previous + 1, server clock in µs), see
       ``celery_idem.stores.base`` ("Tokens")
n      claim id (8 base64url characters) after a dot; absent from a released tombstone and
       from records written before claim ids (they still parse, with an empty claim id)
u      last write, server ms (decimal)
i      task id of the claiming attempt (a canonical UUID packed as 0x01 + 22 base64url chars)
h      payload hash (idempotency_validate; empty when not validated)
tail   in_progress: ``<o> NUL <a> NUL <l>``: owner (host:pid), attempt (request.retries),
       lease expiry in server ms. done/failed: ``<c> NUL <d>``: content type (one byte code
       for the common ones, see ``CONTENT_TYPES``, else verbatim) and the encoded result or
       error, which is the rest of the value (any bytes, NULs included). released: empty.
=====  ==========================================  ==========================================

The client refuses a NUL in owner, task id, payload hash and content type (``ValueError``
naming the field, before anything is sent), so the header parses unambiguously; the data comes
last and is never scanned.
"""

from __future__ import annotations

import base64
import re
from typing import Any

from ..exceptions import CorruptRecord
from ..records import Record, State

__all__ = ["CONTENT_TYPES", "MARK", "STATE_CODE", "STATE_OF", "content_code", "decode", "pack_task_id",
           "refuse_nul", "unpack_task_id", "unreadable"]

#: The first byte of every record (format version 1): no UTF-8 text or msgpack starts with it.
MARK = b"\xc1"

#: A record's state byte -> State, and the state codes ``record`` sends.
STATE_OF = {ord("i"): State.IN_PROGRESS, ord("d"): State.DONE, ord("f"): State.FAILED,
            ord("r"): State.RELEASED}
STATE_CODE = {State.DONE: b"d", State.FAILED: b"f"}

#: Content types stored as a one-byte code (its index + 1); any other is stored verbatim (control
#: characters refused, so a code never reads as a verbatim type).
CONTENT_TYPES = (
    "application/json;utf-8",
    "application/x-celery-idem-error+json",
    "application/json",
    "application/x-python-serialize;binary",
    "application/x-msgpack;binary",
    "application/x-yaml;utf-8")
CONTENT_CODE = {ctype: bytes([n]) for n, ctype in enumerate(CONTENT_TYPES, 1)}
CONTENT_TYPE_OF = {code: ctype for ctype, code in CONTENT_CODE.items()}
_CONTROL = re.compile(r"[\x00-\x1f]")


def refuse_nul(**fields: str) -> None:
    """Raise a ValueError naming the first field holding a NUL (the record format's separator)."""
    for name, value in fields.items():
        if "\0" in value:
            raise ValueError(
                f"{name} must not contain a NUL character (the Redis record separator): {value!r}")


#: A canonical (lowercase, dashed) UUID task id, what Celery makes: stored as 16 bytes in
#: base64url after a 0x01 byte (23 characters instead of 36).
_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\Z")
_PACKED_ID = "\x01"


def pack_task_id(task_id: str) -> str:
    if _UUID.match(task_id):  # the hex digits of the UUID are its 16 bytes, in order
        raw = bytes.fromhex(task_id.replace("-", ""))
        return _PACKED_ID + base64.urlsafe_b64encode(raw).rstrip(b"=").decode()
    if task_id.startswith(_PACKED_ID):
        raise ValueError(f"task_id must not start with a \\x01 character (it marks a packed UUID in "
                         f"the Redis record): {task_id!r}")
    return task_id


def unpack_task_id(raw: bytes) -> str:
    if raw[:1] == b"\x01":  # a packed UUID: its 16 bytes, written as str(uuid.UUID) writes them
        h = base64.urlsafe_b64decode(raw[1:] + b"==").hex()
        if len(h) != 32:
            raise ValueError(f"a packed task id of {len(h) // 2} bytes")
        return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"
    return raw.decode()


def content_code(content_type: str) -> str | bytes:
    """What a record stores for ``content_type``: its one-byte code, or the type itself."""
    code = CONTENT_CODE.get(content_type)
    if code is not None:
        return code
    if _CONTROL.search(content_type):
        raise ValueError(
            f"content_type must not contain control characters (NUL separates the Redis "
            f"record's fields): {content_type!r}")
    return content_type


def unreadable(name: str, key: str, value: bytes | None, why: str = "") -> CorruptRecord:
    """The error for a value at ``name`` (``key``'s) that is not a readable record (left as it
    is); the value itself stays out of the message: it may be another program's data."""
    foreign = "another program wrote it, the prefix is shared, or an older celery_idem wrote it"
    if value is None:  # a script's verdict: not a record, or a damaged one
        what = f"is not a celery_idem record, or a damaged one ({foreign})"
    elif value[:1] == MARK:
        what = f"is a damaged celery_idem record{f' ({why})' if why else ''}"
    else:
        what = f"is not a celery_idem record ({foreign})"
    return CorruptRecord(f"the Redis key {name} {what}", key=key)


def _number(raw: bytes) -> int:
    # ASCII digits only, as the scripts' parse (%d+) reads them: int() would also take a sign,
    # spaces and underscores, and get() would read a value every script calls damaged.
    if not raw.isdigit():
        raise ValueError(f"{raw!r} is not a decimal number")
    return int(raw)


def decode(name: str, key: str, value: bytes) -> Record:
    """A stored record (see the module docstring) -> Record."""
    if value[:1] != MARK:
        raise unreadable(name, key, value)
    try:
        state = STATE_OF.get(value[1])
        if state is None:
            raise ValueError(f"unknown state {value[1:2]!r}")
        if state is State.RELEASED:
            head, u, _, _, tail = value.split(b"\0")
            if tail:
                raise ValueError("a released record has no tail")
            return Record(key=key, state=state, token=_number(head[2:]), updated=_number(u) / 1000)
        fields: dict[str, Any]
        if state is State.IN_PROGRESS:
            head, u, i, h, o, a, lease = value.split(b"\0")
            fields = {"owner": o.decode(), "attempt": _number(a), "lease_expires": _number(lease) / 1000}
        else:  # done, failed: the data is the rest of the value, NULs included
            head, u, i, h, c, d = value.split(b"\0", 5)
            fields = {"content_type": CONTENT_TYPE_OF.get(c) or c.decode() or None, "data": d}
        token, _, claim_id = head[2:].partition(b".")
        return Record(key=key, state=state, token=_number(token), task_id=unpack_task_id(i),
                      payload_hash=h.decode() or None, updated=_number(u) / 1000,
                      claim_id=claim_id.decode(), **fields)
    except (ValueError, IndexError, UnicodeDecodeError) as exc:
        raise unreadable(name, key, value, str(exc) or type(exc).__name__) from exc
