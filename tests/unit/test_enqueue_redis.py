"""The enqueue check within the publish (celery_idem.enqueue_redis), producer side.

With kombu's Redis transport on the same server and database as the Redis store, a
``delay()`` pushes its message with a script that first reads the key's record: a unique key
is pushed in one round trip, a done key is answered from the record and nothing is pushed.
Real Redis (broker, backend and store), no worker: the queue lists are read directly. The
real-worker tests (test_worker_redis.py, test_result_*.py, ...) run through this path too.
"""

from __future__ import annotations

import secrets
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery
from celery.signals import before_task_publish

from celery_idem import CachedResult, IdempotentTask, enqueue_redis
from celery_idem.config import accelerate_switch
from celery_idem.enqueue_redis import WithinPublish
from celery_idem.exceptions import CorruptRecord, IdempotencyKeyMismatch
from celery_idem.records import Reservation, State
from tests.conftest import REDIS_URL

DB = 0

# An acceleration's own tests: with accelerations off the record is always read first.
pytestmark = pytest.mark.skipif(not accelerate_switch(), reason="accelerations off (CELERY_IDEM_ACCELERATE)")


@pytest.fixture
def prefix(redis_url: str) -> Iterator[str]:  # redis_url: marked `server` (not in test-fast)
    prefix = f"tfused{secrets.token_hex(4)}:"
    yield prefix
    client = redis.Redis.from_url(f"{REDIS_URL}/{DB}")
    for name in client.scan_iter(match=prefix + "*", count=500):
        client.delete(name)
    client.close()


def make_app(prefix: str, *, broker_db: int = DB, **conf: Any) -> Celery:
    app = Celery("fused", broker=f"{REDIS_URL}/{broker_db}", backend=f"{REDIS_URL}/{DB}",
                 set_as_current=False)
    app.conf.update({
        "broker_transport_options": {"global_keyprefix": prefix},
        "result_backend_transport_options": {"global_keyprefix": prefix},
        "idempotency_key_prefix": prefix + "idem:",
        "task_default_queue": "q",
        **conf,
    })
    return app


def make_task(app: Celery) -> Any:
    @app.task(base=IdempotentTask, shared=False, name="fused.charge", idempotency_fields=("order",))
    def charge(order: str, cents: int) -> dict[str, Any]:
        return {"order": order, "cents": cents}

    return charge


def finish(task: Any, key: str, value: Any = None, error: BaseException | None = None,
           run_id: str | None = None) -> str:
    """Write the key's record as a worker would (claim, then record) for the run ``run_id``
    (default: a new one); returns the run's id."""
    store = task._gate.store
    run_id = run_id or str(uuid.uuid4())
    claim = store.claim(key, owner="test:1", task_id=run_id, attempt=0, lease=30, ttl=600)
    if error is None:
        ctype, data = task._gate.codec.encode_result(value)
        state = State.DONE
    else:
        ctype, data = task._gate.codec.encode_error(error)
        state = State.FAILED
    store.record(key, claim.token, state=state, content_type=ctype, data=data, ttl=600,
                 claim_id=claim.claim_id)
    return run_id


class Reads:
    """Counts the producer's own reads of the record (the check made before the publish): a
    ``get``, or a ``reserve`` (the read that also reserves the key for the message)."""

    def __init__(self, store: Any, monkeypatch: pytest.MonkeyPatch) -> None:
        self.keys: list[str] = []
        get, reserve = store.get, store.reserve

        def counted(key: str) -> Any:
            self.keys.append(key)
            return get(key)

        def counted_reserve(key: str, *args: Any, **kwargs: Any) -> Any:
            self.keys.append(key)
            return reserve(key, *args, **kwargs)

        monkeypatch.setattr(store, "get", counted)
        monkeypatch.setattr(store, "reserve", counted_reserve)


def queue_length(prefix: str, queue: str = "q") -> int:
    client = redis.Redis.from_url(f"{REDIS_URL}/{DB}")
    try:
        return int(client.llen(prefix + queue))
    finally:
        client.close()


