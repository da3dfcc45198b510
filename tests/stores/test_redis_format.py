"""The Redis record format (celery_idem/stores/redis_format.py): its bytes, held to its docstring.

The Lua scripts write the records and :func:`~celery_idem.stores.redis_format.decode` reads
them. Here the docstring's layout and table are turned into a pattern, and three things are
held to it: a packer written from the docstring alone (``_pack``, the round trips through
``decode`` without a server), what the scripts write on a real Redis (for every state), and
``decode``'s refusals of values that do not follow it. What the store does with a record that is
not one (every verb leaves it alone) is test_redis.py's.
"""

from __future__ import annotations

import base64
import random
import re
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

import celery_idem.stores.redis_format as fmt
from celery_idem.exceptions import CorruptRecord
from celery_idem.records import ClaimStatus, Record, State
from celery_idem.stores.base import BackendWrite
from celery_idem.stores.redis import RedisStore
from celery_idem.stores.redis_format import (
    CONTENT_TYPES,
    MARK,
    STATE_CODE,
    STATE_OF,
    content_code,
    decode,
    pack_task_id,
    refuse_nul,
    unpack_task_id,
    unreadable,
)

from .support import LONG, claim

DOC = fmt.__doc__ or ""
B64 = rb"[A-Za-z0-9_-]"

#: Each placeholder of the documented layout -> the bytes it may hold (a named group). A field
#: the docstring adds or drops fails test_the_layout_names_exactly_the_fields_the_table_describes.
FIELDS: dict[str, bytes] = {
    "state": rb"(?P<state>[idfr])",
    "t": rb"(?P<t>[0-9]+)",
    "n": rb"(?P<n>" + B64 + rb"{8})",
    "u": rb"(?P<u>[0-9]+)",
    "i": rb"(?P<i>[^\x00]*)",
    "h": rb"(?P<h>[^\x00]*)",
    "o": rb"(?P<o>[^\x00]*)",
    "a": rb"(?P<a>[0-9]+)",
    "l": rb"(?P<l>[0-9]+)",
    "c": rb"(?P<c>[^\x00]*)",
    "d": rb"(?P<d>.*)",
}


def _layout() -> str:
    """The docstring's one-line layout of a record (``0xC1 <state> ...``)."""
    m = re.search(r"^\s*(0xC1 <state>.*<tail>)\s*$", DOC, re.M)
    assert m, "the module docstring no longer shows the record's layout line"
    return m.group(1)


def _tails() -> dict[State, str]:
    """The tail's layout of each state, as the docstring's ``tail`` row gives it."""
    row = re.search(r"^tail\s+(.*?)(?=^=====)", DOC, re.M | re.S)
    assert row, "the docstring's table has no tail row"
    text = " ".join(row.group(1).split())
    in_progress = re.search(r"in_progress: ``(.*?)``", text)
    finished = re.search(r"done/failed: ``(.*?)``", text)
    assert in_progress and finished and "released: empty" in text, text
    return {State.IN_PROGRESS: in_progress.group(1), State.DONE: finished.group(1),
            State.FAILED: finished.group(1), State.RELEASED: ""}


def _pattern(layout: str) -> bytes:
    """A layout (``<x> NUL <y>``, ``[. <n>]``, ``0xC1``) -> the regex of its bytes."""
    out = b""
    for part in re.findall(r"\[\. <\w+>\]|<\w+>|NUL|0xC1", layout):
        if part == "0xC1":
            out += re.escape(MARK)
        elif part == "NUL":
            out += rb"\x00"
        elif part.startswith("["):
            out += rb"(?:\." + FIELDS[part[4:-2]] + rb")?"
        else:
            out += FIELDS[part[1:-1]]
    return out


def documented(state: State) -> re.Pattern[bytes]:
    """The docstring's whole record in ``state``, as a regex (``fullmatch``)."""
    head, _, _ = _layout().rpartition("<tail>")
    return re.compile(_pattern(head) + _pattern(_tails()[state]), re.S)


