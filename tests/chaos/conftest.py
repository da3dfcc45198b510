"""Fixtures of the chaos suite.

Every stack has its own private ``redis-server`` (broker and result backend) and its own key
prefix, queue and PostgreSQL ledger tables. The shared Redis at 6379 is never touched.

``stack`` is parametrized over the two stores (``redis``: a private ``redis-server`` behind a
:class:`~tests.chaos.support.TcpProxy`; ``sql``: PostgreSQL, a table of its own). Its two
workers are started once per session and shared by the tests that only kill worker children
(prefork replaces a killed child); tests that restart servers or need other worker settings
build their own stack with ``make_stack``.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urlsplit

import pytest

from tests.chaos.support import ChaosRedis, Ledger, Stack, TcpProxy, libpq_url
from tests.conftest import PG_URL, require


class RedisStack(Stack):
    """A stack whose store is a private Redis reached through a fault-injecting proxy."""

    store_server: ChaosRedis
    proxy: TcpProxy


class SqlStack(Stack):
    """A stack whose store is a PostgreSQL table of its own, reached through a proxy."""

    table: str
    application_name: str
    proxy: TcpProxy


@pytest.fixture(scope="session")
def pg_ledger_url() -> str:
    require(PG_URL, 5432, "PostgreSQL")
    return libpq_url(PG_URL)


def build_redis_stack(pg_url: str, *, env: dict[str, str] | None = None,
                      store_args: tuple[str, ...] = (), store_server: ChaosRedis | None = None,
                      user: str = "", password: str = "",
                      broker_args: tuple[str, ...] = ()) -> RedisStack:
    broker = ChaosRedis(*broker_args)
    store_server = store_server or ChaosRedis(*store_args)
    proxy = TcpProxy(store_server.port)
    # The workers reach the store through the proxy (TLS passes through it untouched).
    store_url = store_server.url_for(user, password).replace(
        f"127.0.0.1:{store_server.port}/", f"127.0.0.1:{proxy.port}/")
    stack = RedisStack(broker, store_url, Ledger(pg_url), env=env, name="redis")
    stack.store_server = store_server
    stack.proxy = proxy
    return stack


def build_sql_stack(pg_url: str, *, env: dict[str, str] | None = None) -> SqlStack:
    broker = ChaosRedis()
    table = f"chaos_{uuid.uuid4().hex[:10]}_records"
    application_name = f"idem-{table}"
    where = urlsplit(PG_URL)
    proxy = TcpProxy(where.port or 5432, where.hostname or "127.0.0.1")
    auth = where.netloc.rsplit("@", 1)[0] + "@" if "@" in where.netloc else ""
    store_url = (f"db+postgresql+psycopg://{auth}127.0.0.1:{proxy.port}{where.path}"
                 f"?application_name={application_name}")
    stack = SqlStack(broker, store_url, Ledger(pg_url), env=env, name="sql",
                     store_options={"table_name": table})
    stack.table = table
    stack.application_name = application_name
    stack.proxy = proxy
    return stack


def close_stack(stack: Stack) -> None:
    stack.close()
    if isinstance(stack, SqlStack):
        stack.ledger.conn.execute(f"DROP TABLE IF EXISTS {stack.table}")
    stack.ledger.drop()
    stack.broker.cleanup()
    stack.proxy.close()  # type: ignore[attr-defined]
    if isinstance(stack, RedisStack):
        stack.store_server.cleanup()


@pytest.fixture(scope="session")
def redis_stack(pg_ledger_url: str) -> Iterator[RedisStack]:
    stack = build_redis_stack(pg_ledger_url)
    try:
        stack.worker("a")
        stack.worker("b")
        yield stack
    finally:
        close_stack(stack)


@pytest.fixture(scope="session")
def sql_stack(pg_ledger_url: str) -> Iterator[SqlStack]:
    stack = build_sql_stack(pg_ledger_url)
    try:
        stack.worker("a")
        stack.worker("b")
        yield stack
    finally:
        close_stack(stack)


@pytest.fixture(params=["redis", "sql"])
def stack(request: pytest.FixtureRequest) -> Iterator[Stack]:
    """The shared two-worker stack of one store, pointed at by the test process."""
    shared: Stack = request.getfixturevalue(f"{request.param}_stack")
    with shared.active():
        yield shared


@pytest.fixture
def make_stack(pg_ledger_url: str) -> Iterator[Callable[..., Any]]:
    """Build a stack for one test (closed afterwards): ``make_stack("redis", env=...)``."""
    made: list[Stack] = []

    def make(kind: str, **kwargs: Any) -> Any:
        build = build_redis_stack if kind == "redis" else build_sql_stack
        stack = build(pg_ledger_url, **kwargs)
        made.append(stack)
        stack.activate()
        return stack

    yield make
    for stack in reversed(made):
        stack.deactivate()
        close_stack(stack)


@pytest.fixture
def action() -> Callable[[str], str]:
    """Unique action names for this test: ``action("dup")`` -> ``"1a2b3c4d-dup"``; every name
    of one test starts with ``action("")``."""
    run = uuid.uuid4().hex[:8]
    return lambda name: f"{run}-{name}"
