"""The Redis store's wire (celery_idem/stores/redis_wire.py): redis-py's semantics, fewer layers.

What the pool's checkout did (notice a connection the server closed, a fork) the wire must still
do, before anything is sent; what the client did on an error (disconnect, raise, no retry) too.
Shared server, a prefix per test; only the test's own connections are killed (CLIENT KILL ID).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from celery_idem.config import accelerate_switch
from celery_idem.exceptions import CorruptRecord, StoreUnavailable
from celery_idem.records import ClaimStatus, State
from celery_idem.stores.redis import RedisStore
from celery_idem.stores.redis_wire import Wire, _pack_python, pack, wire_for
from tests.integration.harness import RedisServer

from .support import LONG, claim

# An acceleration's own tests: with accelerations off (make test-plain) there is no wire.
pytestmark = pytest.mark.skipif(not accelerate_switch(), reason="accelerations off (CELERY_IDEM_ACCELERATE)")


def _wire(store: RedisStore) -> Wire | None:
    """The store's wire, if its scripts go over one (celery_idem.stores.redis_wire.WireScripts)."""
    return getattr(store._scripts, "wire", None)


@pytest.fixture
def store(redis_url: str, prefix: str, redis_cleanup: None) -> Iterator[RedisStore]:
    store = RedisStore.from_url(redis_url, prefix=prefix)
    yield store
    store.close()


def _lane_id(store: RedisStore) -> int:
    """The server's id of the connection the store's next verb takes."""
    assert _wire(store) is not None
    conn = _wire(store).lanes[-1].conn
    conn.send_command("CLIENT", "ID")
    return int(conn.read_response())


def test_the_default_store_takes_the_wire_and_one_connection_per_verb(store: RedisStore) -> None:
    assert _wire(store) is not None
    for i in range(5):
        assert claim(store, f"k{i}").status is ClaimStatus.CLAIMED
        assert store.get(f"k{i}") is not None
    assert len(_wire(store).lanes) == 1  # one at a time: the same connection, checked out once


def test_a_connection_the_server_closed_is_replaced_before_the_verb_is_sent(
    store: RedisStore, redis_client: redis.Redis
) -> None:
    claim(store, "warm")
    redis_client.execute_command("CLIENT", "KILL", "ID", _lane_id(store))
    # No error and exactly one claim: the closed connection was noticed before sending.
    assert claim(store, "after").status is ClaimStatus.CLAIMED
    assert store.get("after") is not None


def test_a_server_restart_between_verbs_is_not_an_error() -> None:
    server = RedisServer()
    try:
        store = RedisStore.from_url(server.url, prefix="w:")
        assert claim(store, "k1").status is ClaimStatus.CLAIMED
        server.stop()
        server.start()
        # The script cache is gone too (NOSCRIPT): loaded again, still one claim.
        assert claim(store, "k2").status is ClaimStatus.CLAIMED
        store.close()
    finally:
        server.cleanup()


def test_a_server_that_is_down_raises_store_unavailable_without_retrying() -> None:
    server = RedisServer()
    try:
        store = RedisStore.from_url(server.url, prefix="w:")
        claim(store, "k1")
        server.stop()
        with pytest.raises(StoreUnavailable):
            claim(store, "k2")
        with pytest.raises(StoreUnavailable):
            store.get("k1")
        store.close()
    finally:
        server.cleanup()


def test_an_error_reply_keeps_the_connection(store: RedisStore) -> None:
    store.client.hset(store.name_of("h"), "a", "1")  # a foreign key of another type: WRONGTYPE
    claim(store, "warm")
    assert _wire(store) is not None
    conn = _wire(store).lanes[-1].conn
    with pytest.raises(CorruptRecord):
        store.get("h")
    assert _wire(store).lanes[-1].conn is conn and conn._sock is not None
    assert claim(store, "next").status is ClaimStatus.CLAIMED


def test_verbs_from_threads_each_get_a_connection(store: RedisStore) -> None:
    import threading

    errors: list[BaseException] = []

    def work(n: int) -> None:
        try:
            for i in range(50):
                c = claim(store, f"t{n}:{i}")
                store.record(f"t{n}:{i}", c.token, state=State.DONE, content_type="c", data=b"x",
                             ttl=LONG, claim_id=c.claim_id)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    assert all(store.get(f"t{n}:{i}").state is State.DONE  # type: ignore[union-attr]
               for n in range(4) for i in range(50))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_never_uses_its_parents_connections(store: RedisStore) -> None:
    claim(store, "parent")
    assert _wire(store) is not None
    parent_conn = _wire(store).lanes[-1].conn
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through the pipe
        ok = b"0"
        try:
            fresh = not _wire(store).lanes
            c = claim(store, "child")
            ok = b"1" if fresh and c.status is ClaimStatus.CLAIMED and \
                _wire(store).lanes[-1].conn is not parent_conn else b"0"
        finally:
            os.write(write, ok)
            os._exit(0)
    os.close(write)
    assert os.read(read, 1) == b"1"
    os.waitpid(pid, 0)
    # The parent's connection is intact.
    assert claim(store, "parent2").status is ClaimStatus.CLAIMED
    assert _wire(store).lanes[-1].conn is parent_conn


def test_clients_that_need_redis_py_keep_it(redis_url: str) -> None:
    assert wire_for(redis.Redis.from_url(redis_url, retry=Retry(NoBackoff(), 0))) is not None
    assert wire_for(redis.Redis.from_url(redis_url, retry=Retry(NoBackoff(), 2))) is None
    assert wire_for(redis.Redis.from_url(redis_url, single_connection_client=True)) is None
    assert wire_for(redis.Redis.from_url(redis_url, protocol=3)) is None

    class Custom(redis.Redis):
        pass

    assert wire_for(Custom.from_url(redis_url)) is None


def test_a_store_with_retries_still_works_through_redis_py(
    redis_url: str, prefix: str, redis_cleanup: None
) -> None:
    store = RedisStore.from_url(redis_url, prefix=prefix, retry=Retry(NoBackoff(), 2))
    assert _wire(store) is None
    c = claim(store, "k")
    store.record("k", c.token, state=State.DONE, content_type="c", data=b"x", ttl=LONG,
                 claim_id=c.claim_id)
    assert store.get("k").state is State.DONE  # type: ignore[union-attr]
    store.close()


def test_the_python_packer_packs_as_hiredis() -> None:
    args = ("EVALSHA", "a" * 40, 1, "k\0é", b"\x00\xff", 0, -5, 86_400_000, "")
    assert _pack_python(args) == pack(args)
