"""The transactional enqueue on the SQL store (``SQLStore.joined``): an intent task's ``delay()``
inside the caller's SQLAlchemy session writes its intent in that transaction and is sent after
the commit; a rollback sends nothing. Real PostgreSQL, MariaDB and SQLite (a file), kombu's
in-process broker (what is sent is read back from its queue).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery
from kombu import Connection
from sqlalchemy.orm import Session

from celery_idem import IdempotentTask
from celery_idem.exceptions import ImproperlyConfigured
from celery_idem.stores.sql import SQLStore
from tests.conftest import MYSQL_URL, PG_URL

pytestmark = pytest.mark.server


@pytest.fixture(params=["postgresql", "mysql", "sqlite"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return {"postgresql": PG_URL, "mysql": MYSQL_URL,
            "sqlite": f"sqlite:///{tmp_path / 'shop.db'}"}[request.param]


@pytest.fixture
def shop(url: str) -> Iterator[tuple[Celery, Any, sa.Engine, sa.Table]]:
    suffix = uuid.uuid4().hex[:8]
    app = Celery(f"joined_{suffix}", broker=f"memory://joined-{suffix}", set_as_current=False)
    app.conf.idempotency_store = f"db+{url}"
    app.conf.idempotency_store_options = {"table_name": f"joined_{suffix}"}
    app.conf.task_default_queue = f"q-{suffix}"

    @app.task(base=IdempotentTask, shared=False, idempotency_intent=True)
    def ship(order_id: str) -> str:
        return order_id

    engine = sa.create_engine(url)
    orders = sa.Table(f"orders_{suffix}", sa.MetaData(), sa.Column("id", sa.String(40), primary_key=True))
    orders.create(engine)
    list(ship.idempotency_gate.store.intents())  # the store's tables, as a worker's start makes them
    yield app, ship, engine, orders
    store = ship.idempotency_gate.store
    with engine.begin() as conn:
        for name in (orders.name, f"joined_{suffix}_intents", f"joined_{suffix}_watermarks",
                     f"joined_{suffix}"):
            conn.exec_driver_sql(f"DROP TABLE IF EXISTS {name}")
    store.close()
    engine.dispose()


def queued(app: Celery) -> list[Any]:
    got: list[Any] = []
    with Connection(app.conf.broker_url) as conn:
        simple = conn.SimpleQueue(app.conf.task_default_queue, no_ack=True)
        while True:
            try:
                got.append(simple.get(block=False))
            except simple.Empty:
                break
        simple.close()
    return got


def test_the_message_goes_out_after_the_commit_with_its_intent_committed(shop: Any) -> None:
    app, ship, engine, orders = shop
    store = ship.idempotency_gate.store
    with Session(engine) as session:
        with session.begin(), store.joined(session):
            session.execute(sa.insert(orders).values(id="o-1"))
            result = ship.delay("o-1")
            assert queued(app) == []  # not before the commit
        (sent,) = queued(app)
    assert sent.headers["id"] == result.id
    (intent,) = list(store.intents())
    assert intent.task_id == result.id and intent.key == result.idempotency_key


def test_a_rollback_sends_nothing_and_keeps_no_intent(shop: Any) -> None:
    app, ship, engine, orders = shop
    store = ship.idempotency_gate.store
    with Session(engine) as session, store.joined(session):
        session.begin()
        session.execute(sa.insert(orders).values(id="o-2"))
        ship.delay("o-2")
        session.rollback()
        session.begin()  # a later transaction of the same session sends only its own
        ship.delay("o-3")
        session.commit()
    assert [m.decode()[0] for m in queued(app)] == [["o-3"]]
    assert [i.key for i in store.intents()] == [ship.idempotency_key_for(("o-3",), {})]
    with engine.connect() as conn:
        assert conn.execute(sa.select(orders.c.id)).scalars().all() == []


def test_a_savepoint_is_refused_and_nothing_is_sent(shop: Any) -> None:
    app, ship, engine, _ = shop
    store = ship.idempotency_gate.store
    with Session(engine) as session, session.begin(), store.joined(session), \
            session.begin_nested(), pytest.raises(ImproperlyConfigured, match="SAVEPOINT"):
        ship.delay("o-4")
    assert queued(app) == []


def test_a_session_on_another_database_is_refused(shop: Any, tmp_path: Path) -> None:
    _, ship, _, _ = shop
    other = sa.create_engine(f"sqlite:///{tmp_path / 'other.db'}")
    store: SQLStore = ship.idempotency_gate.store
    with Session(other) as session, pytest.raises(ImproperlyConfigured, match="is not the store's"), \
            store.joined(session):
        pass
    other.dispose()


def test_a_failed_publish_after_the_commit_leaves_the_intent_to_the_relay(
        shop: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    app, ship, engine, orders = shop
    store = ship.idempotency_gate.store

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise ConnectionError("broker down")

    with Session(engine) as session, session.begin(), store.joined(session):
        session.execute(sa.insert(orders).values(id="o-5"))
        result = ship.delay("o-5")
        monkeypatch.setattr(app, "producer_or_acquire", broken)
    assert "could not publish after the commit; the relay will" in caplog.text
    assert [i.task_id for i in store.intents()] == [result.id]
