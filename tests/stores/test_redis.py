"""What only the Redis store does: Lua scripts, foreign keys, error mapping, memory, restarts.

The store contract itself is tested for every store, this one included, in test_contract.py.
Tests on the shared server use a prefix of their own and delete its keys afterwards (SCAN + DEL,
never FLUSHDB). Tests that flush scripts or kill the server get a private ``redis-server``.
The record's bytes (the format, content type codes, packed task ids) are test_redis_format.py's.
"""

from __future__ import annotations

import inspect
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
import redis.exceptions

from celery_idem.exceptions import CorruptRecord, LeaseLost, StoreUnavailable
from celery_idem.keys import idempotency_key
from celery_idem.records import ClaimStatus, Record, State
from celery_idem.stores.redis import RedisStore, _translate_errors
from tests.integration.harness import RedisServer

from .support import LONG, claim, poll


@pytest.fixture
def store(redis_url: str, prefix: str, redis_cleanup: None) -> Iterator[RedisStore]:
    """A store on the shared server, under this test's prefix (its keys are deleted after)."""
    store = RedisStore.from_url(redis_url, prefix=prefix)
    yield store
    store.close()


@pytest.fixture
def private_server() -> Iterator[RedisServer]:
    """A redis-server of this test's own, which it may flush, kill and restart."""
    server = RedisServer()
    yield server
    server.cleanup()


def _every_verb(store: RedisStore, key: str) -> dict[str, Any]:
    return {
        "get": lambda: store.get(key),
        "claim": lambda: claim(store, key),
        "record": lambda: store.record(
            key, 1, state=State.DONE, content_type="c", data=b"", ttl=LONG
        ),
        "release": lambda: store.release(key, 1),
        "renew": lambda: store.renew(key, 1, LONG),
    }


# -- scripts ----------------------------------------------------------------------------------


def test_every_script_survives_a_script_flush(private_server: RedisServer) -> None:
    store = RedisStore.from_url(private_server.url, prefix="p:")
    try:
        held = {}
        for key in ("a", "b"):
            store.client.script_flush()
            held[key] = claim(store, key)
            assert held[key].status is ClaimStatus.CLAIMED
            store.client.script_flush()
            assert store.renew(key, held[key].token, LONG, claim_id=held[key].claim_id) > store.now()
        store.client.script_flush()
        store.record("a", held["a"].token, state=State.DONE, content_type="c", data=b"[1]",
                     ttl=LONG, claim_id=held["a"].claim_id)
        store.client.script_flush()
        store.release("b", held["b"].token, claim_id=held["b"].claim_id)
        a, b = store.get("a"), store.get("b")
        assert a is not None and (a.state, a.data) == (State.DONE, b"[1]")
        assert b is not None and b.state is State.RELEASED
    finally:
        store.close()


# -- records written by another program -------------------------------------------------------


def test_a_plain_string_under_the_prefix_is_corrupt_record_naming_the_key(
    store: RedisStore, redis_client: Any, prefix: str
) -> None:
    redis_client.set(prefix + "k", "written by another program")
    for verb, call in _every_verb(store, "k").items():
        with pytest.raises(CorruptRecord) as info:
            call()
        assert info.value.key == "k", verb
        assert prefix + "k" in str(info.value), verb
    assert redis_client.get(prefix + "k") == b"written by another program"  # left alone


@pytest.mark.parametrize(
    "value",
    [
        b"\xc1x1\x001764000000000\x00t\x00\x00c\x00[1]",  # an unknown state
        b"\xc1dseven\x001764000000000\x00t\x00\x00c\x00[1]",  # a token that is no number
        b"\xc1d1\x001764000000000",  # cut short
        b"\xc1i1\x001764000000000\x00t\x00\x00host:1\x000",  # in progress without a lease
        b"\xc1",
        b"\xc1d+5\x001764000000000\x00t\x00\x00c\x00[1]",  # a sign: int() reads it, %d+ does not
    ],
    ids=["unknown-state", "bad-token", "truncated", "no-lease", "marker-only", "signed-token"],
)
def test_a_damaged_record_is_corrupt_record_for_every_verb_and_left_alone(
    store: RedisStore, redis_client: Any, prefix: str, value: bytes
) -> None:
    redis_client.set(prefix + "bad", value)
    for verb, call in _every_verb(store, "bad").items():
        with pytest.raises(CorruptRecord) as info:
            call()
        assert info.value.key == "bad", verb
        assert prefix + "bad" in str(info.value), verb
    assert redis_client.get(prefix + "bad") == value  # nothing written over it
    with pytest.raises(CorruptRecord) as info:  # marked as a record: damaged, not foreign
        list(store.scan())
    assert info.value.key == "bad"


