"""Bad input and hostile data: arguments that cannot be sent, huge arguments and results,
records written by another program, pickled results, shared servers, TLS and ACL users, and
what the store keeps of the arguments.
"""

from __future__ import annotations

import os
import pickle
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import kombu.exceptions
import pytest
import redis
import sqlalchemy as sa
from celery import Celery

from celery_idem import CachedResult, CorruptRecord, IdempotentTask, StoreUnavailable
from celery_idem.stores.redis import RedisStore
from tests.chaos.support import ChaosRedis, Stack, wait_for
from tests.integration import app as tasks
from tests.integration.harness import wait_subscribed

# Part of the chaos/scale suites: long-running, deselected with -m "not slow".
pytestmark = pytest.mark.slow

MB = 1024 * 1024


class EventTap:
    """Every Celery event of the test process's broker, collected in a background thread."""

    def __init__(self, app: Any) -> None:
        self.events: list[dict[str, Any]] = []
        self._ready = threading.Event()
        self._recv: Any = None
        self._channel: Any = None
        self._thread = threading.Thread(target=self._run, args=(app,), daemon=True)
        self._thread.start()
        assert self._ready.wait(20), "event receiver did not start"
        # Consuming is not yet subscribed: an event sent before the PSUBSCRIBE reaches nobody
        wait_subscribed(lambda: self._channel, app.conf.broker_url)

    def _run(self, app: Any) -> None:
        with app.connection_for_read() as conn:
            recv = app.events.Receiver(conn, handlers={"*": self.events.append})
            self._recv = recv
            original = recv.on_consume_ready

            def ready(conn: Any, channel: Any, *args: Any, **kwargs: Any) -> None:
                original(conn, channel, *args, **kwargs)
                self._channel = channel
                self._ready.set()

            recv.on_consume_ready = ready
            recv.capture(limit=None, timeout=None, wakeup=False)

    def of(self, kind: str, task_id: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("type") == kind and e.get("uuid") == task_id]

    def close(self) -> None:
        self._recv.should_stop = True
        self._thread.join(5)


@pytest.fixture
def redis_active(redis_stack: Any) -> Iterator[Any]:
    with redis_stack.active():
        yield redis_stack


@pytest.fixture
def sql_active(sql_stack: Any) -> Iterator[Any]:
    with sql_stack.active():
        yield sql_stack


def published(stack: Stack) -> int:
    return int(stack.flags.llen(stack.queue))


# -- arguments that cannot be sent ------------------------------------------------------------


def test_a_key_argument_that_is_not_json_raises_type_error_naming_it_and_sends_nothing(
    make_stack: Callable[..., Any],
) -> None:
    stack = make_stack("redis")  # no worker: whatever is sent stays in the queue
    with pytest.raises(TypeError, match="'action' has type object"):
        tasks.chaos_effect.delay(object())
    assert published(stack) == 0


def test_a_non_key_argument_that_is_not_json_raises_type_error_naming_it_and_sends_nothing(
    make_stack: Callable[..., Any], action: Callable[[str], str]
) -> None:
    # ``marker`` is not part of the key (idempotency_fields=("action",)), so the key is fine,
    # and only the broker's serializer finds the value it cannot encode.
    stack = make_stack("redis")
    with pytest.raises(TypeError, match="marker"):
        tasks.chaos_effect.delay(action("not-json"), marker=object())
    assert published(stack) == 0
    assert list(stack.store.scan()) == []


# -- huge arguments and results ---------------------------------------------------------------


@pytest.mark.worker
@pytest.mark.parametrize("kind", ["redis", "sql"])
def test_the_store_holds_hashes_of_huge_and_secret_arguments_never_the_arguments(
    kind: str, request: pytest.FixtureRequest, action: Callable[[str], str]
) -> None:
    stack = request.getfixturevalue(f"{kind}_active")
    name = action("hashes-only")
    secret = f"4111-1111-1111-{uuid.uuid4().hex}"
    blob = "B" * (4 * MB)
    # Given a task keyed and validated on every argument: a 4 MB one and a secret
    out = tasks.chaos_echo.delay(name, blob=blob, secret=secret).get(timeout=60)
    assert out == {"action": name, "blob": 4 * MB, "secret": len(secret)}
    assert isinstance(tasks.chaos_echo.delay(name, blob=blob, secret=secret), CachedResult)
    assert len(stack.effects(name)) == 1
    # Then nothing the store keeps (names and values) holds either argument
    dump = dump_store(stack)
    assert secret.encode() not in dump and b"BBBB" not in dump
    # And the action's record is a few hundred bytes: hashes, ids and the small result
    key = tasks.chaos_echo.idempotency_key_for((name,), {"blob": blob, "secret": secret})
    rec = stack.store.get(key)
    assert key == f"{tasks.chaos_echo.name}:{key.rsplit(':', 1)[1]}" and len(key.rsplit(":")[-1]) == 32
    assert rec.payload_hash and len(rec.payload_hash) == 32
    assert len(repr(rec)) < 1024, rec


