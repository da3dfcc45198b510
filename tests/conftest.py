"""Shared fixtures: real servers, one key prefix / database table per test, never FLUSHALL.

Servers: Redis at ``CELERY_IDEM_TEST_REDIS`` (default redis://127.0.0.1:6379), PostgreSQL at
``CELERY_IDEM_TEST_PG`` (default postgresql+psycopg://root@127.0.0.1:5432/test), MariaDB at
``CELERY_IDEM_TEST_MYSQL`` and RabbitMQ at ``CELERY_IDEM_TEST_AMQP`` (default
amqp://guest:guest@127.0.0.1:5672//). A server that does not answer skips its tests locally and FAILS
them in CI (``CI=true``), so CI can never pass by skipping.
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest

REDIS_URL = os.environ.get("CELERY_IDEM_TEST_REDIS", "redis://127.0.0.1:6379")
PG_URL = os.environ.get("CELERY_IDEM_TEST_PG", "postgresql+psycopg://root@127.0.0.1:5432/test")
MYSQL_URL = os.environ.get("CELERY_IDEM_TEST_MYSQL", "mysql+pymysql://root@127.0.0.1:3306/test")
AMQP_URL = os.environ.get("CELERY_IDEM_TEST_AMQP", "amqp://guest:guest@127.0.0.1:5672//")
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


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
