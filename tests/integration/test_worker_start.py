"""What a worker says at start, through Celery's logging, and what it refuses.

Real ``celery worker`` processes, private ``redis-server``s (the shared Redis is never
reconfigured), the shared PostgreSQL and MariaDB with database names that do not exist.

* The durability warning reaches ``--logfile`` with a level and a timestamp, once per worker.
* A store that rejects the credentials or names a missing database stops the worker at start,
  naming the setting (``idempotency_store`` or ``result_backend``).
* At run time an unreachable store's re-queues are logged at WARNING with their delay, and a
  store that rejects the worker (a password changed) at ERROR with the cause.
* A gevent worker on a Redis broker warns that it does not restore unacked messages.
"""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests.integration.harness import RedisServer, Worker, wait_for

ROOT = Path(__file__).resolve().parents[2]
APP = "tests.integration.start_app"
# Celery's worker log format: "[2026-12-05 10:00:00,123: WARNING/MainProcess] message"
STAMPED = re.compile(r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}: (\w+)/\w+\] (.*)$")


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


def start_with_password(servers: list[RedisServer], password: str) -> RedisServer:
    # Set after start: the harness checks that the server is up without a password.
    server = start(servers)
    admin = redis.Redis(port=server.port)
    admin.config_set("requirepass", password)
    admin.close()
    return server


def env_for(broker: str, store: str | None = None, backend: str | None = None,
            **more: str) -> dict[str, str]:
    env = {"IDEM_BROKER": broker, "IDEM_QUEUE": f"idem-start-{uuid.uuid4().hex[:8]}",
           "IDEM_PREFIX": f"start-{uuid.uuid4().hex[:8]}:", "PYTHONPATH": str(ROOT), **more}
    if store:
        env["IDEM_STORE"] = store
    if backend:
        env["IDEM_BACKEND"] = backend
    return env


def refused(env: dict[str, str], tmp_path: Path) -> str:
    """Start a worker that must refuse to start; its output."""
    log = tmp_path / "refused.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", APP, "worker", "-P", "solo", "-l", "INFO",
             "--without-heartbeat", "--without-gossip", "--without-mingle"],
            cwd=ROOT, env={**os.environ, **env}, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True)
        try:
            code = proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
            pytest.fail(f"the worker started anyway:\n{log.read_text()[-3000:]}")
    text = log.read_text()
    assert code != 0, text
    assert "the worker cannot start" in text, text[-3000:]
    assert " ready." not in text  # it never consumed
    return text


def stamped(text: str, needle: str) -> list[tuple[str, str]]:
    """(level, message) of every line of Celery's log format containing ``needle``."""
    found = []
    for line in text.splitlines():
        match = STAMPED.match(line)
        if match and needle in match.group(2):
            found.append((match.group(1), match.group(2)))
    return found


# -- the durability warning goes through Celery's logging --------------------------------------


def test_the_durability_warning_is_in_the_logfile_with_level_and_timestamp_once(
    servers: list[RedisServer], tmp_path: Path
) -> None:
    server = start(servers, "--appendonly", "no")
    logfile = tmp_path / "worker.log"
    out = tmp_path / "stdout.log"
    with out.open("wb") as fh:
        proc = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", APP, "worker", "-P", "solo", "-l", "INFO",
             "--logfile", str(logfile), "--without-heartbeat", "--without-gossip",
             "--without-mingle"],
            cwd=ROOT, env={**os.environ, **env_for(server.url, server.url, server.url)},
            stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_for(lambda: logfile.exists() and " ready." in logfile.read_text(), timeout=60,
                     what="the worker to be ready (in its logfile)")
            text = logfile.read_text()
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
    stdout = out.read_text()
    lines = stamped(text, "can lose records")
    assert len(lines) == 1, text[-3000:]
    level, message = lines[0]
    assert level == "WARNING" and "appendonly no" in message
    # logged in order, before the worker consumed: the line precedes "ready."
    assert text.index("can lose records") < text.index(" ready.")
    # and not on stderr without a format (Python's last-resort handler)
    assert "can lose records" not in stdout, stdout


def test_a_durable_store_logs_no_warning_and_the_refusal_still_stops_the_worker(
    servers: list[RedisServer], tmp_path: Path
) -> None:
    server = start(servers, "--appendonly", "no")
    text = refused(env_for(server.url, server.url, server.url, IDEM_REQUIRE="1"), tmp_path)
    assert "appendonly no" in text


# -- configuration mistakes fail loudly at start --------------------------------------------------


def test_a_wrong_redis_password_in_idempotency_store_stops_the_worker(
    servers: list[RedisServer], tmp_path: Path
) -> None:
    server = start_with_password(servers, "secret")
    broker = f"redis://:secret@127.0.0.1:{server.port}/0"
    store = f"redis://:wrong@127.0.0.1:{server.port}/1"
    text = refused(env_for(broker, store, broker), tmp_path)
    assert "idempotency_store" in text and "authentication failed" in text, text[-3000:]
    # Said once, in sentences that end once
    assert text.count("rejected the credentials") == 1 and ".." not in text, text[-3000:]
    assert "wrong" not in text.split("cannot start")[-1].split("idempotency_store")[0]


