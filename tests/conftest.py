"""Shared fixtures: real servers, one key prefix / database table per test, never FLUSHALL.

Servers: Redis at ``CELERY_IDEM_TEST_REDIS`` (default redis://127.0.0.1:6379), PostgreSQL at
``CELERY_IDEM_TEST_PG`` (default postgresql+psycopg://root@127.0.0.1:5432/test), MariaDB at
``CELERY_IDEM_TEST_MYSQL`` and RabbitMQ at ``CELERY_IDEM_TEST_AMQP`` (default
amqp://guest:guest@127.0.0.1:5672//). A server that does not answer skips its tests locally and FAILS
them in CI (``CI=true``), so CI can never pass by skipping.

Markers (registered, and enforced by ``--strict-markers``, in pyproject.toml): a test that needs a
server is marked ``server`` so that ``make test-fast`` can leave it out instead of skipping it. The
mark comes from the fixtures the test uses (``SERVER_FIXTURES``, added below at collection) or, for
a fixture parametrized over store kinds, from :func:`store_kinds`.
"""

from __future__ import annotations

import os
import socket
import sys
import uuid
from collections.abc import Iterable, Iterator
from typing import Any
from urllib.parse import urlsplit

import pytest

REDIS_URL = os.environ.get("CELERY_IDEM_TEST_REDIS", "redis://127.0.0.1:6379")
PG_URL = os.environ.get("CELERY_IDEM_TEST_PG", "postgresql+psycopg://root@127.0.0.1:5432/test")
MYSQL_URL = os.environ.get("CELERY_IDEM_TEST_MYSQL", "mysql+pymysql://root@127.0.0.1:3306/test")
AMQP_URL = os.environ.get("CELERY_IDEM_TEST_AMQP", "amqp://guest:guest@127.0.0.1:5672//")
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")

def _backport_celery_10477() -> None:
    """Keep the test process out of Celery < 5.7's result-consumer deadlock (celery#10477).

    On Celery 5.4-5.6 with a Redis result backend, the garbage collector can finalise an
    ``AsyncResult`` while the same thread holds redis-py's ``PubSub`` lock (mid-SUBSCRIBE in
    ``apply_async`` or in ``add_pending_result``); its ``__del__`` sends UNSUBSCRIBE, waits for
    that lock and hangs forever. Plain Celery hangs the same way; ``make test-compat`` on 5.4.0
    met it twice (a chain's ``apply_async``, a ``ResultSet``'s ``add_pending_result``). Celery 5.7
    defers the nested UNSUBSCRIBE. This does what that fix does for the case that hangs: a
    cancel that finds the lock taken leaves the subscription (a message on it is buffered like
    any other), and a key already unsubscribed is not unsubscribed again (celery#10497). Only
    the test process is patched, never the library; docs/compat.md tells users on Celery < 5.7.
    """
    try:
        from celery.backends.redis import ResultConsumer
    except ImportError:  # pragma: no cover - no redis-py
        return
    if hasattr(ResultConsumer, "_flush_pending_unsubscribe"):  # Celery 5.7: fixed upstream
        return
    original = ResultConsumer.cancel_for

    def cancel_for(self: Any, task_id: str) -> None:
        if self._get_key_for_task(task_id) not in self.subscribed_to:
            return
        lock = getattr(self._pubsub, "_lock", None)
        if lock is not None:
            if not lock.acquire(blocking=False):
                return  # held, by this thread when the collector runs us: waiting would hang
            lock.release()
        original(self, task_id)

    ResultConsumer.cancel_for = cancel_for  # type: ignore[method-assign]


_backport_celery_10477()


# Fixtures that reach a server: the shared ones below, and the private redis-servers some store
# tests start (tests/stores). A test using one, directly or through another fixture, is marked
# `server` at collection. A fixture that picks its server at run time (getfixturevalue) cannot be
# seen here: its parameters carry the mark instead (store_kinds).
SERVER_FIXTURES = frozenset({
    "redis_url", "pg_url", "mysql_url", "amqp_url", "private_server", "servers",
})
# Store kinds that run inside the test process (no server): every other kind gets `server`.
IN_PROCESS_STORES = frozenset({"memory", "sqlite"})
# Store kinds whose code uses no Celery, kombu or redis-py, the libraries a compat venv changes:
# their runs are marked `celery_independent` (see the marker in pyproject.toml).
CELERY_INDEPENDENT_STORES = frozenset({"memory", "sqlite", "postgresql", "mysql"})


def store_kinds(*kinds: str) -> list[Any]:
    """Parameters for a fixture over store kinds, marked ``server`` and ``celery_independent``
    as the kind is (see ``IN_PROCESS_STORES`` and ``CELERY_INDEPENDENT_STORES``)."""
    params = []
    for kind in kinds:
        marks = []
        if kind not in IN_PROCESS_STORES:
            marks.append(pytest.mark.server)
        if kind in CELERY_INDEPENDENT_STORES:
            marks.append(pytest.mark.celery_independent)
        params.append(pytest.param(kind, marks=marks, id=kind))
    return params