def _pack(rec: Record) -> bytes:
    """A record's bytes, written from the docstring alone (the scripts are the real packer)."""
    assert rec.updated is not None
    code = {v: k for k, v in STATE_OF.items()}[rec.state]
    head = b"%c%d" % (code, rec.token) + (b"." + rec.claim_id.encode() if rec.claim_id else b"")
    if rec.state is State.RELEASED:
        return MARK + head + b"\x00%d\x00\x00\x00" % round(rec.updated * 1000)
    fields = [MARK + head, b"%d" % round(rec.updated * 1000), pack_task_id(rec.task_id).encode(),
              (rec.payload_hash or "").encode()]
    if rec.state is State.IN_PROGRESS:
        assert rec.lease_expires is not None
        fields += [rec.owner.encode(), b"%d" % rec.attempt, b"%d" % round(rec.lease_expires * 1000)]
    else:
        c = content_code(rec.content_type or "")
        fields += [c if isinstance(c, bytes) else c.encode(), rec.data or b""]
    return b"\x00".join(fields)


# -- the docstring ----------------------------------------------------------------------------


def test_the_layout_names_exactly_the_fields_the_table_describes() -> None:
    placeholders = set(re.findall(r"<(\w+)>", _layout())) - {"tail"}
    placeholders |= {f for tail in _tails().values() for f in re.findall(r"<(\w+)>", tail)}
    assert placeholders == set(FIELDS)
    rows = set(re.findall(r"^(\w+)\s{2,}", DOC.split("=====", 1)[1], re.M))
    assert rows >= {"state", "t", "n", "u", "i", "h", "tail"}, rows


def test_the_documented_state_codes_are_the_ones_decode_reads_and_record_sends() -> None:
    row = re.search(r"^state\s+(.*)$", DOC, re.M)
    assert row
    codes = dict(re.findall(r"``(\w)`` (\w+)", row.group(1)))
    assert {ord(c): State(v) for c, v in codes.items()} == STATE_OF
    assert {s: bytes([k]) for k, s in STATE_OF.items() if s in STATE_CODE} == STATE_CODE


# -- round trips without a server: the docstring's packer -> decode ---------------------------


def _records() -> list[Record]:
    uid = "0b7c5f2e-3a41-4c7e-9d2a-5b1f6e8a9c10"
    return [
        Record(key="k", state=State.IN_PROGRESS, token=1_764_000_000_123_456, owner="host:4242",
               task_id=uid, attempt=3, lease_expires=1_764_000_060.123, payload_hash="h1",
               updated=1_764_000_000.123, claim_id="AbC-_123"),
        Record(key="k", state=State.DONE, token=7, task_id="order-42/attempt", payload_hash=None,
               content_type="application/json;utf-8", data=b'[1, "\x00 NULs \x00 and all"]',
               updated=1_764_000_000.5, claim_id="zzzzzzzz"),
        Record(key="k", state=State.FAILED, token=8, task_id="", content_type="text/plain; ü",
               data=b"", updated=1.0, claim_id="00000000"),
        Record(key="k", state=State.RELEASED, token=9, updated=1_764_000_000.001),
        # A record written before claim ids: no ``.<n>``, read with an empty claim id.
        Record(key="k", state=State.IN_PROGRESS, token=1, owner="o", task_id="t", attempt=0,
               lease_expires=2.0, updated=1.0),
    ]


@pytest.mark.parametrize("rec", _records(), ids=lambda r: f"{r.state.value}-{r.token}")
def test_a_record_packed_as_documented_decodes_to_itself(rec: Record) -> None:
    value = _pack(rec)
    assert documented(rec.state).fullmatch(value), value
    assert decode("p:k", "k", value) == rec


def test_data_is_the_rest_of_the_value_and_is_never_scanned() -> None:
    data = b"\x00" * 3 + b"\xc1i1\x00" + bytes(range(256))
    rec = Record(key="k", state=State.DONE, token=2, task_id="t", content_type="c", data=data,
                 updated=1.0)
    assert decode("p:k", "k", _pack(rec)).data == data


# -- what the scripts write on a real Redis ---------------------------------------------------


@pytest.fixture
def store(redis_url: str, prefix: str, redis_cleanup: None) -> Iterator[RedisStore]:
    """A store on the shared server, under this test's prefix (its keys are deleted after)."""
    store = RedisStore.from_url(redis_url, prefix=prefix)
    yield store
    store.close()