def test_a_hash_of_an_older_version_is_corrupt_record_and_left_alone(
    store: RedisStore, redis_client: Any, prefix: str
) -> None:
    # What celery_idem wrote before records were one string: a hash of short fields
    old = {b"s": b"done", b"t": b"1", b"i": b"y", b"c": b"application/json", b"d": b"[1]"}
    redis_client.hset(prefix + "old", mapping=old)
    for verb, call in _every_verb(store, "old").items():
        with pytest.raises(CorruptRecord, match="is not a celery_idem record") as info:
            call()
        assert info.value.key == "old", verb
        assert prefix + "old" in str(info.value), verb
    assert redis_client.hgetall(prefix + "old") == old
    assert list(store.scan()) == []  # scan passes over keys that are not records


def test_a_foreign_string_is_skipped_by_scan(
    store: RedisStore, redis_client: Any, prefix: str
) -> None:
    redis_client.set(prefix + "foreign", b"written by another program")
    claim(store, "mine")
    assert [r.key for r in store.scan()] == ["mine"]


# -- TTLs ------------------------------------------------------------------------------------


def test_release_keeps_the_ttl_and_renew_extends_it_past_the_lease(
    store: RedisStore, redis_client: Any, prefix: str
) -> None:
    r = claim(store, "r", ttl=LONG)
    store.release("r", r.token, claim_id=r.claim_id)
    assert 0 < redis_client.pttl(prefix + "r") <= LONG * 1000
    assert redis_client.get(prefix + "r").startswith(b"\xc1r%d\x00" % r.token)  # no claim id
    n = claim(store, "n", ttl=5.0)
    store.renew("n", n.token, 1000.0)  # a lease longer than the record's TTL: the record outlives it
    assert redis_client.pttl(prefix + "n") > 900_000
    store.renew("n", n.token, 1.0)  # a short renewal never shortens the record
    assert redis_client.pttl(prefix + "n") > 900_000


# -- unavailability ---------------------------------------------------------------------------


def test_an_unreachable_redis_is_store_unavailable_quickly() -> None:
    store = RedisStore.from_url("redis://127.0.0.1:1/0", prefix="p:")
    try:
        verbs = {**_every_verb(store, "k"), "now": store.now, "scan": lambda: list(store.scan())}
        for verb, call in verbs.items():
            started = time.monotonic()
            with pytest.raises(StoreUnavailable, match=r"127\.0\.0\.1:1\b") as info:
                call()
            assert time.monotonic() - started < 5.0, verb
            assert isinstance(info.value.__cause__, redis.ConnectionError), verb
    finally:
        store.close()


def _redis_errors() -> list[type[redis.RedisError]]:
    """Every RedisError subclass redis-py defines (redis.exceptions and any other module)."""
    found: list[type[redis.RedisError]] = []
    todo: list[type[redis.RedisError]] = [redis.RedisError]
    todo += [
        c for c in vars(redis.exceptions).values() if inspect.isclass(c) and issubclass(c, redis.RedisError)
    ]
    while todo:
        cls = todo.pop()
        if cls not in found:
            found.append(cls)
            todo.extend(cls.__subclasses__())
    return sorted(found, key=lambda c: (c.__module__, c.__qualname__))


REDIS_ERRORS = _redis_errors()

# Every class with a message any class accepts ("<slot> <host:port>", what a cluster redirect
# carries), and each class that accepts any text once more with a WRONGTYPE reply's text.
ANY_TEXT = "3999 127.0.0.1:6381"
WRONG_TYPE = "WRONGTYPE Operation against a key holding the wrong kind of value"


def _error_cases() -> list[tuple[type[redis.RedisError], str]]:
    cases = []
    for cls in REDIS_ERRORS:
        cases.append((cls, ANY_TEXT))
        try:
            cls(WRONG_TYPE)
        except ValueError:  # AskError, MovedError: the text must be "<slot> <host:port>"
            continue
        cases.append((cls, WRONG_TYPE))
    return cases


def test_the_error_walk_finds_the_whole_redis_exceptions_tree() -> None:
    names = {c.__qualname__ for c in REDIS_ERRORS}
    assert {"ConnectionError", "TimeoutError", "ResponseError", "NoScriptError", "ReadOnlyError",
            "BusyLoadingError", "AuthenticationError", "DataError", "LockError", "MovedError"} <= names
    assert len(REDIS_ERRORS) >= 25
    assert (redis.ResponseError, WRONG_TYPE) in _error_cases()


