"""Django with real ``celery worker`` processes, on SQLite and on PostgreSQL.

The store is Django's ``default`` database of the worker, picked by
``result_backend = "django-db"`` (django-celery-results writes the task results there too); the
business writes are ORM writes to the same database. Each test runs once per database (the
worker's ``default`` is the SQLite file, or the PostgreSQL test database) with its own private
``redis-server`` as broker.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.django.support import configure, django_databases, worker_env  # noqa: F401
from tests.integration.harness import ROOT, RedisServer, Worker, wait_for

pytestmark = [pytest.mark.worker]

APP = "tests.django.celery_app"

# The worker's default database, and its alias in this test process.
DATABASES = {"sqlite": "default", "pg": "pg"}


class Env:
    """One database's worker environment, broker and helpers to read what the workers did."""

    def __init__(self, db: str, broker: RedisServer) -> None:
        self.db = db
        self.alias = DATABASES[db]
        self.prefix = f"dj{uuid.uuid4().hex[:8]}:"
        self.queue = f"djq{uuid.uuid4().hex[:8]}"
        self.env = {**worker_env(db), "DJ_BROKER": broker.url, "DJ_PREFIX": self.prefix,
                    "DJ_QUEUE": self.queue, "PYTHONPATH": str(ROOT)}
        self.workers: list[Worker] = []
        from tests.django import celery_app

        celery_app.app.conf.broker_url = broker.url
        celery_app.app.conf.task_default_queue = self.queue
        self.tasks = celery_app

    def worker(self, concurrency: int = 2, **extra_env: str) -> Worker:
        w = Worker({**self.env, **extra_env}, f"dj-{self.db}-{len(self.workers)}",
                   concurrency=concurrency, app=APP, extra=("-Q", self.queue))
        self.workers.append(w)
        return w

    def send(self, task: Any, *args: Any) -> str:
        return str(task.apply_async(args, queue=self.queue).id)

    def results(self, ids: list[str]) -> dict[str, Any]:
        """The django-celery-results rows of ``ids`` that are final (id -> decoded result)."""
        import json

        from django_celery_results.models import TaskResult

        rows = TaskResult.objects.using(self.alias).filter(task_id__in=ids, status="SUCCESS")
        return {r.task_id: json.loads(r.result) for r in rows}

    def wait_results(self, ids: list[str], timeout: float = 120) -> dict[str, Any]:
        # A bound, not a timing: two Django workers starting while other test files run beside
        # this one (pytest-xdist) can take most of a minute before the first copy is delivered.
        return wait_for(lambda: (lambda got: got if len(got) == len(set(ids)) else None)(self.results(ids)),
                        timeout=timeout, what=f"{len(set(ids))} results in {self.db}")

    def orders(self, action: str) -> list[Any]:
        from tests.django.shop.models import Order

        return list(Order.objects.using(self.alias).filter(action=action).order_by("id"))

    def close(self) -> None:
        for w in self.workers:
            w.kill()
        from django.db import connections

        connections[self.alias].close()


@pytest.fixture(scope="module")
def broker() -> Iterator[RedisServer]:
    server = RedisServer()
    yield server
    server.cleanup()


@pytest.fixture(params=list(DATABASES))
def env(request: pytest.FixtureRequest, django_databases: Any, broker: RedisServer) -> Iterator[Env]:  # noqa: F811
    e = Env(request.param, broker)
    yield e
    e.close()


def test_concurrent_duplicates_run_one_body(env: Env, tmp_path: Path) -> None:
    # Given two workers (2 processes each) and six copies of one action sent at once
    env.worker(concurrency=2)
    env.worker(concurrency=2)
    marker = tmp_path / "bodies"
    action = f"a-{uuid.uuid4().hex[:6]}"
    ids = [env.send(env.tasks.busy_charge, action, str(marker), 1.0) for _ in range(6)]
    # Then every copy gets the one body's result, and the body ran once
    results = env.wait_results(ids)
    assert len(marker.read_text().splitlines()) == 1
    orders = env.orders(action)
    assert len(orders) == 1
    assert all(r["task_id"] == orders[0].task_id for r in results.values())


