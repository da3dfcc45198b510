"""Celery's result write folded into the record's round trip (celery_idem/results_redis.py).

When the result backend and the store are one Redis server and database, the record script
writes the backend's meta (SET + PUBLISH) and the tracer skips its own GET and SET. Otherwise
(another server or database, a SQL store, a duplicate answered from its record) the task writes
the meta with the backend's own SET + PUBLISH and skips the GET. These tests check that both
metas are the ones Celery writes, that Celery writes it itself whenever it must (callbacks,
ignored results, the setting off, a failed direct write, a backend that stores results its own
way) and that a stale holder writes none. The round trips of a real worker on the server are
tests/integration/test_result_fold.py's.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery
from celery.app.trace import build_tracer
from celery.backends.redis import RedisBackend

from celery_idem import IdempotentTask
from celery_idem.config import accelerate_switch
from celery_idem.exceptions import LeaseLost
from celery_idem.paths import result_writer
from celery_idem.records import State
from celery_idem.results_redis import RedisResultWriter, redis_result_writer
from celery_idem.stores.base import BackendWrite
from celery_idem.stores.redis import RedisStore
from tests.conftest import PG_URL, require
from tests.integration.harness import RedisServer, wait_for
from tests.stores.support import drop_table

#: The tests of the fold itself (an acceleration): skipped with accelerations off, where the
#: task has no result writer and Celery writes every result (the "setting_off" case below).
fold_only = pytest.mark.skipif(not accelerate_switch(),
                               reason="the result fold is an acceleration (CELERY_IDEM_ACCELERATE off)")


class _Spy:
    """Counts the backend's own result reads and writes (and still does them)."""

    def __init__(self, backend: RedisBackend, monkeypatch: pytest.MonkeyPatch) -> None:
        self.sets: list[Any] = []
        self.gets: list[Any] = []
        real_set, real_get = backend.set, backend.get

        def set_(key: Any, value: Any, *a: Any, **kw: Any) -> Any:
            self.sets.append(key)
            return real_set(key, value, *a, **kw)

        def get_(key: Any) -> Any:
            self.gets.append(key)
            return real_get(key)

        monkeypatch.setattr(backend, "set", set_)
        monkeypatch.setattr(backend, "get", get_)


@pytest.fixture
def make_app(redis_url: str, prefix: str, redis_cleanup: None) -> Iterator[Any]:
    made: list[Celery] = []

    def make(store_db: int | None = None, **conf: Any) -> Celery:
        app = Celery(f"fold-{uuid.uuid4().hex[:6]}", broker=redis_url, backend=redis_url,
                     set_as_current=False)
        app.conf.update(idempotency_key_prefix=prefix, result_expires=600,
                        result_backend_transport_options={"global_keyprefix": prefix}, **conf)
        if store_db is not None:
            app.conf.idempotency_store = redis_url.rsplit("/", 1)[0] + f"/{store_db}"

        @app.task(shared=False, name="fold.charge", base=IdempotentTask, bind=True,
                  idempotency_fields=("order_id",))
        def charge(self: Any, order_id: str, cents: int) -> dict[str, Any]:
            return {"order_id": order_id, "cents": cents,
                    "fenced": self.idempotency_token is not None}

        @app.task(shared=False, name="fold.plain")
        def plain(order_id: str, cents: int) -> dict[str, Any]:
            return {"order_id": order_id, "cents": cents, "fenced": True}

        made.append(app)
        return app

    yield make
    for app in made:
        app.backend.client.close()


def _run(app: Celery, name: str, args: tuple[Any, ...], **request: Any) -> tuple[str, Any]:
    """Run one task through Celery's real tracer, as a worker's pool does (not eager)."""
    task = app.tasks[name]
    task_id = uuid.uuid4().hex
    headers = {}
    if isinstance(task, IdempotentTask):
        headers["idempotency_key"] = task.idempotency_key_for(args, {})
    req = {"id": task_id, "task": name, "retries": 0, "headers": headers, "hostname": "w@h",
           "delivery_info": {"routing_key": "q", "exchange": "", "redelivered": False},
           "is_eager": False, **request}
    trace = build_tracer(name, task, app.loader, "w@h", app=app, eager=False)
    out = trace(task_id, args, {}, req)
    assert out.info is None or out.info.state == "SUCCESS", out
    return task_id, out.retval