def dump_store(stack: Any) -> bytes:
    """Every byte the store holds under the stack's prefix: names and values."""
    if stack.name == "redis":
        client = stack.store_server.client()
        try:
            out = b""
            for name in client.scan_iter(match=stack.prefix + "*"):
                out += name + client.get(name)  # a record is one string
            return out
        finally:
            client.close()
    rows = stack.ledger.conn.execute(
        f"SELECT * FROM {stack.table} WHERE key LIKE %s", (stack.prefix + "%",)).fetchall()
    return b"".join(repr(row).encode() for row in rows)


def test_an_argument_over_the_brokers_limit_fails_at_enqueue_and_leaves_nothing(
    make_stack: Callable[..., Any], action: Callable[[str], str]
) -> None:
    # A broker that takes at most 1 MB per value (the default is 512 MB, proto-max-bulk-len)
    stack = make_stack("redis", broker_args=("--proto-max-bulk-len", "1mb"))
    with pytest.raises(kombu.exceptions.OperationalError):
        tasks.chaos_echo.delay(action("too-big"), blob="B" * (2 * MB))
    assert published(stack) == 0
    assert list(stack.store.scan()) == []


@pytest.mark.worker
def test_a_result_over_the_stores_limit_is_a_clear_error_and_never_runs_the_body_twice(
    make_stack: Callable[..., Any], action: Callable[[str], str]
) -> None:
    # A store that takes at most 1 MB per value; the result is 2 MB
    stack = make_stack("redis", store_args=("--proto-max-bulk-len", "1mb"))
    stack.worker("a", concurrency=1)
    name = action("huge-result")
    key = tasks.chaos_big_result.idempotency_key_for((name, 2 * MB))
    first = tasks.chaos_big_result.delay(name, 2 * MB)
    first.get(timeout=60, propagate=False)
    # The failure is loud (an ERROR line of celery_idem), and names the key
    assert any("ERROR" in line and "celery_idem" in line for line in stack.key_lines(key))
    # After the 2 s lease, a duplicate reaches a worker (send_task: no enqueue check)
    wait_for(lambda: lease_over(stack, key), timeout=30, what="the lease to run out")
    dup = tasks.app.send_task(tasks.chaos_big_result.name, (name, 2 * MB))
    dup.get(timeout=60, propagate=False)
    wait_for(stack.queue_empty, timeout=60, what="the queue to drain")
    # Nothing ran twice, and neither attempt reported a success the store never recorded
    assert len(stack.effects(name)) == 1
    assert first.failed() and dup.failed()


def lease_over(stack: Any, key: str) -> bool:
    rec = stack.store.get(key)
    return rec is None or rec.state.value != "in_progress" or rec.lease_expires < stack.store.now()


# -- records written by another program -------------------------------------------------------


