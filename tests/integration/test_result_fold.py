"""Celery's result write folded into the record's round trip (celery_idem/results.py).

When the result backend and the store are one Redis server and database, the record script
writes the backend's meta (SET + PUBLISH) and the tracer skips its own GET and SET. These tests
check that the folded meta is the one Celery writes, that Celery writes it itself whenever it
must (callbacks, ignored results, another database, the setting off, a refused write), that a
stale holder writes none, and, with real workers, the round trips on the server.
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
from celery_idem.exceptions import LeaseLost
from celery_idem.records import State
from celery_idem.stores.base import BackendWrite
from celery_idem.stores.redis import RedisStore
from tests.integration import app as app_module
from tests.integration.conftest import Cluster
from tests.integration.harness import RedisServer, wait_for


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
            return {"order_id": order_id, "cents": cents, "token": self.idempotency_token}

        @app.task(shared=False, name="fold.plain")
        def plain(order_id: str, cents: int) -> dict[str, Any]:
            return {"order_id": order_id, "cents": cents, "token": 1}

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


def test_the_folded_meta_is_the_one_celery_writes_and_the_backend_writes_nothing(
    make_app: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = make_app(result_extended=True)
    spy = _Spy(app.backend, monkeypatch)
    plain_id, _ = _run(app, "fold.plain", ("o-1", 500))
    assert len(spy.sets) == 1 and len(spy.gets) == 1  # Celery's own path: GET, then SET+PUBLISH
    idem_id, value = _run(app, "fold.charge", ("o-1", 500))
    assert value == {"order_id": "o-1", "cents": 500, "token": 1}
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


@pytest.mark.parametrize("case", ["link", "ignore_result", "other_db", "setting_off"])
def test_celery_writes_the_result_itself_when_it_cannot_be_folded(
    make_app: Any, monkeypatch: pytest.MonkeyPatch, case: str, redis_url: str
) -> None:
    extra: dict[str, Any] = {}
    if case == "other_db":
        app = make_app(store_db=int(redis_url.rsplit("/", 1)[1] or 0) + 1)
    elif case == "setting_off":
        app = make_app(idempotency_fold_results=False)
    else:
        app = make_app()
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
            assert len(spy.sets) == 1, f"{case}: Celery did not write the result"
            assert _meta(app, task_id)["result"] == value
    finally:
        store.client.delete(store.prefix + key)
        if case == "link":
            app.connection_for_write().default_channel.queue_purge(extra["callbacks"][0].options["queue"])


def test_a_holder_that_lost_its_claim_writes_no_result(redis_url: str, prefix: str,
                                                        redis_cleanup: None) -> None:
    store = RedisStore.from_url(redis_url, prefix=prefix)
    meta_key = prefix + "meta-stale"
    try:
        first = store.claim("k", owner="a", task_id="t1", attempt=0, lease=0.05, ttl=60)
        wait_for(lambda: store.claim("k", owner="b", task_id="t2", attempt=0, lease=60,
                                     ttl=60).token == 2, timeout=5)
        stale = BackendWrite(key=meta_key, value=b'{"status": "SUCCESS"}', expires=60)
        with pytest.raises(LeaseLost):
            store.record_with("k", first.token, state=State.DONE, content_type="c", data=b"a",
                              ttl=60, also=stale)
        assert not stale.written and store.client.get(meta_key) is None
        # The current holder writes it; a retry of the same record (a lost reply) still says ok.
        fresh = BackendWrite(key=meta_key, value=b"m2", expires=60)
        for _ in range(2):
            store.record_with("k", 2, state=State.DONE, content_type="c", data=b"b", ttl=60,
                              also=fresh)
            assert fresh.written
        assert store.client.get(meta_key) == b"m2"
    finally:
        store.client.delete(meta_key)
        store.close()


def test_a_refused_meta_write_leaves_the_record_written_and_the_result_to_celery() -> None:
    server = RedisServer()
    try:
        admin = redis.Redis.from_url(server.url)
        # A user that may run scripts on the records but not write other keys (an ACL split).
        admin.acl_setuser("idem", enabled=True, passwords=["+pw"], keys=["rec:*"],
                          channels=["*"], commands=["+@all"])
        host, port = server.url.split("//")[1].split("/")[0].split(":")
        store = RedisStore.from_url(f"redis://idem:pw@{host}:{port}/0", prefix="rec:")
        store.claim("k", owner="a", task_id="t", attempt=0, lease=60, ttl=60)
        write = BackendWrite(key="celery-task-meta-t", value=b"m", expires=60)
        store.record_with("k", 1, state=State.DONE, content_type="c", data=b"v", ttl=60,
                          also=write)
        assert not write.written  # the caller leaves the result to the backend
        assert store.get("k").state is State.DONE and admin.get("celery-task-meta-t") is None
        store.close()
        admin.close()
    finally:
        server.cleanup()


def _stats(client: redis.Redis) -> dict[str, int]:
    # failed_calls: a first EVALSHA on a fresh server answers NOSCRIPT (then the script is loaded)
    return {name: int(v["calls"]) - int(v.get("failed_calls", 0))
            for name, v in client.info("commandstats").items()}


@pytest.mark.worker
@pytest.mark.parametrize("fold", [True, False])
def test_a_real_worker_stores_each_result_with_the_record(make_cluster: Any, fold: bool) -> None:
    """Backend and store on a private server: count what the worker sends it per task."""
    server = RedisServer()
    try:
        cluster: Cluster = make_cluster(IDEM_BACKEND=server.url, IDEM_FOLD="1" if fold else "0")
        cluster.worker(pool="solo")
        client = redis.Redis.from_url(server.url)
        before = _stats(client)
        results = [app_module.charge.delay(f"fold-{fold}-{i}", 100) for i in range(20)]
        values = [r.get(timeout=30) for r in results]
        assert [v["order_id"] for v in values] == [f"fold-{fold}-{i}" for i in range(20)]
        after = _stats(client)
        calls = {name: after.get(name, 0) - before.get(name, 0) for name in after}
        # Producer: 20 enqueue checks (GET of the record). Worker: claim + record per task
        # (EVALSHA); unfolded, the backend adds a GET and a SETEX per task.
        assert calls.get("cmdstat_evalsha", 0) == 40, calls
        # Commands a script runs count too: the claim and the record scripts each GET and SET the
        # record (one string), and the folded meta shows as one more SET and a PUBLISH.
        scripts, producer = 2 * 20, 20
        # The client's AsyncResult.get reads each result at most once (GET) after subscribing;
        # the worker's backend adds a GET and a SETEX per task when nothing is folded.
        gets = calls.get("cmdstat_get", 0) - scripts - producer
        if fold:
            assert calls.get("cmdstat_setex", 0) == 0 and gets <= 20, calls
            assert calls.get("cmdstat_set", 0) == scripts + 20, calls
        else:
            assert calls.get("cmdstat_setex", 0) == 20 and gets >= 20, calls
            assert calls.get("cmdstat_set", 0) == scripts, calls
        assert all(len(cluster.effects(f"charge:fold-{fold}-{i}")) == 1 for i in range(20))
        client.close()
    finally:
        server.cleanup()
