"""Fixtures for driving the real ``celery -A tests.integration.app idem`` command.

Each test gets its own key prefix (and queue), on a real Redis or a real PostgreSQL store; the
command runs in a subprocess, exactly as an operator runs it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from celery_idem.codec import KombuCodec, encode_error
from celery_idem.records import State
from celery_idem.stores import store_from_url
from celery_idem.stores.base import Store
from tests.integration.conftest import cluster, make_cluster  # noqa: F401 (fixtures)
from tests.integration.harness import ROOT

LONG = 600.0


class Idem:
    """The command, its environment and a store client on the same prefix."""

    def __init__(self, env: dict[str, str], store: Store) -> None:
        self.env = env
        self.store = store
        self.prefix = env["IDEM_PREFIX"]

    def run(self, *args: str, input: str | None = None, env: dict[str, str] | None = None,
            timeout: float = 60, app: str = "tests.integration.app") -> subprocess.CompletedProcess[str]:
        """Run ``celery -A APP idem ARGS`` and return its outcome (``app``: tests.cli.cli_app
        for the settings it takes from the environment)."""
        return subprocess.run(
            [sys.executable, "-m", "celery", "-A", app, "idem", *args],
            cwd=ROOT, env={**os.environ, **self.env, **(env or {})}, input=input,
            capture_output=True, text=True, timeout=timeout,
        )

    def json(self, *args: str) -> Any:
        out = self.run(*args, "--json")
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    # -- records made directly through the store verbs ----------------------------------------

    def claim(self, key: str, *, task_id: str = "task-a", owner: str = "host-a:1",
              lease: float = LONG) -> int:
        got = self.store.claim(key, owner=owner, task_id=task_id, attempt=0, lease=lease, ttl=LONG)
        assert got.status.holds, got
        return got.token

    def done(self, key: str, value: Any, *, task_id: str = "task-a") -> int:
        token = self.claim(key, task_id=task_id)
        ctype, data = KombuCodec("json").encode_result(value)
        self.store.record(key, token, state=State.DONE, content_type=ctype, data=data, ttl=LONG)
        return token

    def failed(self, key: str, error: BaseException, *, task_id: str = "task-a") -> int:
        token = self.claim(key, task_id=task_id)
        ctype, data = encode_error(error)
        self.store.record(key, token, state=State.FAILED, content_type=ctype, data=data, ttl=LONG)
        return token


def _delete_prefix(url: str, store: Store, prefix: str) -> None:
    if url.startswith("redis"):
        client = store.client  # type: ignore[attr-defined]
        for name in client.scan_iter(match=prefix + "*", count=1000):
            client.delete(name)
    else:
        import sqlalchemy as sa

        table = store._table  # type: ignore[attr-defined]
        with store._engine.begin() as conn:  # type: ignore[attr-defined]
            conn.execute(sa.delete(table).where(table.c.key.startswith(prefix, autoescape=True)))


@pytest.fixture(params=["redis", "postgresql"])
def store_url(request: pytest.FixtureRequest) -> str:
    if request.param == "redis":
        return str(request.getfixturevalue("redis_url"))
    return "db+" + str(request.getfixturevalue("pg_url"))


def _idem(store_url: str, redis_url: str) -> Iterator[Idem]:
    tag = uuid.uuid4().hex[:10]
    env = {
        "IDEM_BROKER": redis_url,
        "IDEM_BACKEND": redis_url,
        "IDEM_STORE": store_url,
        "IDEM_PREFIX": f"clitest-{tag}:",
        "IDEM_QUEUE": f"clitest-{tag}",
        "IDEM_LEDGER": redis_url,
    }
    store = store_from_url(store_url, prefix=env["IDEM_PREFIX"])
    try:
        yield Idem(env, store)
    finally:
        _delete_prefix(store_url, store, env["IDEM_PREFIX"])
        store.close()


@pytest.fixture
def idem(store_url: str, redis_url: str) -> Iterator[Idem]:
    """The command on a fresh prefix of each real store (Redis, PostgreSQL)."""
    yield from _idem(store_url, redis_url)


@pytest.fixture
def idem_redis(redis_url: str) -> Iterator[Idem]:
    """The command on a fresh Redis prefix (for what does not depend on the store)."""
    yield from _idem(redis_url, redis_url)