def pytest_collection_modifyitems(items: Iterable[pytest.Item]) -> None:
    """Mark ``server`` every test whose fixtures reach a server (see SERVER_FIXTURES)."""
    for item in items:
        if SERVER_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.server)


def _answers(url: str, default_port: int) -> bool:
    parts = urlsplit(url)
    try:
        with socket.create_connection((parts.hostname or "127.0.0.1", parts.port or default_port), 1):
            return True
    except OSError:
        return False


def require(url: str, default_port: int, what: str) -> None:
    """Skip (locally) or fail (CI) when a server the test needs does not answer."""
    if not _answers(url, default_port):
        message = f"{what} at {url} does not answer"
        if IN_CI:
            pytest.fail(message + " (CI must run every test; .ci/run starts the servers)")
        pytest.skip(message)


@pytest.fixture(autouse=True)
def _tasks_stay_in_their_test() -> Iterator[None]:
    """Drop the app-finalize callbacks a test's own task definitions left behind.

    ``app.task()`` is ``shared=True`` by default: Celery keeps a callback that adds the task to
    every app finalized afterwards, in this process, for good. A task a test defines in its own
    body (``<locals>`` in its qualified name) would then land in every later test's app; two such
    tests using one name give Celery 5.7's ``DuplicateTaskNameWarning`` in an unrelated test
    (an error here: filterwarnings). Module-level tasks stay: their module is imported once,
    and the apps of later tests may rely on them.
    """
    from celery import _state

    before = set(_state._on_app_finalizers)
    yield
    for callback in set(_state._on_app_finalizers) - before:
        cells = getattr(callback, "__closure__", None) or ()
        funs = [c.cell_contents for c in cells if callable(getattr(c, "cell_contents", None))]
        if any("<locals>" in getattr(f, "__qualname__", "") for f in funs):
            _state._on_app_finalizers.discard(callback)


@pytest.fixture(autouse=True)
def _current_app_stays() -> Iterator[None]:
    """Give the next test the current Celery app this one started with.

    ``Celery(...)`` makes itself the process's current app unless ``set_as_current=False``, and
    a handle made without ``app=`` (``AsyncResult(id)``, ``GroupResult(...)``) uses the current
    app's result backend. An app a test built for a server it then stopped would otherwise serve
    the next test file in this process (with pytest-xdist, whichever file comes next), on a port
    that may belong to another server by then.
    """
    from celery import _state

    current = getattr(_state._tls, "current_app", None)
    yield
    if getattr(_state._tls, "current_app", None) is not current:
        _state._set_current_app(current)


@pytest.fixture
def prefix() -> str:
    """A key prefix no other test (or app) uses."""
    return f"test-{uuid.uuid4().hex[:12]}:"


@pytest.fixture
def redis_url() -> str:
    require(REDIS_URL, 6379, "Redis")
    return REDIS_URL.rstrip("/") + "/0"


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[object]:
    import redis

    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


@pytest.fixture
def redis_cleanup(redis_client: object, prefix: str) -> Iterator[None]:
    """Delete this test's keys afterwards (by prefix, never FLUSHALL)."""
    yield
    for name in redis_client.scan_iter(match=prefix + "*", count=1000):  # type: ignore[attr-defined]
        redis_client.delete(name)  # type: ignore[attr-defined]


@pytest.fixture
def pg_url() -> str:
    require(PG_URL, 5432, "PostgreSQL")
    return PG_URL


@pytest.fixture
def mysql_url() -> str:
    require(MYSQL_URL, 3306, "MariaDB")
    return MYSQL_URL


@pytest.fixture
def amqp_url() -> str:
    require(AMQP_URL, 5672, "RabbitMQ")
    return AMQP_URL


@pytest.fixture
def published(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The task ids this process publishes while the test runs.

    Counted where kombu's producer hands a message to its transport, not by a publish signal:
    a ``before_task_publish`` or ``after_task_publish`` receiver makes every enqueue check read
    the record first (celery_idem.enqueue_redis.WithinPublish), so the tests would never see
    the check made within the publish. A message the check within the publish did not push
    (the record answered the enqueue) is not counted.
    """
    ids: list[str] = []
    from kombu import Producer

    publish = Producer._publish

    def counted(self: Any, body: Any, priority: Any, content_type: Any,
                content_encoding: Any, headers: Any, *args: Any, **kwargs: Any) -> Any:
        sent = publish(self, body, priority, content_type, content_encoding, headers, *args,
                       **kwargs)
        fused = sys.modules.get("celery_idem.enqueue_redis")  # not imported with the switch off
        pending = fused._PENDING.get() if fused is not None else None
        if pending is None or pending.found is None:
            ids.append((headers or {}).get("id", ""))
        return sent

    monkeypatch.setattr(Producer, "_publish", counted)
    return ids