class _Bomb:
    """Unpickling this creates ``path``: proof that a record was unpickled."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (os.mkdir, (self.path,))


def plant(stack: Any, key: str, kind: str, bomb: Path | None = None) -> Callable[[], Any]:
    """Write foreign data where ``key``'s record would be; return a reader of what is there."""
    stored = stack.prefix + key
    if stack.name == "redis":
        client = stack.store_server.client()
        if kind == "foreign":
            client.set(stored, b"a value another program wrote")
            return lambda: client.get(stored)
        if kind == "old_hash":  # a record as an older celery_idem wrote it: a hash
            client.hset(stored, mapping={"s": "done", "t": 1, "i": "elsewhere",
                                         "c": "application/json", "d": b"[1]"})
            return lambda: client.hgetall(stored)
        # A record in the store's format (celery_idem/stores/redis.py): marker, state, token,
        # updated ms, task id, payload hash, content type, data.
        state, token, ctype, data = b"d", b"1", b"application/json;utf-8", b"[1]"
        if kind == "unknown_state":
            state = b"a"
        elif kind == "bad_token":
            token = b"seven"
        elif kind == "undecodable":
            data = b"\xff{ not json"
        elif kind == "pickled":
            ctype, data = b"application/x-python-serialize;binary", pickle.dumps(_Bomb(str(bomb)))
        client.set(stored, b"\xc1" + state + token + b"\x001764000000000\x00elsewhere\x00\x00"
                   + ctype + b"\x00" + data)
        return lambda: client.get(stored)
    table = sa.table(stack.table, *(sa.column(c) for c in (
        "key", "state", "token", "owner", "task_id", "attempt", "content_type", "data",
        "updated", "expires")))
    row: dict[str, Any] = {"key": stored, "state": "done", "token": 1, "owner": "", "attempt": 0,
                           "task_id": "elsewhere", "updated": 0.0, "expires": 4e9}
    if kind in ("foreign", "unknown_state"):
        row["state"] = "archived"
    elif kind == "undecodable":
        row.update(content_type="application/json;utf-8", data=b"\xff{ not json")
    elif kind == "pickled":
        row.update(content_type="application/x-python-serialize;binary",
                   data=pickle.dumps(_Bomb(str(bomb))))
    engine = stack.store._engine
    with engine.begin() as conn:
        conn.execute(sa.insert(table).values(row))

    def read() -> Any:
        with engine.connect() as conn:
            return conn.execute(sa.select(table).where(table.c.key == stored)).all()

    return read


CORRUPT = {"redis": ["foreign", "old_hash", "unknown_state", "bad_token", "undecodable"],
           "sql": ["unknown_state", "undecodable"]}


@pytest.mark.worker
@pytest.mark.parametrize("kind", ["redis", "sql"])
def test_a_corrupt_or_foreign_record_is_a_clear_error_and_event_without_a_crash_loop(
    kind: str, request: pytest.FixtureRequest, action: Callable[[str], str]
) -> None:
    stack = request.getfixturevalue(f"{kind}_active")
    tap = EventTap(tasks.app)
    try:
        for corrupt in CORRUPT[kind]:
            name = action(corrupt)
            key = tasks.chaos_effect.idempotency_key_for((name,))
            read = plant(stack, key, corrupt)
            before = read()
            # At enqueue: a clear error, and nothing is sent
            with pytest.raises(CorruptRecord) as at_enqueue:
                tasks.chaos_effect.delay(name)
            assert key in str(at_enqueue.value)
            # At the worker (a message already queued): the task fails with the same error,
            # once, and a task-failed event says so
            r = tasks.app.send_task(tasks.chaos_effect.name, (name,))
            with pytest.raises(CorruptRecord) as at_worker:
                r.get(timeout=60)
            assert key in str(at_worker.value), corrupt
            wait_for(lambda r=r: tap.of("task-failed", r.id), timeout=20, what="task-failed")
            assert "CorruptRecord" in tap.of("task-failed", r.id)[0]["exception"]
            wait_for(stack.queue_empty, timeout=30, what="the queue to drain")
            assert stack.logs().count(f"[{r.id}] received") == 1, corrupt  # no redelivery loop
            # The body never ran, and the other program's data is left as it was
            assert stack.effects(name) == []
            assert read() == before, corrupt
        # And the workers still serve
        after = tasks.chaos_effect.delay(action("after")).get(timeout=60)
        assert after["action"] == action("after") and after["applied"]
    finally:
        tap.close()


@pytest.mark.worker
@pytest.mark.parametrize("kind", ["redis", "sql"])
def test_a_result_whose_serializer_is_not_accepted_is_refused_never_unpickled(
    kind: str, request: pytest.FixtureRequest, action: Callable[[str], str], tmp_path: Path
) -> None:
    stack = request.getfixturevalue(f"{kind}_active")
    name = action("pickled")
    key = tasks.chaos_effect.idempotency_key_for((name,))
    bomb = tmp_path / "unpickled"
    plant(stack, key, "pickled", bomb)
    # The app accepts json only (Celery's default accept_content)
    with pytest.raises(CorruptRecord, match="does not accept"):
        tasks.chaos_effect.delay(name)
    r = tasks.app.send_task(tasks.chaos_effect.name, (name,))
    with pytest.raises(CorruptRecord, match="does not accept"):
        r.get(timeout=60)
    assert not bomb.exists()
    assert stack.effects(name) == []


