"""The durability check at worker start: does the store's Redis keep records?

Each test starts a ``redis-server`` of its own with the settings under test (the shared Redis is
never reconfigured). The worker-start hook (``celery_idem.app.check_worker``, Celery's ``worker_init``) reads
``appendonly``, ``appendfsync`` and ``maxmemory-policy`` and logs one WARNING naming the risk; with
``idempotency_require_durable_store = True`` the worker refuses to start (checked with a real
``celery worker`` process); a server that refuses ``CONFIG`` gets one INFO line.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import redis
from celery import Celery

from celery_idem import IdempotentTask
from celery_idem.app import check_worker
from celery_idem.stores.redis import RedisStore
from tests.integration.harness import RedisServer

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def servers() -> Iterator[list[RedisServer]]:
    started: list[RedisServer] = []
    yield started
    for server in started:
        server.cleanup()


def start(servers: list[RedisServer], *settings: str) -> RedisServer:
    server = RedisServer(settings=settings)
    servers.append(server)
    return server


def worker_start(
    url: str, caplog: pytest.LogCaptureFixture, *, require: bool = False
) -> list[logging.LogRecord]:
    """Run the worker-start hook for an app whose store is ``url``; its celery_idem log lines."""
    app = Celery("durability-test", set_as_current=False)
    app.conf.update(idempotency_store=url, idempotency_require_durable_store=require)

    @app.task(base=IdempotentTask, bind=True, shared=False)
    def noop(self: Any, n: int) -> int:
        return n

    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="celery_idem"):
        try:
            check_worker(sender=SimpleNamespace(app=app, task_events=False))
        finally:
            from celery_idem.task import get_store

            get_store(app).close()
    # Only the durability check's lines: the worker-start hook also checks time limits, and
    # other test modules' tasks may be registered with a limit that it warns about.
    return [r for r in caplog.records if r.name == "celery_idem" and r.levelno >= logging.INFO
            and r.filename == "durability.py"]


def test_a_redis_without_aof_gets_one_warning_naming_appendonly(
    servers: list[RedisServer], caplog: pytest.LogCaptureFixture
) -> None:
    server = start(servers, "--appendonly", "no")
    [line] = worker_start(server.url, caplog)
    assert line.levelno == logging.WARNING
    message = line.getMessage()
    assert "appendonly no" in message and "restart" in message
    assert f"127.0.0.1:{server.port}" in message
    assert "idempotency_require_durable_store" in message


def test_a_durable_redis_gets_no_warning(
    servers: list[RedisServer], caplog: pytest.LogCaptureFixture
) -> None:
    server = start(servers, "--appendonly", "yes", "--appendfsync", "everysec",
                   "--maxmemory-policy", "noeviction")
    assert worker_start(server.url, caplog) == []
    assert worker_start(server.url, caplog, require=True) == []  # and the option lets it start


@pytest.mark.parametrize("policy", ["allkeys-lru", "volatile-ttl", "volatile-lru"])
def test_an_evicting_maxmemory_policy_is_a_warning_volatile_ones_included(
    servers: list[RedisServer], caplog: pytest.LogCaptureFixture, policy: str
) -> None:
    # volatile-* evicts keys with a TTL, and every record has one
    server = start(servers, "--appendonly", "yes", "--maxmemory", "100mb",
                   "--maxmemory-policy", policy)
    [line] = worker_start(server.url, caplog)
    assert line.levelno == logging.WARNING
    assert f"maxmemory-policy {policy}" in line.getMessage()
    assert "appendonly" not in line.getMessage().split("Fix:")[0]


def test_appendfsync_no_is_a_weaker_setting_and_warned_about(
    servers: list[RedisServer], caplog: pytest.LogCaptureFixture
) -> None:
    server = start(servers, "--appendonly", "yes", "--appendfsync", "no")
    [line] = worker_start(server.url, caplog)
    assert line.levelno == logging.WARNING and "appendfsync no" in line.getMessage()


def test_every_risk_goes_into_one_warning(
    servers: list[RedisServer], caplog: pytest.LogCaptureFixture
) -> None:
    server = start(servers, "--appendonly", "no", "--maxmemory-policy", "allkeys-random")
    [line] = worker_start(server.url, caplog)
    assert "appendonly no" in line.getMessage()
    assert "maxmemory-policy allkeys-random" in line.getMessage()


def test_with_the_option_the_hook_refuses_naming_the_settings(
    servers: list[RedisServer], caplog: pytest.LogCaptureFixture
) -> None:
    server = start(servers, "--appendonly", "no", "--maxmemory-policy", "allkeys-lru")
    with pytest.raises(SystemExit) as info:
        worker_start(server.url, caplog, require=True)
    message = str(info.value)
    assert "cannot start" in message
    assert "appendonly no" in message and "maxmemory-policy allkeys-lru" in message
    assert "idempotency_require_durable_store" in message


@pytest.mark.parametrize("refusal", ["renamed", "acl"])
def test_a_redis_that_refuses_config_gets_one_info_line_not_an_error(
    servers: list[RedisServer], caplog: pytest.LogCaptureFixture, refusal: str
) -> None:
    if refusal == "renamed":  # what managed Redis services do
        server = start(servers, "--appendonly", "no", "--rename-command", "CONFIG", '""')
        url = server.url
    else:  # a least-privilege ACL user without +config
        server = start(servers, "--appendonly", "no")
        admin = redis.Redis(port=server.port)
        admin.execute_command("ACL", "SETUSER", "idem", "on", ">pw", "~*", "&*", "+@all",
                              "-config")
        admin.close()
        url = f"redis://idem:pw@127.0.0.1:{server.port}/0"
    store = RedisStore.from_url(url)
    try:
        with pytest.raises(redis.ResponseError):
            store.client.config_get("appendonly")  # the server does refuse CONFIG
    finally:
        store.close()
    [line] = worker_start(url, caplog)
    assert line.levelno == logging.INFO
    assert "CONFIG" in line.getMessage() and "not checked" in line.getMessage()
    # The option cannot verify such a store; it does not refuse it either (documented)
    [line] = worker_start(url, caplog, require=True)
    assert line.levelno == logging.INFO


def test_a_real_worker_with_the_option_does_not_start_on_a_redis_without_aof(
    servers: list[RedisServer], tmp_path: Path
) -> None:
    server = start(servers, "--appendonly", "no")
    env = {**os.environ, "IDEM_DURABILITY_STORE": server.url, "IDEM_REQUIRE_DURABLE": "1",
           "PYTHONPATH": str(ROOT)}
    log = tmp_path / "worker.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "tests.stores.durability_app", "worker",
             "--pool", "solo", "--loglevel", "INFO", "--without-heartbeat",
             "--without-gossip", "--without-mingle"],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
        )
        try:
            code = proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
            pytest.fail(f"the worker started anyway:\n{log.read_text()[-3000:]}")
    text = log.read_text()
    assert code != 0, text
    assert "the worker cannot start" in text and "appendonly no" in text, text[-3000:]
    assert "ready." not in text  # it never consumed
