"""The transactional enqueue (``SQLStore.joined``) against a producer killed right after the
COMMIT, before it could publish: the committed intent is re-sent by a worker's relay, the action
runs once, and its body sees the committed row. Real PostgreSQL, MariaDB and SQLite, a real
SIGKILLed producer process, a real ``celery worker`` (Redis broker and backend).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
import sqlalchemy as sa
from celery.result import AsyncResult

from tests.integration.conftest import Cluster
from tests.integration.harness import ROOT, wait_for

pytestmark = pytest.mark.worker

PRODUCER = textwrap.dedent("""
    import os, signal, sys
    import sqlalchemy as sa
    from sqlalchemy import event
    from sqlalchemy.orm import Session
    from celery_idem.app import get_store
    from tests.integration.relay_app import app, ship_order

    store = get_store(app)
    engine = sa.create_engine(os.environ["IDEM_ORDERS_DB"])
    order_id = sys.argv[1]
    with Session(engine) as session:
        # An earlier after_commit hook that kills the process: ours never runs.
        event.listen(session, "after_commit", lambda s: os.kill(os.getpid(), signal.SIGKILL))
        with session.begin(), store.joined(session):
            session.execute(sa.text(f"INSERT INTO {os.environ['IDEM_ORDERS']} (id) VALUES (:i)"),
                            {"i": order_id})
            print(ship_order.delay(order_id).id, flush=True)
    print("survived", flush=True)
""")


@pytest.fixture(params=["postgresql", "mysql", "sqlite"])
def database(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'shop.db'}"
    return str(request.getfixturevalue("pg_url" if request.param == "postgresql" else "mysql_url"))


def test_a_producer_killed_after_the_commit_loses_no_action(
        make_cluster: Callable[..., Cluster], database: str) -> None:
    orders = f"orders_{uuid.uuid4().hex[:8]}"
    engine = sa.create_engine(database)
    with engine.begin() as conn:
        conn.exec_driver_sql(f"CREATE TABLE {orders} (id VARCHAR(40) PRIMARY KEY)")
    try:
        cluster = make_cluster(IDEM_STORE=f"db+{database}", IDEM_RELAY_AFTER="1",
                               IDEM_ORDERS=orders, IDEM_ORDERS_DB=database)
        from tests.integration import relay_app

        relay_app.app.conf.idempotency_relay_after = 1.0
        cluster.forget()
        list(cluster.store.intents())  # the store's tables exist, as after a worker's start
        order_id = f"ord-{uuid.uuid4().hex[:6]}"
        # Given a producer that commits an order and enqueues its shipping in the transaction,
        # then is SIGKILLed right after the COMMIT (before the message is published)
        run = subprocess.run([sys.executable, "-c", PRODUCER, order_id], cwd=ROOT, capture_output=True,
                             text=True, timeout=60, env={**os.environ, **cluster.env})
        assert run.returncode == -9, run.stderr
        task_id = run.stdout.split()[0]
        with engine.connect() as conn:
            assert conn.exec_driver_sql(f"SELECT id FROM {orders}").scalars().all() == [order_id]
        assert cluster.ledger.llen(cluster.env["IDEM_QUEUE"]) == 0  # nothing was published
        (intent,) = cluster.store.intents()
        assert intent.task_id == task_id
        # When a worker runs: its relay re-sends the committed intent
        cluster.worker("tx", app="tests.integration.relay_app")
        # Then the action runs once, under the caller's task id, and its body saw the order
        assert AsyncResult(task_id, app=cluster.app).get(timeout=60) == order_id
        assert cluster.effects(f"ship_order:{order_id}") == [f"{task_id}:1"]
        wait_for(lambda: list(cluster.store.intents()) == [], timeout=30,
                 what="the relay to close the intent")
    finally:
        with engine.begin() as conn:
            conn.exec_driver_sql(f"DROP TABLE IF EXISTS {orders}")
        engine.dispose()