# -- sharing a server -------------------------------------------------------------------------


def test_key_prefixes_keep_two_apps_on_one_redis_apart() -> None:
    server = ChaosRedis()
    run = uuid.uuid4().hex[:8]
    try:
        effects: dict[str, list[str]] = {"a": [], "b": []}
        charges = {}
        for who in ("a", "b"):
            app = Celery(f"shop-{who}", set_as_current=False)
            app.conf.update(task_always_eager=True, result_backend=server.url,
                            idempotency_key_prefix=f"shop-{who}-{run}:")

            def body(self: Any, order_id: str, who: str = who) -> dict[str, str]:
                effects[who].append(order_id)
                return {"by": who}

            # The same task name and the same arguments: the same key, in both apps
            charges[who] = app.task(base=IdempotentTask, bind=True, name="shop.charge", shared=False,
                                    idempotency_fields=("order_id",))(body)
        assert charges["a"].idempotency_key_for(("o1",)) == charges["b"].idempotency_key_for(("o1",))
        for who in ("a", "b", "a", "b"):
            assert charges[who].delay("o1").get() == {"by": who}
        assert effects == {"a": ["o1"], "b": ["o1"]}
        client = server.client()
        names = sorted(n.decode() for n in client.scan_iter(match=f"shop-*-{run}:*"))
        assert [n.split(":", 1)[0] for n in names] == [f"shop-a-{run}", f"shop-b-{run}"]
        for who in ("a", "b"):
            store = charges[who]._gate.store
            assert [r.key for r in store.scan()] == [charges[who].idempotency_key_for(("o1",))]
        client.close()
    finally:
        server.cleanup()


# -- TLS and ACL users ------------------------------------------------------------------------

#: What the store's Redis user needs: its scripts, the commands they call, and reads.
STORE_ACL = ("-@all", "+evalsha", "+eval", "+script|load", "+get", "+set", "+pttl", "+time",
             "+scan", "+ping")


@pytest.mark.worker
def test_rediss_and_a_least_privilege_acl_user_work_end_to_end(
    make_stack: Callable[..., Any], action: Callable[[str], str]
) -> None:
    server = ChaosRedis(tls=True)
    password = uuid.uuid4().hex
    stack = make_stack("redis", store_server=server, user="idem", password=password)
    assert stack.store_url.startswith("rediss://idem:")
    admin = server.client()
    # A user that may run the store's commands on the keys under its prefix, and nothing else
    admin.execute_command("ACL", "SETUSER", "idem", "on", f">{password}", "resetkeys",
                          f"~{stack.prefix}*", "resetchannels", *STORE_ACL)
    stack.worker("a", concurrency=1)
    name = action("tls-acl")
    out = tasks.chaos_effect.delay(name).get(timeout=60)
    assert isinstance(tasks.chaos_effect.delay(name), CachedResult)
    assert len(stack.effects(name)) == 1
    stored = stack.prefix + tasks.chaos_effect.idempotency_key_for((name,))
    rec = RedisStore(admin, prefix=stack.prefix).get(stored[len(stack.prefix):])
    assert rec is not None and rec.state.value == "done" and rec.token == out["token"]
    # The same user cannot reach another app's keys: a clear refusal, which the gate treats as
    # an unavailable store (the body never runs unguarded)
    other = RedisStore.from_url(stack.store_url, prefix="another-app:")
    with pytest.raises(StoreUnavailable, match="no permissions"):
        other.get("k")
    other.close()
    # Neither plain TCP to the TLS port nor a wrong password gets in
    plain = RedisStore.from_url(f"redis://idem:{password}@127.0.0.1:{server.port}/0",
                                prefix=stack.prefix, socket_timeout=2)
    with pytest.raises(StoreUnavailable):
        plain.get("k")
    plain.close()
    wrong = RedisStore.from_url(stack.store_url.replace(password, "wrong"), prefix=stack.prefix)
    with pytest.raises(StoreUnavailable):
        wrong.get("k")
    wrong.close()
    admin.close()
    with pytest.raises(redis.ConnectionError):
        redis.Redis(host="127.0.0.1", port=server.port, socket_timeout=2).ping()