@pytest.mark.parametrize(
    ("error", "message"),
    _error_cases(),
    ids=lambda v: f"{v.__module__}.{v.__qualname__}" if isinstance(v, type) else v.split()[0],
)
def test_every_redis_error_becomes_store_unavailable_or_corrupt_record(
    error: type[redis.RedisError], message: str
) -> None:
    store = RedisStore(redis.Redis(host="127.0.0.1", port=1), prefix="p:")
    raised = error(message)
    try:
        with pytest.raises((StoreUnavailable, CorruptRecord)) as info, _translate_errors(store, "k"):
            raise raised
    finally:
        store.close()
    assert info.value.__cause__ is raised
    wrong_type = isinstance(raised, redis.ResponseError) and message.startswith("WRONGTYPE")
    if error is redis.ResponseError:  # what redis-py raises for a WRONGTYPE reply
        assert isinstance(info.value, CorruptRecord) is wrong_type
    if isinstance(info.value, CorruptRecord):
        assert wrong_type
        assert info.value.key == "k"
        assert "p:k" in str(info.value)
    else:
        assert "127.0.0.1:1" in str(info.value)


# -- memory -----------------------------------------------------------------------------------


@pytest.mark.parametrize("result", [
    b'{"charge_id":"ch_3PqR8","status":"ok"}',  # 37 bytes
    b'{"order_id":"ord_12345","note":"' + b"x" * 86 + b'"}',  # 121 bytes: a hash's cliff at 64
])
def test_a_done_record_costs_at_most_200_bytes_beyond_its_key_and_result(
    store: RedisStore, redis_client: Any, result: bytes
) -> None:
    # What the gate writes for a typical task: a real key, a Celery task id, host:pid.
    key = idempotency_key("charge_card", "ord_8891", amount_cents=4200)
    token = store.claim(
        key, owner="worker-1:4242", task_id=str(uuid.uuid4()), attempt=0, lease=LONG, ttl=86400
    ).token
    store.record(key, token, state=State.DONE, content_type="application/json;utf-8", data=result,
                 ttl=86400)
    used = redis_client.memory_usage(store.prefix + key, samples=0)
    value = redis_client.get(store.prefix + key)
    # The budget is the record's own overhead: the key's bytes are the user's choice (prefix,
    # operation name) and the result's are the body's, so neither counts against it.
    budget = 200 + len(result) + len(store.prefix + key)
    assert used <= budget, (
        f"a done record of {len(store.prefix + key)}-byte key with a {len(result)}-byte result "
        f"takes {used} bytes (budget {budget}); value: {value!r}"
    )
    rec = store.get(key)
    assert rec is not None and rec.data == result
    assert b"worker-1" not in value  # holder details are dropped once done
    assert (rec.owner, rec.attempt, rec.lease_expires) == ("", 0, None)


# -- a server that dies and comes back --------------------------------------------------------


def test_a_killed_redis_is_store_unavailable_and_a_restarted_one_works_again(
    private_server: RedisServer,
) -> None:
    store = RedisStore.from_url(private_server.url, prefix="p:")
    try:
        assert claim(store, "before").status is ClaimStatus.CLAIMED
        private_server.stop()  # SIGKILL, mid-test, with the store's pooled connection open
        verbs = {**_every_verb(store, "k"), "now": store.now, "scan": lambda: list(store.scan())}
        for verb, call in verbs.items():
            started = time.monotonic()
            with pytest.raises(StoreUnavailable, match=rf"127\.0\.0\.1:{private_server.port}\b"):
                call()
            assert time.monotonic() - started < 5.0, verb
        private_server.start()  # same port, empty (no persistence), no scripts loaded
        first = claim(store, "after")
        assert first.status is ClaimStatus.CLAIMED
        assert store.renew("after", first.token, LONG) > first.now
        assert claim(store, "after", who="b").status is ClaimStatus.BUSY
        store.record("after", first.token, state=State.DONE, content_type="c", data=b"[1]", ttl=LONG)
        gone = claim(store, "released")
        store.release("released", gone.token)
        with pytest.raises(LeaseLost):
            store.renew("released", gone.token, LONG)
        rec = store.get("after")
        assert rec is not None and (rec.state, rec.data) == (State.DONE, b"[1]")
        assert sorted(r.key for r in store.scan()) == ["after", "released"]
    finally:
        store.close()