@pytest.mark.parametrize("state", list(State), ids=lambda s: s.value)
def test_every_state_the_scripts_write_is_the_documented_layout_and_decodes_back(
    store: RedisStore, redis_client: Any, prefix: str, state: State
) -> None:
    task_id = str(uuid.uuid4())
    first = store.claim("k", owner="host:77", task_id=task_id, attempt=2, lease=30.0, ttl=LONG,
                        payload_hash="h-1")
    if state in (State.DONE, State.FAILED):
        store.record("k", first.token, state=state, content_type="application/msgpack-ish",
                     data=b"\x00res\x00", ttl=LONG, claim_id=first.claim_id)
    elif state is State.RELEASED:
        store.release("k", first.token, claim_id=first.claim_id)
    value = redis_client.get(prefix + "k")
    m = documented(state).fullmatch(value)
    assert m, f"{state.value} record {value!r} is not the docstring's layout"
    rec = decode(prefix + "k", "k", value)
    assert rec == store.get("k")
    # The fields hold what the docstring says, and decode reads them so
    assert int(m["t"]) == rec.token == first.token
    assert abs(rec.token / 1e6 - first.now) < 1.0  # the server clock in µs (a first claim)
    assert abs(int(m["u"]) / 1000 - store.now()) < 5.0
    assert rec.state is state
    if state is State.RELEASED:
        assert m["n"] is None and rec.claim_id == ""  # no claim id in a tombstone
        assert _pack(rec) == value
        return
    assert m["n"].decode() == rec.claim_id == first.claim_id
    assert re.fullmatch(rb"\x01" + B64 + rb"{22}", m["i"]) and rec.task_id == task_id
    assert m["h"] == b"h-1" and rec.payload_hash == "h-1"
    if state is State.IN_PROGRESS:
        assert (m["o"], int(m["a"])) == (b"host:77", 2) == (rec.owner.encode(), rec.attempt)
        assert int(m["l"]) / 1000 == rec.lease_expires == pytest.approx(first.now + 30.0, abs=0.002)
    else:
        assert (m["c"], m["d"]) == (b"application/msgpack-ish", b"\x00res\x00")
        assert (rec.content_type, rec.data) == ("application/msgpack-ish", b"\x00res\x00")
    assert _pack(rec) == value  # the scripts and the docstring's packer agree byte for byte


def test_a_done_record_is_one_string_in_the_documented_layout(
    store: RedisStore, redis_client: Any, prefix: str
) -> None:
    first = claim(store, "k", payload_hash="h1")
    store.record("k", first.token, state=State.DONE, content_type="application/json;utf-8",
                 data=b"[1]", ttl=LONG, claim_id=first.claim_id)
    value = redis_client.get(prefix + "k")
    rec = store.get("k")
    assert rec is not None and rec.updated is not None
    # marker, state, token (all its digits: no Lua number formatting), claim id, updated ms,
    # task id, payload hash, content type code, data
    assert value == b"\xc1d%d.%s\x00%d\x00task-a\x00h1\x00\x01\x00[1]" % (
        first.token, first.claim_id.encode(), round(rec.updated * 1000))
    assert (rec.state, rec.token, rec.claim_id, rec.task_id, rec.payload_hash, rec.content_type,
            rec.data, rec.owner, rec.attempt, rec.lease_expires) == (
        State.DONE, first.token, first.claim_id, "task-a", "h1", "application/json;utf-8",
        b"[1]", "", 0, None)


def test_an_in_progress_record_holds_owner_attempt_and_lease(
    store: RedisStore, redis_client: Any, prefix: str
) -> None:
    first = claim(store, "k", who="a", attempt=3, lease=30.0)
    value = redis_client.get(prefix + "k")
    assert value.startswith(b"\xc1i%d.%s\x00" % (first.token, first.claim_id.encode()))
    assert value.count(b"\x00") == 6
    rec = store.get("k")
    assert rec is not None
    assert (rec.state, rec.token, rec.claim_id, rec.owner, rec.task_id, rec.attempt,
            rec.payload_hash, rec.content_type, rec.data) == (
        State.IN_PROGRESS, first.token, first.claim_id, "host:a", "task-a", 3, None, None, None)
    assert rec.lease_expires == pytest.approx(first.now + 30.0, abs=0.002)
    assert rec.updated == pytest.approx(first.now, abs=0.002)
    # A renewal rewrites the lease only
    expires = store.renew("k", first.token, 45.0, claim_id=first.claim_id)
    renewed = store.get("k")
    assert renewed is not None and renewed.lease_expires == expires
    assert (renewed.owner, renewed.task_id, renewed.attempt, renewed.updated) == (
        "host:a", "task-a", 3, rec.updated)
    assert documented(State.IN_PROGRESS).fullmatch(redis_client.get(prefix + "k"))


