"""The transactional enqueue on Django: an intent task's ``delay()`` inside
``transaction.atomic()`` on the store's database writes its intent in that transaction and is
sent on the commit. A producer SIGKILLed right after the COMMIT (by an earlier ``on_commit``
hook) loses nothing: a worker's relay sends the committed intent, the action runs once and
sees the committed row. A rollback sends nothing. Real SQLite, PostgreSQL and MariaDB, real
killed producer processes and ``celery worker`` processes, a private ``redis-server`` broker.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from tests.django.support import django_databases, require_mysql, worker_env  # noqa: F401
from tests.integration.harness import ROOT, RedisServer, Worker, wait_for

pytestmark = [pytest.mark.worker]

APP = "tests.django.celery_app"

PRODUCER = textwrap.dedent("""
    import os, signal, sys
    from django.db import transaction
    from tests.django import celery_app
    from tests.django.shop.models import Order

    action, rollback = sys.argv[1], sys.argv[2] == "rollback"
    try:
        with transaction.atomic():
            Order.objects.create(action=action, amount=1, task_id="producer", token=0, pid=os.getpid())
            # An earlier on_commit hook that kills the process: the enqueue's hook never runs.
            transaction.on_commit(lambda: os.kill(os.getpid(), signal.SIGKILL))
            print(celery_app.ship_order.delay(action).id, flush=True)
            if rollback:
                raise RuntimeError("rolled back")
    except RuntimeError:
        print("rolled back", flush=True)
""")


@pytest.fixture(scope="module")
def broker() -> Iterator[RedisServer]:
    server = RedisServer()
    yield server
    server.cleanup()


@pytest.fixture(params=["sqlite", "pg", "mysql"])
def env(request: pytest.FixtureRequest, django_databases: Any,  # noqa: F811
        broker: RedisServer) -> dict[str, str]:
    if request.param == "mysql":
        require_mysql()
    return {**worker_env(request.param), "DJ_BROKER": broker.url,
            "DJ_PREFIX": f"djt{uuid.uuid4().hex[:8]}:", "DJ_QUEUE": f"djtq{uuid.uuid4().hex[:8]}",
            "DJ_RELAY_AFTER": "1", "PYTHONPATH": str(ROOT)}


def produce(env: dict[str, str], action: str, how: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", PRODUCER, action, how], cwd=ROOT, text=True,
                          capture_output=True, timeout=120, env={**os.environ, **env})


def test_a_producer_killed_after_the_commit_loses_no_action(env: dict[str, str],
                                                           broker: RedisServer) -> None:
    import redis

    flags = redis.Redis.from_url(broker.url)
    action = f"tx-{uuid.uuid4().hex[:6]}"
    # Given a producer killed right after the COMMIT of the order and its enqueue
    run = produce(env, action, "commit")
    assert run.returncode == -9, run.stderr
    task_id = run.stdout.split()[0]
    assert flags.llen(env["DJ_QUEUE"]) == 0  # nothing was published
    # When a worker runs: its relay sends the committed intent
    worker = Worker(env, f"djtx-{env['CELERY_IDEM_DJANGO_ALIAS']}", app=APP,
                    extra=("-Q", env["DJ_QUEUE"]))
    try:
        # Then the action runs once, under the caller's task id, and saw the committed order
        key = f"{env['DJ_PREFIX']}shipped:{action}"
        wait_for(lambda: flags.llen(key) >= 1, timeout=90, what="the relayed action to run")
        wait_for(lambda: "celery_idem relayed" in worker.text(), timeout=30, what="the relay's line")
        assert [v.decode() for v in flags.lrange(key, 0, -1)] == [f"{task_id}:True"]
    finally:
        worker.kill()
        flags.close()


def test_a_rollback_sends_nothing(env: dict[str, str], broker: RedisServer) -> None:
    import redis

    flags = redis.Redis.from_url(broker.url)
    action = f"rb-{uuid.uuid4().hex[:6]}"
    run = produce(env, action, "rollback")
    assert run.returncode == 0 and "rolled back" in run.stdout, run.stderr
    assert flags.llen(env["DJ_QUEUE"]) == 0
    # No intent either: a relay finds nothing to send
    check = subprocess.run(
        [sys.executable, "-m", "celery", "-A", APP, "idem", "intents", "--json"], cwd=ROOT,
        text=True, capture_output=True, timeout=120, env={**os.environ, **env})
    assert check.returncode == 0, check.stderr
    assert '"pending": 0' in check.stdout.replace(" ", " "), check.stdout
    flags.close()
