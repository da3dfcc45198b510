"""The producer's answer under a chosen task id: its cost, its fallbacks (Redis, no worker).

An enqueue of a done key answered from the record reads the record (one round trip: by
itself, or within the publish); under a
task id the caller chose it also stores the outcome there (one more: SET + PUBLISH in one
pipeline). When that write cannot be made, the message is published instead and the worker
answers it from the record.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery

from celery_idem import CachedResult, IdempotentTask
from celery_idem.config import accelerate_switch
from celery_idem.records import State


class RoundTrips:
    """Counts requests sent to Redis servers by this process (a pipeline is one)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        real = redis.connection.AbstractConnection.send_packed_command

        def send(conn: Any, command: Any, *a: Any, **kw: Any) -> Any:
            self.count += 1
            return real(conn, command, *a, **kw)

        monkeypatch.setattr(redis.connection.AbstractConnection, "send_packed_command", send)

    def during(self, fn: Any) -> tuple[int, Any]:
        before = self.count
        out = fn()
        return self.count - before, out




@pytest.fixture
def make_app(redis_url: str, prefix: str, redis_client: Any, redis_cleanup: None) -> Iterator[Any]:
    made: list[Celery] = []

    def make(**conf: Any) -> Any:
        app = Celery(f"answer-{uuid.uuid4().hex[:6]}", broker=redis_url, backend=redis_url,
                     set_as_current=False)
        app.conf.update(idempotency_key_prefix=prefix, result_expires=600,
                        task_default_queue=prefix + "queue",
                        result_backend_transport_options={"global_keyprefix": prefix}, **conf)

        @app.task(shared=False, name="answer.echo", base=IdempotentTask, bind=True)
        def echo(self: Any, value: str) -> str:
            return value

        # A done record, as a worker leaves it (the original task id "orig").
        key = echo.idempotency_key_for(("v",))
        claim = echo._gate.store.claim(key, owner="t", task_id="orig", attempt=0, lease=60,
                                       ttl=600)
        ctype, data = echo._gate.codec.encode_result("v")
        echo._gate.store.record(key, claim.token, state=State.DONE, content_type=ctype,
                                data=data, ttl=600)
        made.append(app)
        return echo

    yield make
    for app in made:
        app.backend.client.close()
    redis_client.delete(f"_kombu.binding.{prefix}queue")  # the published-instead message's


def _stored(echo: Any, task_id: str) -> dict[str, Any]:
    meta: dict[str, Any] = echo.backend.get_task_meta(task_id, cache=False)
    return meta


@pytest.mark.parametrize("within_publish", [True, False], ids=["within-publish", "read-first"])
@pytest.mark.parametrize("fold", [True, False])
def test_an_answer_under_a_chosen_id_costs_one_round_trip_more_than_the_read(
    make_app: Any, monkeypatch: pytest.MonkeyPatch, published: list[str], fold: bool,
    within_publish: bool,
) -> None:
    if within_publish and not accelerate_switch():
        pytest.skip("the check within the publish is an acceleration (CELERY_IDEM_ACCELERATE off)")
    echo = make_app(idempotency_fold_results=fold)
    trips = RoundTrips(monkeypatch)
    # The check rides on the publish (one script reads the record, and pushes only a message
    # whose key is not done), or reads the record first (see celery_idem.enqueue_redis.WithinPublish).
    if not within_publish and echo._enqueue_check is not None:
        echo._enqueue_check.possible = False
    echo.apply_async(("v",), task_id="warm-" + uuid.uuid4().hex)  # connections, scripts
    # Within the publish, Celery subscribed to the unsent message's result before the script
    # ran, and that is undone: SUBSCRIBE and UNSUBSCRIBE, sent without waiting for a reply.
    pubsub = 2 if within_publish else 0

    n, plain = trips.during(lambda: echo.delay("v"))
    assert n == 1 + pubsub and plain.id == "orig"  # the record's read; nothing written
    mine = "mine-" + uuid.uuid4().hex
    n, chosen = trips.during(lambda: echo.apply_async(("v",), task_id=mine))
    assert isinstance(chosen, CachedResult) and chosen.id == mine
    # Direct write: SET + PUBLISH in one pipeline. With the fold off (or accelerations), the
    # backend's own store_result: its GET of the old meta, then the pipeline.
    assert n == (2 if fold and accelerate_switch() else 3) + pubsub
    assert published == []
    meta = _stored(echo, mine)
    assert (meta["status"], meta["result"], meta["task_id"]) == ("SUCCESS", "v", mine)


def test_the_original_id_chosen_again_is_not_overwritten(make_app: Any) -> None:
    echo = make_app()
    echo.backend.store_result("orig", "v", "SUCCESS")
    before = echo.backend.client.get(echo.backend.get_key_for_task("orig"))
    again = echo.apply_async(("v",), task_id="orig")
    assert isinstance(again, CachedResult) and again.id == "orig"
    assert echo.backend.client.get(echo.backend.get_key_for_task("orig")) == before


def test_an_answer_that_cannot_be_stored_is_published_instead(
    make_app: Any, monkeypatch: pytest.MonkeyPatch, published: list[str]
) -> None:
    echo = make_app()

    def down(*_: Any, **__: Any) -> None:
        raise redis.ConnectionError("the backend blinked")

    monkeypatch.setattr(echo.backend, "_set_with_state", down)
    monkeypatch.setattr(echo.backend, "store_result", down)
    mine = "mine-" + uuid.uuid4().hex
    sent = echo.apply_async(("v",), task_id=mine)
    # The worker answers the message from the record, under this id.
    assert not isinstance(sent, CachedResult) and sent.id == mine
    assert published == [mine]


def test_an_ignored_result_is_not_stored(make_app: Any, published: list[str]) -> None:
    echo = make_app()
    mine = "mine-" + uuid.uuid4().hex
    ignored = echo.apply_async(("v",), task_id=mine, ignore_result=True)
    assert isinstance(ignored, CachedResult) and ignored.get() == "v"
    assert echo.backend.client.get(echo.backend.get_key_for_task(mine)) is None
    assert published == []


def test_a_database_backend_stores_the_answer_with_its_own_store_result(tmp_path: Any) -> None:
    import sqlalchemy as sa
    from celery.backends.database.session import ResultModelBase

    # Celery's tables, made here: Celery 5.4's backend makes them once per session manager, and
    # one that already prepared another database in this process would not make them again.
    engine = sa.create_engine(f"sqlite:///{tmp_path}/results.db")
    ResultModelBase.metadata.create_all(engine)
    engine.dispose()
    app = Celery("answer-db", broker="memory://", set_as_current=False,
                 backend=f"db+sqlite:///{tmp_path}/results.db")
    app.conf.idempotency_store = "memory://"

    @app.task(shared=False, name="answer.db_echo", base=IdempotentTask, bind=True)
    def echo(self: Any, value: str) -> str:
        return value

    key = echo.idempotency_key_for(("v",))
    claim = echo._gate.store.claim(key, owner="t", task_id="orig", attempt=0, lease=60, ttl=600)
    ctype, data = echo._gate.codec.encode_result("v")
    echo._gate.store.record(key, claim.token, state=State.DONE, content_type=ctype, data=data,
                            ttl=600)
    chosen = echo.apply_async(("v",), task_id="mine")
    assert isinstance(chosen, CachedResult) and chosen.id == "mine"
    meta = app.backend.get_task_meta("mine", cache=False)
    assert (meta["status"], meta["result"]) == ("SUCCESS", "v")