def test_a_unique_key_is_pushed_with_the_check_in_the_publish(
    prefix: str, published: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    app = make_app(prefix)
    charge = make_task(app)
    reads = Reads(charge._gate.store, monkeypatch)
    result = charge.delay("o1", 100)
    assert not isinstance(result, CachedResult)
    assert published == [result.id]
    assert reads.keys == []  # no read of its own: the script read the record
    assert queue_length(prefix) == 1
    assert result.idempotency_key == charge.idempotency_key_for(("o1", 100), {})
    app.close()


def test_a_done_key_is_answered_from_the_record_and_nothing_is_pushed(
    prefix: str, published: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    app = make_app(prefix)
    charge = make_task(app)
    key = charge.idempotency_key_for(("o2", 100), {})
    run_id = finish(charge, key, {"order": "o2", "cents": 100})
    reads = Reads(charge._gate.store, monkeypatch)
    answer = charge.delay("o2", 100)
    assert isinstance(answer, CachedResult)
    assert answer.get(timeout=5) == {"order": "o2", "cents": 100}
    assert answer.id == answer.original_task_id == run_id
    assert published == [] and queue_length(prefix) == 0
    assert reads.keys == []  # answered from the record the script handed back
    # The result subscription Celery made for the message that was not sent is gone.
    # (Celery subscribed when it began to send: see the next test for the contrast.)
    assert not app.backend.result_consumer.subscribed_to
    app.close()


def test_kombus_publish_returns_normally_when_the_record_answers(
    prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The hook notes what it found on the enqueue instead of raising out of kombu's publish.
    from kombu import Producer

    raised: list[BaseException] = []
    publish = Producer._publish

    def watched(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return publish(self, *args, **kwargs)
        except BaseException as exc:
            raised.append(exc)
            raise

    monkeypatch.setattr(Producer, "_publish", watched)
    app = make_app(prefix)
    charge = make_task(app)
    key = charge.idempotency_key_for(("o2r", 100), {})
    finish(charge, key, {"order": "o2r", "cents": 100})
    reads = Reads(charge._gate.store, monkeypatch)
    answer = charge.delay("o2r", 100)
    assert isinstance(answer, CachedResult) and reads.keys == []  # answered within the publish
    assert raised == [] and queue_length(prefix) == 0
    app.close()


def test_a_publish_signal_receiver_turns_the_check_within_off(
    prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # It would hear of a message that the record answered and that was never sent.
    from celery.signals import after_task_publish

    heard: list[str] = []

    def hear(headers: dict[str, Any] | None = None, **_: Any) -> None:
        heard.append((headers or {}).get("id", ""))

    after_task_publish.connect(hear, weak=False)
    try:
        app = make_app(prefix)
        charge = make_task(app)
        key = charge.idempotency_key_for(("o2s", 100), {})
        finish(charge, key, {"order": "o2s", "cents": 100})
        reads = Reads(charge._gate.store, monkeypatch)
        assert isinstance(charge.delay("o2s", 100), CachedResult)
        assert reads.keys == [key] and heard == []  # read first: nothing was published
        app.close()
    finally:
        after_task_publish.disconnect(hear)


def test_a_sent_message_keeps_its_result_subscription(prefix: str) -> None:
    app = make_app(prefix)
    charge = make_task(app)
    result = charge.delay("o2b", 100)
    assert len(app.backend.result_consumer.subscribed_to) == 1
    assert result.id in str(next(iter(app.backend.result_consumer.subscribed_to)))
    app.close()


def test_a_failed_key_is_answered_with_its_error(prefix: str, published: list[str]) -> None:
    app = make_app(prefix)
    charge = make_task(app)
    key = charge.idempotency_key_for(("o3", 100), {})
    finish(charge, key, error=ValueError("card declined"))
    answer = charge.delay("o3", 100)
    assert isinstance(answer, CachedResult) and answer.state == "FAILURE"
    with pytest.raises(Exception, match="card declined"):
        answer.get(timeout=5)
    assert published == [] and queue_length(prefix) == 0
    app.close()


def test_a_chosen_task_id_gets_the_answer_stored_under_it(prefix: str, published: list[str]) -> None:
    app = make_app(prefix)
    charge = make_task(app)
    key = charge.idempotency_key_for(("o4", 100), {})
    finish(charge, key, {"order": "o4", "cents": 100})
    answer = charge.apply_async(("o4", 100), task_id="chosen-o4")
    assert isinstance(answer, CachedResult) and answer.id == "chosen-o4"
    assert published == [] and queue_length(prefix) == 0
    # Anyone waiting on the chosen id hears the outcome (stored in the result backend).
    assert app.AsyncResult("chosen-o4").get(timeout=5) == {"order": "o4", "cents": 100}
    app.close()


def test_a_priority_message_lands_in_its_priority_list(prefix: str) -> None:
    app = make_app(prefix, broker_transport_options={
        "global_keyprefix": prefix, "queue_order_strategy": "priority", "priority_steps": [0, 3, 6, 9],
    })
    charge = make_task(app)
    charge.apply_async(("o5", 1), priority=6)
    charge.apply_async(("o6", 1))
    sep = "\x06\x16"  # kombu's priority separator: <queue><sep><priority>
    assert queue_length(prefix, f"q{sep}6") == 1
    assert queue_length(prefix) == 1
    app.close()


def test_a_foreign_value_under_the_key_is_reported_and_nothing_is_pushed(prefix: str) -> None:
    app = make_app(prefix)
    charge = make_task(app)
    key = charge.idempotency_key_for(("o7", 1), {})
    client = redis.Redis.from_url(f"{REDIS_URL}/{DB}")
    client.set(prefix + "idem:" + key, b"not a record")
    client.close()
    with pytest.raises(CorruptRecord, match="is not a celery_idem record"):
        charge.delay("o7", 1)
    assert queue_length(prefix) == 0
    app.close()


def test_a_broker_on_another_database_checks_within_the_publish(
    prefix: str, published: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Celery's common layout: the broker on one database, the backend (and so the store) on
    # another of the same server. The script selects each key's database.
    app = make_app(prefix, broker_db=DB + 1)
    charge = make_task(app)

    @app.task(shared=False, name="fused.plain")
    def plain() -> None:
        return None

    key = charge.idempotency_key_for(("o8", 1), {})
    finish(charge, key, "done")
    reads = Reads(charge._gate.store, monkeypatch)
    assert isinstance(charge.delay("o8", 1), CachedResult)
    first = charge.delay("o9", 1)
    assert not isinstance(first, CachedResult)
    assert reads.keys == []  # both checked within the publish
    assert charge._enqueue_check.possible
    plain.delay()  # kombu's own push on the connection the script ran on: the broker's database
    broker = redis.Redis.from_url(f"{REDIS_URL}/{DB + 1}")
    try:
        assert broker.llen(prefix + "q") == 2  # o9 and plain's; o8 answered, nothing pushed
        assert queue_length(prefix) == 0  # nothing in the store's database
        assert broker.exists(charge._gate.store.name_of(key)) == 0
        assert broker.delete(prefix + "q") == 1
    finally:
        broker.close()
    app.close()


def test_a_before_task_publish_receiver_gets_the_check_made_first(
    prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    heard: list[str] = []

    def hear(sender: object = None, headers: dict[str, Any] | None = None, **_: object) -> None:
        heard.append((headers or {}).get("id", ""))

    app = make_app(prefix)
    charge = make_task(app)
    key = charge.idempotency_key_for(("o10", 1), {})
    finish(charge, key, "done")
    reads = Reads(charge._gate.store, monkeypatch)
    before_task_publish.connect(hear, weak=False)
    try:
        assert isinstance(charge.delay("o10", 1), CachedResult)
    finally:
        before_task_publish.disconnect(hear)
    # The receiver never hears of a message that is not sent: the record was read first.
    assert heard == [] and reads.keys == [key]
    app.close()


def test_many_answered_enqueues_switch_to_reading_first_and_back(
    prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = make_app(prefix)
    charge = make_task(app)
    check = charge._enqueue_check
    for i in range(4):
        finish(charge, charge.idempotency_key_for((f"d{i}", 1), {}), i)
    reads = Reads(charge._gate.store, monkeypatch)
    for i in range(4):
        assert isinstance(charge.delay(f"d{i}", 1), CachedResult)
    assert reads.keys == []  # within the publish until the share of answers crosses the line
    assert check.answered >= check.THRESHOLD
    assert isinstance(charge.delay("d0", 1), CachedResult)
    assert len(reads.keys) == 1  # now read first
    n = 0
    while check.answered >= check.THRESHOLD:  # unique keys bring the share down again
        assert n < 100, "the share of answered enqueues never fell"
        charge.delay(f"u{n}", 1)
        n += 1
    before = len(reads.keys)
    charge.delay("u-last", 1)
    assert len(reads.keys) == before
    assert queue_length(prefix) == n + 1
    app.close()


def test_the_hook_is_on_the_channel_instance_only(prefix: str) -> None:
    from kombu.transport.redis import Channel

    app = make_app(prefix)
    charge = make_task(app)
    charge.delay("o11", 1)
    assert Channel._put is not enqueue_redis._put
    with app.producer_or_acquire() as producer:
        assert producer.channel._celery_idem_stores[charge._gate.store] == ("0", "1")
        assert producer.channel._put.__func__ is enqueue_redis._put
    app.close()


def test_an_expiring_queue_gets_the_record_read_first(
    prefix: str, published: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from kombu import Exchange, Queue
    from kombu.transport.redis import Channel

    if not hasattr(Channel, "_get_queue_expire"):
        pytest.skip("queue expiry (x-expires) on the Redis transport is new in kombu 5.7")
    app = make_app(prefix, task_queues=[Queue("q", Exchange("q"), routing_key="q", expires=60)])
    charge = make_task(app)
    key = charge.idempotency_key_for(("o12", 1), {})
    finish(charge, key, "done")
    reads = Reads(charge._gate.store, monkeypatch)
    first = charge.delay("o13", 1)  # declares the queue (with its expiry) on the channel
    assert not isinstance(first, CachedResult) and published == [first.id]
    # kombu pushes to an expiring queue in a pipeline of its own (LPUSH + PEXPIRE): the check
    # reads the record first there, then lets kombu push.
    assert reads.keys == [charge.idempotency_key_for(("o13", 1), {})]
    assert queue_length(prefix) == 1
    assert isinstance(charge.delay("o12", 1), CachedResult)
    assert reads.keys[-1] == key and queue_length(prefix) == 1 and published == [first.id]
    app.close()


# -- copies of this process's own message of a moment ago (WithinPublish.mine) ---------------


class Publishes:
    """Counts the producer's pushes with the check within (the fused ``publish.lua``)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        publish = WithinPublish.publish

        def counted(check: WithinPublish, *args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return publish(check, *args, **kwargs)

        monkeypatch.setattr(WithinPublish, "publish", counted)


@pytest.mark.parametrize("first_read", [False, True], ids=["check-within-publish", "read-first"])
def test_a_copy_of_this_process_own_message_attaches_without_a_round_trip(
    prefix: str, published: list[str], monkeypatch: pytest.MonkeyPatch, first_read: bool
) -> None:
    app = make_app(prefix)
    charge = make_task(app)
    check = charge._enqueue_check
    if first_read:  # the share of answered enqueues is high: the record is read first
        check.answered = 1.0
    first = charge.delay("m1", 100)
    assert published == [first.id]
    reads, pushes = Reads(charge._gate.store, monkeypatch), Publishes(monkeypatch)
    copies = [charge.delay("m1", 100) for _ in range(3)]
    # Nothing asked the store, nothing was built or pushed: each copy names the first message
    assert reads.keys == [] and pushes.calls == 0
    assert published == [first.id] and queue_length(prefix) == 1
    assert all(getattr(c, "attached", False) and c.id == first.id for c in copies)
    # and the store holds the same reservation, which a copy from elsewhere would find
    key = charge.idempotency_key_for(("m1", 100), {})
    found = charge._gate.store.reservation(key)
    assert found is not None and found.task_id == first.id
    # The answer waits for the message's outcome as an attached handle does
    finish(charge, key, {"order": "m1", "cents": 100}, run_id=first.id)
    assert [c.get(timeout=10) for c in copies] == [{"order": "m1", "cents": 100}] * 3
    app.close()


def test_after_the_moment_a_copy_asks_the_store_again(
    prefix: str, published: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    app = make_app(prefix)
    charge = make_task(app)
    monkeypatch.setattr(type(charge._enqueue_check), "RECENT", 0.05)
    first = charge.delay("m2", 100)
    key = charge.idempotency_key_for(("m2", 100), {})
    # The reservation ends while the message is queued (taken back by hand here, as a lease
    # that ran out ends it)
    charge._gate.store.unreserve(key, first.id)
    deadline = time.monotonic() + 5
    while charge._enqueue_check.mine(key) is not None:  # the moment passes
        assert time.monotonic() < deadline, "the remembered reservation never expired"
        time.sleep(0.01)
    again = charge.delay("m2", 100)
    # The store no longer names the first message: this enqueue is published on its own
    assert not getattr(again, "attached", False) and again.id != first.id
    assert published == [first.id, again.id]
    app.close()


def test_a_copy_with_other_arguments_under_the_same_key_is_refused_without_the_store(
    prefix: str, published: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    app = make_app(prefix)
    charge = make_task(app)
    first = charge.apply_async(("m3", 100), idempotency_key="agent-call-7")
    reads, pushes = Reads(charge._gate.store, monkeypatch), Publishes(monkeypatch)
    with pytest.raises(IdempotencyKeyMismatch, match="in use by an action with different"):
        charge.apply_async(("m9", 100), idempotency_key="agent-call-7")  # another order
    assert reads.keys == [] and pushes.calls == 0
    same = charge.apply_async(("m3", 100), idempotency_key="agent-call-7")
    assert getattr(same, "attached", False) and same.id == first.id
    assert published == [first.id]
    app.close()


def test_a_message_that_was_not_sent_is_not_remembered(
    prefix: str, published: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    app = make_app(prefix)
    charge = make_task(app)
    charge._enqueue_check.answered = 1.0  # read first: reserve, then Celery's own publish
    boom = RuntimeError("broker refused the message")

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise boom

    monkeypatch.setattr("celery.app.task.Task.apply_async", refuse)
    with pytest.raises(RuntimeError, match="broker refused"):
        charge.delay("m4", 100)
    key = charge.idempotency_key_for(("m4", 100), {})
    assert charge._enqueue_check.mine(key) is None
    assert charge._gate.store.reservation(key) is None  # and the reservation was taken back
    app.close()


def test_once_this_process_saw_its_message_finish_a_copy_is_answered_from_the_record(
    prefix: str, published: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    app = make_app(prefix)
    charge = make_task(app)
    first = charge.delay("m5", 100)
    key = charge.idempotency_key_for(("m5", 100), {})
    # The worker's part, by hand: the record, and Celery's result under the message's id
    finish(charge, key, {"order": "m5", "cents": 100}, run_id=first.id)
    app.backend.store_result(first.id, {"order": "m5", "cents": 100}, "SUCCESS")
    assert first.get(timeout=10) == {"order": "m5", "cents": 100}
    # The caller has seen the outcome: a copy now asks the store and is answered as ever
    reads = Reads(charge._gate.store, monkeypatch)
    again = charge.delay("m5", 100)
    assert isinstance(again, CachedResult) and again.get(timeout=5) == {"order": "m5", "cents": 100}
    assert reads.keys == [] or reads.keys == [key]  # within the publish, or read first
    assert published == [first.id]
    app.close()


def test_once_the_caller_let_go_of_its_result_a_copy_asks_the_store(
    prefix: str, published: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    app = make_app(prefix)
    charge = make_task(app)
    charge._enqueue_check.answered = 1.0  # read first, so the store's answer is counted below
    sent = charge.delay("m6", 100).id  # the result itself is dropped at once
    reads = Reads(charge._gate.store, monkeypatch)
    copy = charge.delay("m6", 100)
    key = charge.idempotency_key_for(("m6", 100), {})
    assert reads.keys == [key]  # asked the store, which still names the queued message
    assert getattr(copy, "attached", False) and copy.id == sent
    assert published == [sent]
    app.close()


class _Sent:
    """Stands in for a published message's result (an id, weakly referenced)."""

    def __init__(self, task_id: str) -> None:
        self.id = task_id


def test_the_memory_is_bounded() -> None:
    check = WithinPublish()
    held = [_Sent(f"t{i}") for i in range(check.MAX_RECENT + 2)]
    for i in range(check.MAX_RECENT):
        check.remember(f"k{i}", held[i], None, 30.0)  # type: ignore[arg-type]
    assert check.mine("k0") is not None
    check.remember("one-more", held[-2], "fp", 30.0)  # type: ignore[arg-type]
    # A burst this large starts over
    assert check.mine("k0") is None and check.mine("one-more") == Reservation(held[-2].id, "fp")
    # Never longer than the reservation's lease
    check.remember("short-lease", held[-1], None, 0.0)  # type: ignore[arg-type]
    assert check.mine("short-lease") is None


# -- which channels take the hook, and what undoes an unsent message's subscription ----------------
# A kombu Redis channel connects when it is made (the shared server; nothing is written); a
# store and a result backend connect to nothing until used.

NOWHERE = "redis://127.0.0.1:1"  # nothing listens there


def _channel(url: str) -> Any:
    from kombu import Connection

    connection = Connection(url)
    return connection, connection.default_channel


@pytest.mark.parametrize(("url", "options", "mode"), [
    (f"{REDIS_URL}/{DB}", {}, ("0", "1")),
    (f"{REDIS_URL}/{DB + 1}", {}, (f"0 {DB + 1} {DB}", f"1 {DB + 1} {DB}")),  # another database
    (f"{NOWHERE}/{DB}", {}, None),  # another server
    (f"{REDIS_URL}/{DB}", {"accelerate": False}, None),  # the app's switch off
    (f"{REDIS_URL}/{DB}", {"wait_replicas": 1}, None),  # the record waits for replicas: read first
], ids=["same", "other-db", "other-server", "accelerate-off", "wait-replicas"])
def test_only_a_plain_store_on_the_brokers_server_takes_the_hook(
    redis_url: str, url: str, options: dict[str, Any], mode: tuple[str, str] | None
) -> None:
    from celery_idem.stores.redis import RedisStore

    connection, channel = _channel(f"{REDIS_URL}/{DB}")
    store = RedisStore.from_url(url, prefix="p:", **options)
    try:
        assert enqueue_redis.fuse(channel, store) == mode
        assert ("_put" in channel.__dict__) is (mode is not None)  # the hook only where it is used
        assert enqueue_redis.fuse(channel, store) == mode  # the verdict is kept
    finally:
        store.close()
        connection.release()


def test_a_server_that_refuses_a_scripts_select_reads_first(redis_url: str) -> None:
    # The store on another database needs the script's SELECT: a server (an ACL, a proxy) that
    # refuses it gets the read first, found once, when the verdict is made.
    from celery_idem.stores.redis import RedisStore
    from tests.integration.harness import RedisServer

    server = RedisServer(settings=("--user", "nosel", "on", ">pw", "~*", "&*", "+@all", "-select"))
    url = f"redis://nosel:pw@127.0.0.1:{server.port}"
    connection, channel = _channel(f"{url}/0")
    store = RedisStore.from_url(f"{url}/1", prefix="p:")
    try:
        assert enqueue_redis.fuse(channel, store) is None
        assert "_put" not in channel.__dict__
    finally:
        store.close()
        connection.release()
        server.cleanup()


def test_a_channel_that_is_not_redis_never_takes_the_hook() -> None:
    from celery_idem.stores.memory import MemoryStore
    from celery_idem.stores.redis import RedisStore

    connection, channel = _channel("memory://")
    store = RedisStore.from_url(f"{NOWHERE}/0", prefix="p:")
    try:
        assert enqueue_redis.fuse(channel, store) is None
        assert enqueue_redis.fuse(channel, MemoryStore()) is None
        assert "_put" not in channel.__dict__
    finally:
        store.close()
        connection.release()


def test_what_undoes_an_unsent_messages_subscription() -> None:
    from celery.backends.base import DisabledBackend
    from celery.backends.redis import RedisBackend

    app = Celery("undo", broker="memory://", set_as_current=False)
    # Celery's base backends subscribe to nothing: nothing to undo.
    assert enqueue_redis._undo_for(DisabledBackend(app=app)) is enqueue_redis._nothing

    class Remembering(DisabledBackend):
        def on_task_call(self, producer: Any, task_id: str) -> None:
            """Does something of its own that nobody knows how to undo."""

    assert enqueue_redis._undo_for(Remembering(app=app)) is None  # unknown: read first

    backend = RedisBackend(app=app, url=f"{NOWHERE}/0")
    cancelled: list[str] = []
    backend.result_consumer.cancel_for = cancelled.append  # type: ignore[method-assign]
    undo = enqueue_redis._undo_for(backend)
    assert undo is not None and undo is not enqueue_redis._nothing
    undo("t-7")
    assert cancelled == ["t-7"]
    backend.client.close()


def test_an_intent_sent_through_a_fanout_exchange_is_reported_as_not_kept(
    prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    # kombu delivers a fanout exchange's message without the queue push the hook rides on: the
    # message goes out (the gate still guards it) and the missing intent is said, not hidden.
    from kombu.common import Broadcast

    app = make_app(prefix, task_queues=(Broadcast(prefix + "bcast"),),
                   task_routes={"fused.broadcast": {"queue": prefix + "bcast"}})

    @app.task(base=IdempotentTask, shared=False, name="fused.broadcast", idempotency_intent=True)
    def broadcast(order: str) -> str:
        return order

    with caplog.at_level("WARNING", logger="celery_idem.enqueue_redis"):
        result = broadcast.delay("o20")
    assert broadcast._enqueue_check.possible
    assert [i for i in broadcast._gate.store.intents(1000) if i.key == result.idempotency_key] == []
    assert "no intent was kept" in caplog.text and result.idempotency_key in caplog.text
    app.close()


@pytest.mark.parametrize("options, on_wire", [({}, True), ({"retry_on_timeout": True}, False)],
                         ids=["wire", "retrying-broker"])
def test_the_script_runs_on_a_wire_unless_the_brokers_connections_retry(
    prefix: str, published: list[str], monkeypatch: pytest.MonkeyPatch, options: dict[str, Any],
    on_wire: bool
) -> None:
    # The wire sends one packed command on the broker's own pool; a broker whose connections
    # retry keeps redis-py's path (its retries), and both push the message under kombu's prefix.
    app = make_app(prefix, broker_transport_options={"global_keyprefix": prefix, **options})
    charge = make_task(app)
    reads = Reads(charge._gate.store, monkeypatch)
    first, second = charge.delay("o1", 100), charge.delay("o2", 100)
    assert published == [first.id, second.id] and reads.keys == []
    assert queue_length(prefix) == 2
    with app.producer_or_acquire() as producer:
        kept = producer.channel.__dict__.get(enqueue_redis._WIRE)
    assert kept is not None and (kept[1] is not None) is on_wire
    app.close()


def test_a_server_without_the_script_gets_it_loaded_on_the_wire() -> None:
    # A new or restarted server (or SCRIPT FLUSH) answers NOSCRIPT: the script is loaded once
    # and the push goes through, once.
    from tests.integration.harness import RedisServer

    server = RedisServer()
    url = f"redis://127.0.0.1:{server.port}/0"
    app = Celery("fused-noscript", broker=url, backend=url, set_as_current=False)
    app.conf.update(idempotency_key_prefix="idem:", task_default_queue="q")
    charge = make_task(app)
    client = redis.Redis.from_url(url)
    try:
        for order in ("o1", "o2"):
            client.script_flush()
            result = charge.delay(order, 100)
            assert not isinstance(result, CachedResult)
        assert client.llen("q") == 2
        with app.producer_or_acquire() as producer:
            assert producer.channel.__dict__[enqueue_redis._WIRE][1] is not None
    finally:
        client.close()
        app.close()
        server.cleanup()
