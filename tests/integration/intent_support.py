"""Helpers of the "no action lost" tests (tests/integration/test_intents*.py).

The broker is a private ``redis-server`` (the tests restart and flush it); the store, the result
backend and the ledger are the shared Redis under the test's own key prefix, so they outlive the
broker. The task is :func:`tests.integration.intent_app.intended`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

from tests.integration.conftest import Cluster
from tests.integration.harness import ROOT, RedisServer, stop_group, wait_for
from tests.integration.intent_app import INTENTS, LEDGER, RELAY_AFTER, RELAY_INTERVAL

__all__ = ["APP", "INTENTS", "RELAY_AFTER", "RELAY_INTERVAL", "Relay", "drop_sql_intents", "effects", "flush",
           "kept", "make_intent_cluster", "queued", "relayed_lines", "restart_empty", "wait_effects"]

APP = "tests.integration.intent_app"

#: kombu's Redis transport keeps a queue's messages of priority p > 0 in ``<queue>\x06\x16<p>``.
_PRIORITY_LISTS = ("", "\x06\x163", "\x06\x166", "\x06\x169")


def make_intent_cluster(make_cluster: Callable[..., Cluster], broker: RedisServer,
                        **env: str) -> Cluster:
    """A cluster on ``broker`` whose store, results and ledger are the shared Redis."""
    return make_cluster(IDEM_BROKER=broker.url, IDEM_RELAY_AFTER=str(RELAY_AFTER),
                        IDEM_RELAY_INTERVAL=str(RELAY_INTERVAL),
                        IDEM_INTENTS="1" if INTENTS else "0", **env)


def drop_sql_intents(cluster: Cluster) -> None:
    """Delete the test's rows of the SQL store's intents and watermarks tables (its prefix): a
    failed test leaves some; Cluster.close deletes only the records."""
    import sqlalchemy as sa

    store = cluster.store
    with store._engine.begin() as conn:
        for table in (store._intent_sql.intents_table, store._intent_sql.watermarks_table):
            column = "key" if table.endswith("_intents") else "queue"
            conn.execute(sa.text(f'DELETE FROM "{table}" WHERE substr("{column}", 1, :n) = :p'),
                         {"n": len(cluster.prefix), "p": cluster.prefix})


def queued(broker: RedisServer, queue: str) -> int:
    """Messages waiting in ``queue`` on the broker (every priority's list)."""
    client = redis.Redis(port=broker.port)
    try:
        pipe = client.pipeline(transaction=False)
        for suffix in _PRIORITY_LISTS:
            pipe.llen(queue + suffix)
        return sum(int(n) for n in pipe.execute())
    finally:
        client.close()


def restart_empty(broker: RedisServer) -> None:
    """Kill the broker and start it again on its port, without persistence: every message is
    gone (``--save "" --appendonly no``)."""
    assert not broker.appendonly
    broker.stop(signal.SIGKILL)
    broker.start()


def flush(broker: RedisServer) -> None:
    client = redis.Redis(port=broker.port)
    try:
        client.flushall()
    finally:
        client.close()


def effects(cluster: Cluster) -> list[tuple[str, str, float]]:
    """Every run of the body so far: ``(action, task id, time.time())``."""
    rows = cluster.ledger.lrange(f"{cluster.prefix}{LEDGER}", 0, -1)
    out = []
    for row in rows:
        action, task_id, at = row.decode().split(" ")
        out.append((action, task_id, float(at)))
    return out


def wait_effects(cluster: Cluster, actions: list[str], timeout: float,
                 what: str = "every action's effect") -> Counter[str]:
    """Wait until every action of ``actions`` has had an effect; returns the counts."""
    wanted = set(actions)

    def done() -> Counter[str] | None:
        counts = Counter(a for a, _, _ in effects(cluster))
        return counts if wanted <= counts.keys() else None

    try:
        return wait_for(done, timeout=timeout, interval=0.1, what=what)  # type: ignore[no-any-return]
    except AssertionError:
        seen = Counter(a for a, _, _ in effects(cluster))
        missing = sorted(wanted - seen.keys())
        raise AssertionError(f"timed out after {timeout:g} s waiting for {what}: "
                             f"{len(missing)} of {len(wanted)} actions had no effect "
                             f"(first: {missing[:5]})") from None


def kept(cluster: Cluster) -> list[Any]:
    """The intents the store keeps for this test's prefix (none from a store without them)."""
    store = cluster.store
    if not getattr(store, "keeps_intents", False):
        return []
    return list(store.intents(count=1000))


def relayed_lines(text: str) -> list[str]:
    """The relay's WARNING lines for a message it re-sent."""
    return [line for line in text.splitlines() if "celery_idem relayed" in line]


class Relay:
    """One ``celery -A tests.integration.intent_app idem relay`` process with its own log."""

    def __init__(self, env: dict[str, str], name: str, *args: str) -> None:
        self.name = name
        self.log = Path(tempfile.mkstemp(prefix=f"celery-idem-relay-{name}-", suffix=".log")[1])
        self._fh = self.log.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", APP, "idem", "relay", *args],
            cwd=ROOT, env={**os.environ, **env}, stdout=self._fh, stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def relayed(self) -> list[str]:
        return relayed_lines(self.text())

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the relay (its process group)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        stop_group(self.proc)
        if not self._fh.closed:
            self._fh.close()