# -- content types ----------------------------------------------------------------------------


def test_common_content_types_are_one_byte_their_index_plus_one() -> None:
    assert [content_code(c) for c in CONTENT_TYPES] == [bytes([n]) for n in range(1, 7)]
    assert content_code("text/plain; charset=ü") == "text/plain; charset=ü"
    assert content_code("") == ""


@pytest.mark.parametrize("char", [chr(n) for n in range(0x20)], ids=lambda c: f"{ord(c):#04x}")
def test_a_control_character_in_a_verbatim_content_type_is_refused(char: str) -> None:
    # A verbatim type could otherwise read as a one-byte code, or split the fields at a NUL.
    with pytest.raises(ValueError, match="content_type must not contain control characters"):
        content_code(f"text/{char}plain")


@pytest.mark.parametrize("content_type", CONTENT_TYPES)
def test_common_content_types_take_one_byte_and_read_back_in_full(
    store: RedisStore, redis_client: Any, prefix: str, content_type: str
) -> None:
    token = claim(store, "k").token
    store.record("k", token, state=State.FAILED, content_type=content_type, data=b"\x00x", ttl=LONG)
    value = redis_client.get(prefix + "k")
    assert value.endswith(b"\x00\x00x")
    assert value.split(b"\x00")[4] == bytes([CONTENT_TYPES.index(content_type) + 1])
    rec = store.get("k")
    assert rec is not None and (rec.content_type, rec.data) == (content_type, b"\x00x")


@pytest.mark.parametrize("content_type", ["text/plain; charset=ü", "", "x"])
def test_other_content_types_are_stored_verbatim(
    store: RedisStore, redis_client: Any, prefix: str, content_type: str
) -> None:
    token = claim(store, "k").token
    store.record("k", token, state=State.DONE, content_type=content_type, data=b"d", ttl=LONG)
    assert redis_client.get(prefix + "k").split(b"\x00")[4] == content_type.encode()
    rec = store.get("k")
    assert rec is not None and rec.content_type == (content_type or None)


def test_a_control_character_in_a_content_type_is_a_value_error(store: RedisStore) -> None:
    claim(store, "k")
    with pytest.raises(ValueError, match="content_type"):
        store.record("k", 1, state=State.DONE, content_type="\x01", data=b"", ttl=LONG)
    rec = store.get("k")
    assert rec is not None and rec.state is State.IN_PROGRESS


# -- NULs in header fields --------------------------------------------------------------------


def test_refuse_nul_names_the_first_field_holding_one() -> None:
    refuse_nul(owner="host:1", task_id="t", payload_hash="")  # none: no error
    with pytest.raises(ValueError, match=r"^task_id must not contain a NUL") as info:
        refuse_nul(owner="ok", task_id="a\x00b", payload_hash="c\x00d")
    assert "'a\\x00b'" in str(info.value)


