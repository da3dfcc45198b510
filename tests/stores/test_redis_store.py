"""What only the Redis store does: Lua scripts, foreign keys, error mapping, memory, restarts.

The store contract itself is tested for every store, this one included, in test_contract.py.
Tests on the shared server use a prefix of their own and delete its keys afterwards (SCAN + DEL,
never FLUSHDB). Tests that flush scripts or kill the server get a private ``redis-server``.
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
from celery_idem.records import ClaimStatus, State
from celery_idem.stores.redis import RedisStore, _translate_errors
from tests.integration.harness import RedisServer

from .support import LONG, claim


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
        for key in ("a", "b"):
            store.client.script_flush()
            assert claim(store, key).status is ClaimStatus.CLAIMED
            store.client.script_flush()
            assert store.renew(key, 1, LONG) > store.now()
        store.client.script_flush()
        store.record("a", 1, state=State.DONE, content_type="c", data=b"[1]", ttl=LONG)
        store.client.script_flush()
        store.release("b", 1)
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


def test_a_hash_with_a_bogus_state_is_corrupt_record(
    store: RedisStore, redis_client: Any, prefix: str
) -> None:
    redis_client.hset(prefix + "bad", mapping={"s": "exploded", "t": 1, "o": "x", "i": "y"})
    with pytest.raises(CorruptRecord) as info:
        store.get("bad")
    assert info.value.key == "bad"
    assert prefix + "bad" in str(info.value)
    with pytest.raises(CorruptRecord) as info:
        claim(store, "bad")
    assert info.value.key == "bad"
    assert prefix + "bad" in str(info.value)
    assert redis_client.hgetall(prefix + "bad") == {  # the claim wrote nothing
        b"s": b"exploded",
        b"t": b"1",
        b"o": b"x",
        b"i": b"y",
    }


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


def test_a_done_record_costs_at_most_200_bytes_beyond_its_key_and_result(
    store: RedisStore, redis_client: Any
) -> None:
    # What the gate writes for a typical task: a real key, a Celery task id, host:pid.
    key = idempotency_key("charge_card", "ord_8891", amount_cents=4200)
    result = b'{"charge_id":"ch_3PqR8","status":"ok"}'
    token = store.claim(
        key, owner="worker-1:4242", task_id=str(uuid.uuid4()), attempt=0, lease=LONG, ttl=86400
    ).token
    store.record(key, token, state=State.DONE, content_type="application/json", data=result, ttl=86400)
    used = redis_client.memory_usage(store.prefix + key, samples=0)
    fields = redis_client.hgetall(store.prefix + key)
    # The budget is the record's own overhead: the key's bytes are the user's choice (prefix,
    # operation name) and the result's are the body's, so neither counts against it.
    budget = 200 + len(result) + len(store.prefix + key)
    assert used <= budget, (
        f"a done record of {len(store.prefix + key)}-byte key with a {len(result)}-byte result "
        f"takes {used} bytes (budget {budget}); fields: {fields}"
    )
    assert b"o" not in fields and b"a" not in fields  # holder details are dropped once done


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
        claim(store, "released")
        store.release("released", 1)
        with pytest.raises(LeaseLost):
            store.renew("released", 1, LONG)
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

