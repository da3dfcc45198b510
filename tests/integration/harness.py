"""Real ``celery worker`` processes for the integration and crash tests.

Nothing here sleeps to synchronise: every wait polls a condition against a deadline.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def wait_for(predicate: Callable[[], Any], timeout: float = 30.0, interval: float = 0.05,
             what: str = "condition") -> Any:
    """Poll ``predicate`` until it returns a truthy value, or fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


def wait_subscribed(channel: Callable[[], Any], broker_url: str) -> None:
    """Wait until the kombu Redis channel ``channel()`` returns is subscribed to its fanout on the
    server of ``broker_url`` (:func:`fanout_subscribed`): events sent from then on reach it."""
    import redis

    server = redis.Redis.from_url(broker_url)
    try:
        wait_for(lambda: fanout_subscribed(channel(), server), timeout=30,
                 what="the event receiver's subscription")
    finally:
        server.close()


def fanout_subscribed(channel: Any, server: Any) -> bool:
    """Whether the Redis server has the pub/sub subscription of a kombu Redis ``channel``.

    An event receiver gets Celery's events through a fanout exchange, which kombu's Redis
    transport delivers by PUBLISH: only to a subscription in effect when an event is sent. Its
    queue's binding (``_kombu.binding.celeryev``) is stored, and ``on_consume_ready`` called,
    before kombu sends the PSUBSCRIBE, on its first poll. So neither says that an event sent
    now reaches the receiver; the server's client list (``psub`` of the connection kombu
    subscribed on, found by its address) does. ``server`` is a ``redis.Redis`` of that server.
    """
    conn = getattr(channel, "_in_listen", None)  # the connection kombu sent PSUBSCRIBE on
    sock = getattr(conn, "_sock", None)
    if sock is None:
        return False
    try:
        host, port = sock.getsockname()[:2]
    except OSError:  # closed meanwhile
        return False
    return any(c.get("addr") == f"{host}:{port}" and int(c.get("psub", 0)) > 0
               for c in server.client_list())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def drop_result_backend(app: Any) -> None:
    """Drop ``app``'s cached result backend, and cut its result consumer from its server.

    An ``AsyncResult`` that outlives its test still holds this backend, and its ``__del__``
    unsubscribes from its result channel: with the subscription connection left open, the
    collector would reconnect to the old port, which by then may belong to another server
    (under pytest-xdist, another worker's), and raise there, in whichever test it runs.
    """
    for backend in (app.__dict__.pop("backend", None), app._local.__dict__.pop("backend", None)):
        consumer = getattr(backend, "result_consumer", None)
        pubsub = getattr(consumer, "_pubsub", None)
        if pubsub is None:
            continue
        consumer.subscribed_to.clear()
        consumer._pubsub = None
        with contextlib.suppress(Exception):  # the server may be gone: nothing left to close
            pubsub.close()


def stop_group(proc: subprocess.Popen[Any]) -> None:
    """SIGTERM a process started in its own session, its children included; SIGKILL if it
    has not exited after 20 s (every wait bounded)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


class Worker:
    """One ``celery worker`` subprocess with its own log file."""

    def __init__(self, env: dict[str, str], name: str, pool: str = "prefork",
                 concurrency: int = 2, extra: tuple[str, ...] = (),
                 app: str = "tests.integration.app") -> None:
        self.env = env
        self.name = name
        self.log = Path(tempfile.mkstemp(prefix=f"celery-idem-{name}-", suffix=".log")[1])
        cmd = [
            sys.executable, "-m", "celery", "-A", app, "worker",
            "-P", pool, "-c", str(concurrency), "-n", f"{name}@%h", "-l", "INFO",
            "--without-gossip", "--without-mingle", "--without-heartbeat", "-E", *extra,
        ]
        self._fh = self.log.open("w")
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, env={**os.environ, **env}, stdout=self._fh, stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        # Importing the app, forking the pool and connecting: 2-5 s idle, far more on a loaded
        # 2-core machine that runs several tests' workers at once.
        self._wait_ready(120)

    def _wait_ready(self, timeout: float) -> None:
        """Wait for " ready."; a worker that never gets there is killed, not left consuming."""
        try:
            wait_for(self._ready, timeout=timeout, what=f"worker {self.name} to be ready")
        except BaseException:
            self.kill()
            self._fh.close()
            raise

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"worker {self.name} exited: {self.text()[-3000:]}")
        return " ready." in self.text()

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def children(self) -> list[int]:
        out = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True)
        return [int(p) for p in out.stdout.split()]

    def kill_child_running(self, marker: Path, timeout: float = 30) -> int:
        """SIGKILL the pool child whose pid the body wrote to ``marker``."""
        pid = int(wait_for(lambda: marker.exists() and marker.read_text().strip(), timeout,
                           what="the body to start"))
        os.kill(pid, signal.SIGKILL)
        return pid

    def stop(self) -> None:
        stop_group(self.proc)
        self._fh.close()

    def kill(self) -> None:
        """SIGKILL the whole worker (main process and children)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self._fh.close()  # the log stays readable by path; the handle is not left to the GC


class RedisServer:
    """A private ``redis-server`` on a free port (tests may kill and restart it)."""

    def __init__(self, appendonly: bool = False, settings: tuple[str, ...] = ()) -> None:
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="celery-idem-redis-"))
        self.appendonly = appendonly
        #: More command-line settings (later ones win: they may override ``--appendonly``).
        self.settings = settings
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        exe = shutil.which("redis-server") or "/usr/bin/redis-server"
        self.proc = subprocess.Popen(
            [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "yes" if self.appendonly else "no", "--dir", str(self.dir),
             *self.settings],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        import redis

        client = redis.Redis(port=self.port, socket_connect_timeout=0.5)

        def up() -> bool:
            try:
                return bool(client.ping())
            except redis.RedisError:
                return False

        wait_for(up, timeout=20, what=f"redis-server on {self.port}")
        client.close()

    def stop(self, sig: int = signal.SIGKILL) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(20)

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)