def test_leases_use_the_redis_clock_not_the_workers(
    store: RedisStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    claim(store, lease=30.0)
    monkeypatch.setattr(time, "time", lambda: 0.0)  # a worker with a wildly wrong clock
    assert store.now() > 1e9
    assert claim(store, who="b").status is ClaimStatus.BUSY



@pytest.mark.parametrize("value", [b"written by another program", b"\xc1x1\x001\x00\x00\x00"],
                         ids=["foreign", "damaged"])
def test_with_wait_replicas_a_non_record_is_still_corrupt_record_for_every_verb(
    redis_url: str, prefix: str, redis_client: Any, redis_cleanup: None, value: bytes
) -> None:
    # Nothing is written to a non-record, so no replica count can turn it into an outage
    redis_client.set(prefix + "k", value)
    store = RedisStore.from_url(redis_url, prefix=prefix, wait_replicas=1, wait_timeout=0.2)
    try:
        for verb, call in _every_verb(store, "k").items():
            with pytest.raises(CorruptRecord) as info:
                call()
            assert info.value.key == "k", verb
    finally:
        store.close()
    assert redis_client.get(prefix + "k") == value


# -- records of versions before claim ids -----------------------------------------------------


def test_a_record_written_before_claim_ids_still_reads_fences_and_is_taken_over_higher(
    store: RedisStore, redis_client: Any, prefix: str
) -> None:
    now_ms = round(store.now() * 1000)
    # An in-progress record of an earlier version (token 1, no claim id), its lease expired
    legacy = b"\xc1i1\x00%d\x00task-a\x00\x00host:a\x000\x00%d" % (now_ms, now_ms - 1)
    redis_client.set(prefix + "old", legacy, px=60_000)
    rec = store.get("old")
    assert rec is not None and (rec.state, rec.token, rec.claim_id) == (State.IN_PROGRESS, 1, "")
    # Its holder (which has no claim id) is fenced by the token alone, as before
    store.renew("old", 1, 0.001)
    with pytest.raises(LeaseLost):  # a caller naming a claim id is not that holder
        store.renew("old", 1, LONG, claim_id="someone")
    # A new claim takes it over with a clock token, far above 1
    taken = poll(store, lambda: (c := claim(store, "old", who="b")).status.holds and c,
                 "the renewed 1 ms lease to run out")
    assert taken.status is ClaimStatus.TAKEOVER and taken.token > 1_000_000_000_000_000
    assert taken.record is not None and taken.record.token == 1
    with pytest.raises(LeaseLost):
        store.record("old", 1, state=State.DONE, content_type="c", data=b"stale", ttl=LONG)
    # A done record of an earlier version answers claims as before
    redis_client.set(prefix + "done", b"\xc1d7\x00%d\x00task-a\x00\x00\x01\x00[1]" % now_ms,
                     px=60_000)
    answer = claim(store, "done")
    assert answer.status is ClaimStatus.DONE and answer.token == 7
    assert answer.record is not None and (answer.record.data, answer.record.claim_id) == (b"[1]", "")


# -- reservations (the enqueue check of a queued message) -------------------------------------


def test_a_reservation_is_taken_once_answered_to_the_next_and_expires(store: RedisStore) -> None:
    from celery_idem.records import Reservation

    key = f"op:{uuid.uuid4().hex}"
    assert store.reserve(key, "t-1", LONG, "fp-1") is None  # reserved for t-1: publish
    assert store.reserve(key, "t-2", LONG, "fp-2") == Reservation("t-1", "fp-1")
    assert store.reservation(key) == Reservation("t-1", "fp-1")
    store.unreserve(key, "t-2")  # not t-2's: kept
    assert store.reservation(key) == Reservation("t-1", "fp-1")
    store.unreserve(key, "t-1")
    assert store.reservation(key) is None
    # A short one expires by itself: a lost message frees the key for the next enqueue
    assert store.reserve(key, "t-3", 0.05) is None
    poll(store, lambda: store.reservation(key) is None, what="the reservation to expire")
    assert store.reserve(key, "t-4", LONG) is None


def test_a_record_answers_reserve_unless_it_is_released(store: RedisStore) -> None:
    key = f"op:{uuid.uuid4().hex}"
    first = claim(store, key)
    found = store.reserve(key, "t-1", LONG)
    assert isinstance(found, Record) and found.state is State.IN_PROGRESS
    store.release(key, first.token, claim_id=first.claim_id)
    assert store.reserve(key, "t-1", LONG) is None  # a released tombstone does not answer
    # A reservation is not a claim: the worker claims regardless, and never reads it
    assert claim(store, key, who="b").status is ClaimStatus.CLAIMED


def test_a_reservation_lives_under_the_prefix_and_scan_skips_it(store: RedisStore) -> None:
    from celery_idem.stores.redis import RESERVED

    key = f"op:{uuid.uuid4().hex}"
    store.reserve(key, "t-1", LONG)
    assert store.client.exists(store.prefix + key + RESERVED)  # an ACL of ~<prefix>* covers it
    assert [r.key for r in store.scan()] == []
    store.unreserve(key, "t-1")