@pytest.mark.parametrize(("verb", "field"), [
    ("claim", "owner"), ("claim", "task_id"), ("claim", "payload_hash"),
    ("record", "content_type"), ("record_with", "content_type"),
])
def test_a_nul_in_a_header_field_is_a_value_error_naming_it_and_nothing_is_sent(
    store: RedisStore, redis_client: Any, prefix: str, verb: str, field: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sent: list[Any] = []
    claim(store, "k")
    before = redis_client.get(prefix + "k")
    monkeypatch.setattr(store, "run_script", lambda *a, **kw: sent.append(a))
    kwargs: dict[str, Any] = {"owner": "host:a", "task_id": "t", "payload_hash": "h"}
    kwargs[field] = "bad\x00value"
    with pytest.raises(ValueError, match=field):
        if verb == "claim":
            store.claim("k", attempt=0, lease=LONG, ttl=LONG, **kwargs)
        elif verb == "record":
            store.record("k", 1, state=State.DONE, content_type=kwargs["content_type"], data=b"",
                         ttl=LONG)
        else:
            store.record_with("k", 1, state=State.DONE, content_type=kwargs["content_type"],
                              data=b"", ttl=LONG, also=BackendWrite("meta", b"m"))
    assert sent == [] and redis_client.get(prefix + "k") == before


# -- task ids ---------------------------------------------------------------------------------


#: Fixed across processes: pytest-xdist's workers must collect the same test ids.
_UUIDS = [str(uuid.UUID(int=random.Random(n).getrandbits(128), version=4)) for n in range(20)]


@pytest.mark.parametrize("task_id", [*_UUIDS, "00000000-0000-0000-0000-000000000000",
                                     "ffffffff-ffff-ffff-ffff-ffffffffffff"])
def test_a_canonical_uuid_packs_into_23_characters_and_back(task_id: str) -> None:
    packed = pack_task_id(task_id)
    assert re.fullmatch("\x01[A-Za-z0-9_-]{22}", packed), packed
    assert base64.urlsafe_b64decode(packed[1:] + "==") == uuid.UUID(task_id).bytes
    assert unpack_task_id(packed.encode()) == task_id


@pytest.mark.parametrize("task_id", [
    "0B7C5F2E-3A41-4C7E-9D2A-5B1F6E8A9C10",  # not canonical (upper case): verbatim
    "0b7c5f2e3a414c7e9d2a5b1f6e8a9c10",  # no dashes
    "0b7c5f2e-3a41-4c7e-9d2a-5b1f6e8a9c10\n",  # a trailing newline: not the whole id
    "order-42/attempt", "", "ü-☃",
])
def test_any_other_task_id_is_stored_verbatim_and_reads_back(task_id: str) -> None:
    assert pack_task_id(task_id) == task_id
    assert unpack_task_id(task_id.encode()) == task_id


def test_a_task_id_starting_with_the_packed_marker_is_refused_by_pack_task_id() -> None:
    with pytest.raises(ValueError, match=r"task_id must not start with a \\x01"):
        pack_task_id("\x01abc")


@pytest.mark.parametrize("raw", [b"\x01", b"\x01AAAA", b"\x01" + b"A" * 30])
def test_a_packed_task_id_of_the_wrong_length_is_a_value_error(raw: bytes) -> None:
    with pytest.raises(ValueError, match="a packed task id of"):
        unpack_task_id(raw)


@pytest.mark.parametrize("task_id", [
    "0b7c5f2e-3a41-4c7e-9d2a-5b1f6e8a9c10",  # Celery's: packed into 23 characters
    "0B7C5F2E-3A41-4C7E-9D2A-5B1F6E8A9C10",  # not canonical: stored as given
    "order-42/attempt", "",
])
def test_task_ids_read_back_exactly_and_celerys_uuids_take_23_characters(
    store: RedisStore, redis_client: Any, prefix: str, task_id: str
) -> None:
    first = store.claim("k", owner="o", task_id=task_id, attempt=0, lease=LONG, ttl=LONG)
    stored = redis_client.get(prefix + "k").split(b"\x00")[2]
    assert len(stored) == (23 if task_id.islower() and len(task_id) == 36 else len(task_id))
    assert (rec := store.get("k")) is not None and rec.task_id == task_id
    # The same task id with a higher attempt takes its own claim over: the packed ids compare.
    again = store.claim("k", owner="o", task_id=task_id, attempt=1, lease=LONG, ttl=LONG)
    assert again.status is ClaimStatus.TAKEOVER and again.token > first.token
    store.record("k", again.token, state=State.DONE, content_type="c", data=b"v", ttl=LONG)
    assert (rec := store.get("k")) is not None and rec.task_id == task_id


def test_a_task_id_starting_with_the_packed_marker_is_refused(store: RedisStore) -> None:
    with pytest.raises(ValueError, match="task_id"):
        store.claim("k", owner="o", task_id="\x01abc", attempt=0, lease=LONG, ttl=LONG)
    assert store.get("k") is None


# -- values that are not records --------------------------------------------------------------

_NOW = b"1764000000000"
DAMAGED = {
    "marker-only": b"\xc1",
    "unknown-state": b"\xc1x1\x00" + _NOW + b"\x00t\x00\x00c\x00[1]",
    "bad-token": b"\xc1dseven\x00" + _NOW + b"\x00t\x00\x00c\x00[1]",
    "empty-token": b"\xc1d\x00" + _NOW + b"\x00t\x00\x00c\x00[1]",
    # int() reads these; the scripts' %d+ does not, so neither may decode
    "signed-token": b"\xc1d+5\x00" + _NOW + b"\x00t\x00\x00c\x00[1]",
    "spaced-token": b"\xc1d 5\x00" + _NOW + b"\x00t\x00\x00c\x00[1]",
    "underscored-token": b"\xc1d1_0\x00" + _NOW + b"\x00t\x00\x00c\x00[1]",
    "negative-updated": b"\xc1d1\x00-" + _NOW + b"\x00t\x00\x00c\x00[1]",
    "negative-attempt": b"\xc1i1\x00" + _NOW + b"\x00t\x00\x00o\x00-3\x00" + _NOW,
    "spaced-lease": b"\xc1i1\x00" + _NOW + b"\x00t\x00\x00o\x000\x00 " + _NOW,
    "truncated": b"\xc1d1\x00" + _NOW,
    "no-lease": b"\xc1i1\x00" + _NOW + b"\x00t\x00\x00host:1\x000",
    "extra-in-progress-field": b"\xc1i1\x00" + _NOW + b"\x00t\x00\x00o\x000\x00" + _NOW + b"\x00x",
    "released-with-tail": b"\xc1r1\x00" + _NOW + b"\x00\x00\x00gone",
    "released-short": b"\xc1r1\x00" + _NOW,
    "released-with-claim-id": b"\xc1r1.AAAAAAAA\x00" + _NOW + b"\x00\x00\x00",
    "bad-packed-task-id": b"\xc1d1\x00" + _NOW + b"\x00\x01AAAA\x00\x00c\x00[1]",
    "owner-not-utf8": b"\xc1i1\x00" + _NOW + b"\x00t\x00\x00\xff\x000\x00" + _NOW,
}


@pytest.mark.parametrize("value", list(DAMAGED.values()), ids=list(DAMAGED))
def test_a_damaged_record_is_refused_saying_so_and_naming_the_key(value: bytes) -> None:
    with pytest.raises(CorruptRecord) as info:
        decode("p:order-1", "order-1", value)
    message = str(info.value)
    assert info.value.key == "order-1"
    assert message.startswith("the Redis key p:order-1 is a damaged celery_idem record (")
    assert message.endswith(")") and len(message) > len(
        "the Redis key p:order-1 is a damaged celery_idem record ()")  # why it is damaged


@pytest.mark.parametrize("value", [b"", b"written by another program", b"\xc0d1\x00", b"\x00"])
def test_a_value_without_the_marker_is_not_a_record_and_stays_out_of_the_message(
    value: bytes,
) -> None:
    with pytest.raises(CorruptRecord, match=r"^the Redis key p:k is not a celery_idem record "
                                            r"\(another program wrote it") as info:
        decode("p:k", "k", value)
    assert info.value.key == "k"
    if value:
        assert repr(value)[2:-1] not in str(info.value)


def test_unreadable_tells_a_scripts_corrupt_verdict_from_a_damaged_or_foreign_value() -> None:
    assert str(unreadable("p:k", "k", None)) == (
        "the Redis key p:k is not a celery_idem record, or a damaged one (another program wrote "
        "it, the prefix is shared, or an older celery_idem wrote it)")
    assert str(unreadable("p:k", "k", b"\xc1zz")) == "the Redis key p:k is a damaged celery_idem record"
    assert str(unreadable("p:k", "k", b"\xc1zz", "why")).endswith("damaged celery_idem record (why)")
    assert "is not a celery_idem record (" in str(unreadable("p:k", "k", b"plain"))