def _meta(app: Celery, task_id: str) -> dict[str, Any]:
    raw = app.backend.client.get(app.backend.get_key_for_task(task_id))
    assert raw is not None, f"no result meta for {task_id}"
    meta: dict[str, Any] = app.backend.decode(raw)
    return meta


@fold_only
def test_the_folded_meta_is_the_one_celery_writes_and_the_backend_writes_nothing(
    make_app: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = make_app(result_extended=True)
    spy = _Spy(app.backend, monkeypatch)
    plain_id, _ = _run(app, "fold.plain", ("o-1", 500))
    assert len(spy.sets) == 1 and len(spy.gets) == 1  # Celery's own path: GET, then SET+PUBLISH
    idem_id, value = _run(app, "fold.charge", ("o-1", 500))
    assert value == {"order_id": "o-1", "cents": 500, "fenced": True}
    assert len(spy.sets) == 1 and len(spy.gets) == 1, "the tracer wrote the folded result again"

    folded, reference = _meta(app, idem_id), _meta(app, plain_id)
    assert sorted(folded) == sorted(reference)  # extended meta: name, args, kwargs, worker, ...
    assert folded["status"] == "SUCCESS" and folded["result"] == value
    assert folded["task_id"] == idem_id and folded["name"] == "fold.charge"
    assert folded["args"] == ["o-1", 500] and folded["worker"] == "w@h" and folded["queue"] == "q"
    ttl = app.backend.client.ttl(app.backend.get_key_for_task(idem_id))
    assert 0 < ttl <= 600  # result_expires, as the backend sets it
    # The result is readable the usual way, and the record is done with the same value.
    assert app.AsyncResult(idem_id).get(timeout=10) == value
    key = app.tasks["fold.charge"].idempotency_key_for(("o-1", 500), {})
    assert app.tasks["fold.charge"]._gate.store.get(key).state is State.DONE


@pytest.mark.parametrize("case", ["link", "ignore_result", "setting_off"])
def test_celery_writes_the_result_itself_when_it_must(
    make_app: Any, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    extra: dict[str, Any] = {}
    app = make_app(idempotency_fold_results=False) if case == "setting_off" else make_app()
    if case == "link":
        extra["callbacks"] = [app.tasks["fold.plain"].s(7).set(queue="fold-unused-" + uuid.uuid4().hex)]
    if case == "ignore_result":
        extra["ignore_result"] = True
    spy = _Spy(app.backend, monkeypatch)
    order = f"o-{case}"
    task_id, value = _run(app, "fold.charge", (order, 1), **extra)
    store = app.tasks["fold.charge"]._gate.store
    key = app.tasks["fold.charge"].idempotency_key_for((order, 1), {})
    try:
        assert store.get(key).state is State.DONE
        if case == "ignore_result":
            assert spy.sets == [] and app.backend.client.get(app.backend.get_key_for_task(task_id)) is None
        else:
            # Celery's own path: the GET of the old meta, then SET + PUBLISH.
            assert len(spy.gets) == 1 and len(spy.sets) == 1, (case, spy.gets, spy.sets)
            assert _meta(app, task_id)["result"] == value
    finally:
        store.client.delete(store.prefix + key)
        if case == "link":
            app.connection_for_write().default_channel.queue_purge(extra["callbacks"][0].options["queue"])


@fold_only
def test_a_store_elsewhere_gets_the_result_written_without_the_backends_get(
    make_app: Any, monkeypatch: pytest.MonkeyPatch, redis_url: str
) -> None:
    """Store on another database: not folded; one SET + PUBLISH, the same meta as Celery's."""
    app = make_app(store_db=int(redis_url.rsplit("/", 1)[1] or 0) + 1, result_extended=True)
    writer = app.tasks["fold.charge"]._result_writer
    assert writer is not None and not writer.folds
    spy = _Spy(app.backend, monkeypatch)
    plain_id, _ = _run(app, "fold.plain", ("o-d", 5))
    assert len(spy.gets) == 1 and len(spy.sets) == 1
    idem_id, value = _run(app, "fold.charge", ("o-d", 5))
    assert len(spy.gets) == 1, "the direct write read the old meta"
    assert len(spy.sets) == 2, "the result was not written once"
    direct, reference = _meta(app, idem_id), _meta(app, plain_id)
    assert sorted(direct) == sorted(reference)
    assert direct["status"] == "SUCCESS" and direct["result"] == value
    assert direct["task_id"] == idem_id and direct["args"] == ["o-d", 5]
    assert 0 < app.backend.client.ttl(app.backend.get_key_for_task(idem_id)) <= 600
    assert app.AsyncResult(idem_id).get(timeout=10) == value
    store = app.tasks["fold.charge"]._gate.store
    key = app.tasks["fold.charge"].idempotency_key_for(("o-d", 5), {})
    store.client.delete(store.prefix + key)


@fold_only
def test_a_duplicate_answered_from_its_record_writes_that_result_without_a_get(
    make_app: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = make_app()
    assert app.tasks["fold.charge"]._result_writer.folds
    first_id, first = _run(app, "fold.charge", ("o-dup", 9))
    spy = _Spy(app.backend, monkeypatch)
    dup_id, again = _run(app, "fold.charge", ("o-dup", 9))  # another message, the same action
    assert again == first and dup_id != first_id
    assert spy.gets == [] and len(spy.sets) == 1
    assert _meta(app, dup_id)["result"] == first and _meta(app, dup_id)["task_id"] == dup_id
    store = app.tasks["fold.charge"]._gate.store
    store.client.delete(store.prefix + app.tasks["fold.charge"].idempotency_key_for(("o-dup", 9), {}))


@fold_only
def test_a_failed_direct_write_leaves_the_result_to_celery(
    make_app: Any, monkeypatch: pytest.MonkeyPatch, redis_url: str
) -> None:
    app = make_app(store_db=int(redis_url.rsplit("/", 1)[1] or 0) + 1)
    real = app.backend._set_with_state
    calls: list[str] = []

    def flaky(key: Any, value: Any, state: Any) -> Any:
        calls.append(key)
        if len(calls) == 1:
            raise redis.ConnectionError("the backend blinked")
        return real(key, value, state)

    monkeypatch.setattr(app.backend, "_set_with_state", flaky)
    spy = _Spy(app.backend, monkeypatch)
    task_id, value = _run(app, "fold.charge", ("o-flaky", 3))
    # Our write failed; Celery's own path followed: its GET, then its SET + PUBLISH.
    assert len(calls) == 2 and len(spy.gets) == 1
    assert _meta(app, task_id)["result"] == value
    store = app.tasks["fold.charge"]._gate.store
    store.client.delete(store.prefix + app.tasks["fold.charge"].idempotency_key_for(("o-flaky", 3), {}))


@fold_only
def test_a_backend_that_stores_results_its_own_way_is_left_alone(make_app: Any) -> None:
    app = make_app()

    class Audited(RedisBackend):
        def _store_result(self, *args: Any, **kwargs: Any) -> Any:
            return super()._store_result(*args, **kwargs)

    task = app.tasks["fold.charge"]
    assert result_writer(task, task._gate.store) is not None
    own = Audited(app=app, url=app.conf.result_backend)
    task.backend = own
    try:
        assert result_writer(task, task._gate.store) is None
    finally:
        task.backend = app.backend
        own.client.close()


@fold_only
def test_a_sql_store_gets_the_result_written_without_the_backends_get(
    make_app: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    require(PG_URL, 5432, "PostgreSQL")
    table = f"fold_{uuid.uuid4().hex[:8]}"
    app = make_app(idempotency_store="db+" + PG_URL, idempotency_store_options={"table_name": table})
    store = app.tasks["fold.charge"]._gate.store
    try:
        spy = _Spy(app.backend, monkeypatch)
        task_id, value = _run(app, "fold.charge", ("o-sql", 4))
        assert spy.gets == [] and len(spy.sets) == 1
        assert _meta(app, task_id)["result"] == value
    finally:
        drop_table(store)
        store.close()


def test_a_holder_that_lost_its_claim_writes_no_result(redis_url: str, prefix: str,
                                                        redis_cleanup: None) -> None:
    store = RedisStore.from_url(redis_url, prefix=prefix)
    meta_key = prefix + "meta-stale"
    try:
        first = store.claim("k", owner="a", task_id="t1", attempt=0, lease=0.05, ttl=60)
        taken = wait_for(lambda: (c := store.claim("k", owner="b", task_id="t2", attempt=0,
                                                   lease=60, ttl=60)).status.holds and c,
                         timeout=5)
        assert taken.token > first.token
        stale = BackendWrite(key=meta_key, value=b'{"status": "SUCCESS"}', expires=60)
        with pytest.raises(LeaseLost):
            store.record_with("k", first.token, state=State.DONE, content_type="c", data=b"a",
                              ttl=60, also=stale)
        assert store.client.get(meta_key) is None
        # The current holder writes it; a retry of the same record (a lost reply) still says ok.
        fresh = BackendWrite(key=meta_key, value=b"m2", expires=60)
        for _ in range(2):
            assert store.record_with("k", taken.token, state=State.DONE, content_type="c",
                                     data=b"b", ttl=60, also=fresh, claim_id=taken.claim_id)
        assert store.client.get(meta_key) == b"m2"
    finally:
        store.client.delete(meta_key)
        store.close()


@pytest.mark.server  # a private redis-server
def test_a_refused_meta_write_leaves_the_record_written_and_the_result_to_celery() -> None:
    server = RedisServer()
    try:
        admin = redis.Redis.from_url(server.url)
        # A user that may run scripts on the records but not write other keys (an ACL split).
        admin.acl_setuser("idem", enabled=True, passwords=["+pw"], keys=["rec:*"],
                          channels=["*"], commands=["+@all"])
        host, port = server.url.split("//")[1].split("/")[0].split(":")
        store = RedisStore.from_url(f"redis://idem:pw@{host}:{port}/0", prefix="rec:")
        held = store.claim("k", owner="a", task_id="t", attempt=0, lease=60, ttl=60)
        write = BackendWrite(key="celery-task-meta-t", value=b"m", expires=60)
        folded = store.record_with("k", held.token, state=State.DONE, content_type="c", data=b"v",
                                   ttl=60, also=write, claim_id=held.claim_id)
        assert not folded  # the caller leaves the result to the backend
        assert store.get("k").state is State.DONE and admin.get("celery-task-meta-t") is None
        store.close()
        admin.close()
    finally:
        server.cleanup()


# -- the writer's choice and its write, without a worker ------------------------------------------
# Building a backend or a store connects to nothing: these run no round trip.

REDIS_NOWHERE = "redis://127.0.0.1:1"  # nothing listens there


def _task(backend: str) -> Any:
    app = Celery("results-redis", broker="memory://", backend=backend, set_as_current=False)

    @app.task(shared=False, name="rr.charge", base=IdempotentTask)
    def charge(order_id: str) -> str:
        return order_id

    return app.tasks["rr.charge"]


def _request(task_id: str = "t-1", **fields: Any) -> Any:
    from celery.app.task import Context

    return Context(**{"id": task_id, "is_eager": False, "called_directly": False, "callbacks": None,
                      "chain": None, "chord": None, "ignore_result": False, **fields})


@pytest.mark.parametrize(("store_db", "folds"), [(0, True), (1, False)])
def test_the_writer_folds_only_with_the_store_on_the_backends_server_and_database(
    store_db: int, folds: bool
) -> None:
    task = _task(f"{REDIS_NOWHERE}/0")
    store = RedisStore.from_url(f"{REDIS_NOWHERE}/{store_db}", prefix="p:")
    try:
        writer = redis_result_writer(task, store)
        assert isinstance(writer, RedisResultWriter) and writer.folds is folds
    finally:
        store.close()
        task.backend.client.close()


def test_a_backend_that_is_not_redis_gets_no_writer() -> None:
    task = _task("cache+memory://")
    store = RedisStore.from_url(f"{REDIS_NOWHERE}/0", prefix="p:")
    try:
        assert redis_result_writer(task, store) is None
    finally:
        store.close()


def test_the_built_write_is_the_meta_celery_would_store_under_the_backends_key() -> None:
    task = _task(f"{REDIS_NOWHERE}/0")
    backend = task.backend
    store = RedisStore.from_url(f"{REDIS_NOWHERE}/0", prefix="p:")
    try:
        writer = redis_result_writer(task, store)
        assert writer is not None
        write = writer.build(_request("t-42"), {"cents": 5})
        assert write is not None
        assert write.key == backend.get_key_for_task("t-42").decode()
        meta = backend.decode(write.value)
        assert (meta["status"], meta["result"], meta["task_id"]) == ("SUCCESS", {"cents": 5}, "t-42")
        assert write.expires == int(backend.expires)
        failed = writer.build(_request("t-43"), KeyError("gone"), state="FAILURE")
        assert failed is not None
        assert backend.decode(failed.value)["result"]["exc_type"] == "KeyError"
    finally:
        store.close()
        backend.client.close()


@pytest.mark.parametrize("request_fields", [
    {"is_eager": True}, {"called_directly": True}, {"callbacks": [{"task": "x"}]},
    {"chain": [{"task": "x"}]}, {"chord": {"task": "x"}}, {"ignore_result": True},
], ids=["eager", "direct", "callbacks", "chain", "chord", "ignored"])
def test_requests_celery_must_handle_build_no_write(request_fields: dict[str, Any]) -> None:
    task = _task(f"{REDIS_NOWHERE}/0")
    store = RedisStore.from_url(f"{REDIS_NOWHERE}/0", prefix="p:")
    try:
        writer = redis_result_writer(task, store)
        assert writer is not None
        assert writer.build(_request(), "v") is not None  # the control
        assert writer.build(_request(**request_fields), "v") is None
    finally:
        store.close()
        task.backend.client.close()


def test_a_meta_over_the_backends_size_limit_is_left_to_celery() -> None:
    task = _task(f"{REDIS_NOWHERE}/0")
    store = RedisStore.from_url(f"{REDIS_NOWHERE}/0", prefix="p:")
    try:
        writer = redis_result_writer(task, store)
        assert writer is not None
        writer._limit = 200  # the backend's _MAX_STR_VALUE_SIZE, made small
        assert writer.build(_request(), "x" * 10) is not None
        assert writer.build(_request(), "x" * 500) is None
    finally:
        store.close()
        task.backend.client.close()


def test_a_direct_write_that_fails_says_so_and_raises_nothing() -> None:
    task = _task(f"{REDIS_NOWHERE}/0")
    store = RedisStore.from_url(f"{REDIS_NOWHERE}/0", prefix="p:")
    try:
        writer = redis_result_writer(task, store)
        assert writer is not None
        task.backend.retry_policy = {"max_retries": 0}
        write = BackendWrite(key="celery-task-meta-t", value=b"{}", expires=60)
        assert writer.write(write) is False  # nothing listens: Celery's own write follows
    finally:
        store.close()
        task.backend.client.close()


def test_a_direct_write_is_the_backends_set(redis_url: str, prefix: str,
                                                       redis_cleanup: None) -> None:
    task = _task(redis_url)
    store = RedisStore.from_url(redis_url, prefix=prefix)
    try:
        writer = redis_result_writer(task, store)
        assert writer is not None
        key = prefix + "meta"
        assert writer.write(BackendWrite(key=key, value=b'{"status": "SUCCESS"}', expires=60))
        assert store.client.get(key) == b'{"status": "SUCCESS"}'
        # The backend's own SETEX, with its result_expires (what build() put in the write too).
        assert 0 < store.client.ttl(key) <= int(task.backend.expires)
    finally:
        store.close()
        task.backend.client.close()