@pytest.mark.crash
def test_sigkill_after_the_orm_commit_leaves_one_row_and_the_redelivery_answers_from_the_receipt(
    env: Env,
) -> None:
    # Given a worker whose first attempt of each action dies right after its COMMIT
    env.worker(concurrency=2, DJ_KILL_AFTER_COMMIT="1")
    actions = [f"k-{uuid.uuid4().hex[:6]}" for _ in range(3)]
    ids = [env.send(env.tasks.charge, a, 10) for a in actions]
    # Then each message comes back, finds the receipt and returns the committed attempt's row
    results = env.wait_results(ids, timeout=90)
    for action, task_id in zip(actions, ids, strict=True):
        orders = env.orders(action)
        assert len(orders) == 1, f"{action}: {len(orders)} order rows"
        assert results[task_id]["pid"] == orders[0].pid  # the killed attempt's row and result
    text = "".join(w.text() for w in env.workers)
    assert text.count("receipt key=") >= len(actions)


@pytest.mark.crash
def test_a_holder_killed_mid_body_is_taken_over_with_a_higher_token(env: Env, tmp_path: Path) -> None:
    # Given a body that is held (no commit yet) in a worker child
    env.worker(concurrency=1)
    marker = tmp_path / "held"
    action = f"h-{uuid.uuid4().hex[:6]}"
    task_id = env.send(env.tasks.held_charge, action, str(marker))
    first = wait_for(lambda: marker.exists() and marker.read_text().split(), timeout=60,
                     what="the body to start")
    # When the child is SIGKILLed mid-body
    os.kill(int(first[0]), signal.SIGKILL)
    # Then the redelivery waits out the lease, takes over with a higher token and commits once
    result = env.wait_results([task_id], timeout=90)[task_id]
    lines = [line.split() for line in marker.read_text().splitlines()]
    assert len(lines) == 2 and int(lines[1][1]) > int(lines[0][1])
    assert result["token"] == int(lines[1][1]) and result["pid"] != int(first[0])
    assert len(env.orders(action)) == 1


@pytest.mark.parametrize("db", list(DATABASES))
def test_migrate_creates_the_tables_from_an_empty_database(db: str, tmp_path: Path) -> None:
    from tests.django.support import _admin_sql

    state = configure()
    environ = {**os.environ, **worker_env(db), "PYTHONPATH": str(ROOT)}
    name = f"celery_idem_django_test_{uuid.uuid4().hex[:10]}"
    if db == "pg":
        _admin_sql(f'CREATE DATABASE "{name}"')
        environ["CELERY_IDEM_DJANGO_PG"] = name
    else:
        environ["CELERY_IDEM_DJANGO_SQLITE"] = str(tmp_path / "empty.sqlite3")
    try:
        run = subprocess.run([sys.executable, "-m", "django", "migrate", "celery_idem", "-v", "1"],
                             cwd=ROOT, env=environ, capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr
        assert "Applying celery_idem.0001_initial... OK" in run.stdout
        check = (
            "from django.db import connection\n"
            "names = connection.introspection.table_names()\n"
            "print(sorted(t for t in names if t.startswith('celery_idem')))\n"
            "from celery_idem.contrib.django.store import DjangoStore\n"
            "s = DjangoStore(prefix='m:')\n"
            "c = s.claim('k', owner='o', task_id='t', attempt=0, lease=5, ttl=60)\n"
            "print(c.status.value)\n"
        )
        out = subprocess.run([sys.executable, "-c", "import django; django.setup()\n" + check], cwd=ROOT,
                             env=environ, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert out.stdout.split("\n")[:2] == [
            "['celery_idem_receipts', 'celery_idem_records', 'celery_idem_records_intents', "
            "'celery_idem_records_watermarks']", "claimed"]
    finally:
        if db == "pg":
            _admin_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    assert state