def test_a_misspelt_app_setting_stops_the_worker_saying_so_once(
    servers: list[RedisServer], tmp_path: Path
) -> None:
    server = start(servers)
    text = refused(env_for(server.url, server.url, server.url, IDEM_MISSPELT=server.url),
                   tmp_path)
    assert "Did you mean 'idempotency_store'?" in text, text[-3000:]
    assert text.count("unknown app setting 'idempotency_stroe'") == 1, text[-3000:]


def test_a_missing_redis_password_in_result_backend_names_result_backend(
    servers: list[RedisServer], tmp_path: Path
) -> None:
    server = start_with_password(servers, "secret")
    broker = f"redis://:secret@127.0.0.1:{server.port}/0"
    text = refused(env_for(broker, None, f"redis://127.0.0.1:{server.port}/1"), tmp_path)
    assert "result_backend" in text and "authentication failed" in text, text[-3000:]


@pytest.mark.parametrize(("url", "setting", "reason"), [
    ("db+mysql+pymysql://root@127.0.0.1/celery_idem_no_such_db", "idempotency_store",
     "has no such database"),  # MariaDB error 1049
    ("db+mysql+pymysql://root:wrong@127.0.0.1/test", "idempotency_store",
     "authentication failed"),  # MariaDB error 1045
    ("db+postgresql+psycopg://root@127.0.0.1/celery_idem_no_such_db", "result_backend",
     "has no such database"),  # PostgreSQL "database does not exist"
    ("db+postgresql+psycopg://celery_idem_no_such_role@127.0.0.1/test", "result_backend",
     "authentication failed"),  # trust auth here: an unknown role is the credential mistake
])
def test_a_sql_store_that_rejects_the_worker_stops_it_naming_the_setting(
    servers: list[RedisServer], tmp_path: Path, url: str, setting: str, reason: str
) -> None:
    broker = start(servers).url
    # The store is the result backend's unless idempotency_store names it.
    env = env_for(broker, url, broker) if setting == "idempotency_store" else env_for(broker, None, url)
    text = refused(env, tmp_path)
    assert setting in text and reason in text, text[-3000:]


# -- at run time: outage at WARNING with the delay, a mistake at ERROR with the cause --------------


def test_run_time_store_errors_are_warning_for_an_outage_and_error_for_a_rejection(
    servers: list[RedisServer], tmp_path: Path
) -> None:
    broker = start(servers)
    store = start_with_password(servers, "secret")
    store_url = f"redis://:secret@127.0.0.1:{store.port}/0"
    env = env_for(broker.url, store_url, broker.url)
    worker = Worker(env, "runtime", pool="solo", concurrency=1, app=APP)
    try:
        from celery import Celery

        client = Celery("start-client", broker=broker.url, backend=broker.url,
                        set_as_current=False)
        admin = redis.Redis(port=store.port, password="secret")
        # A password changed under a running worker: its new connections are rejected.
        admin.config_set("requirepass", "changed")
        admin.close()
        redis.Redis(port=store.port, password="changed").execute_command(
            "CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
        client.send_task("tests.integration.start_app.noop", args=(1,),
                         queue=env["IDEM_QUEUE"])
        wait_for(lambda: stamped(worker.text(), "rejected the credentials"), timeout=30,
                 what="the ERROR line")
        [(level, message), *_] = stamped(worker.text(), "rejected the credentials")
        assert level == "ERROR" and "re-queued in" in message and "password" in message
        # Now an outage: the store's server is gone.
        store.stop()
        client.send_task("tests.integration.start_app.noop", args=(2,),
                         queue=env["IDEM_QUEUE"])
        wait_for(lambda: stamped(worker.text(), "store unavailable"), timeout=30,
                 what="the WARNING line")
        [(level, message), *_] = stamped(worker.text(), "store unavailable")
        assert level == "WARNING" and "re-queued in" in message and "up to 30 s" in message
        client.close()
    finally:
        worker.stop()


# -- gevent and eventlet on a Redis broker -------------------------------------------------------


@pytest.mark.skipif(importlib.util.find_spec("gevent") is None, reason="gevent not installed")
def test_a_gevent_worker_on_a_redis_broker_warns_that_it_does_not_restore_unacked(
    servers: list[RedisServer], tmp_path: Path
) -> None:
    server = start(servers, "--appendonly", "yes", "--maxmemory-policy", "noeviction")
    worker = Worker(env_for(server.url, server.url, server.url), "gevent", pool="gevent",
                    concurrency=4, app=APP)
    try:
        text = worker.text()
    finally:
        worker.stop()
    [(level, message)] = stamped(text, "does not restore unacked messages")
    assert level == "WARNING" and "pool gevent" in message
    assert "prefork" in message and "RabbitMQ" in message and "start" in message


def test_a_prefork_worker_does_not_warn_about_unacked_messages(
    servers: list[RedisServer], tmp_path: Path
) -> None:
    server = start(servers, "--appendonly", "yes", "--maxmemory-policy", "noeviction")
    worker = Worker(env_for(server.url, server.url, server.url), "prefork", pool="prefork",
                    concurrency=1, app=APP)
    try:
        text = worker.text()
    finally:
        worker.stop()
    assert "does not restore unacked" not in text
    assert "can lose records" not in text
