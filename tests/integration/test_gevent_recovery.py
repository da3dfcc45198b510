"""A gevent worker on a Redis broker does not restore a dead worker's message; prefork does.

celery-behaviour.md, "Measured 2026-12-05": kombu's periodic scan of the ``unacked`` index
(every ``unacked_restore_interval`` x ``unacked_restore_throttle``, for messages older than
``visibility_timeout``) is a timer on the worker's event loop (its hub). Gevent workers run
Celery's synchronous consumer loop, so a surviving gevent worker never runs it: the SIGKILLed
worker's message stays unacked. A prefork worker on the queue restores it, and the action then
runs once: the takeover's body, after the dead holder's lease.

The broker is a private ``redis-server``: a short visibility timeout restores every old
unacknowledged message of the broker's database, other tests' included.
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from tests.integration import app as tasks
from tests.integration.conftest import Cluster
from tests.integration.harness import RedisServer, wait_for

pytestmark = [
    pytest.mark.worker, pytest.mark.crash,
    pytest.mark.skipif(importlib.util.find_spec("gevent") is None, reason="gevent not installed"),
]

VISIBILITY = 3.0  # the broker's visibility_timeout, seconds
SCAN = 1.0  # unacked_restore_interval x unacked_restore_throttle (kombu 5.7 honours both)
NOT_RESTORED_FOR = 12.0  # well past VISIBILITY + SCAN: the survivor had four scans' worth of time


@pytest.fixture
def broker() -> Iterator[RedisServer]:
    server = RedisServer()
    yield server
    server.cleanup()


def unacked(server: RedisServer) -> int:
    """Messages delivered and not acknowledged (kombu's ``unacked`` hash on the broker)."""
    client = redis.Redis(port=server.port)
    try:
        return int(client.hlen("unacked"))
    finally:
        client.close()


def pids(marker: Path) -> list[int]:
    return [int(p) for p in marker.read_text().split()] if marker.exists() else []


def test_a_surviving_gevent_worker_never_restores_a_killed_workers_message_a_prefork_one_does(
    broker: RedisServer, make_cluster: Callable[..., Cluster], tmp_path: Path
) -> None:
    cluster = make_cluster(
        IDEM_BROKER=broker.url, IDEM_BACKEND=broker.url, IDEM_LEDGER=broker.url,
        IDEM_VISIBILITY=str(VISIBILITY), IDEM_RESTORE_INTERVAL=str(SCAN),
        IDEM_RESTORE_THROTTLE="1",
    )
    # Given two gevent workers on one queue of a Redis broker (visibility_timeout 3 s, a scan
    # every second), both started before the message, so no worker start restores it later
    first = cluster.worker("ga", pool="gevent", concurrency=2)
    survivor = cluster.worker("gb", pool="gevent", concurrency=2)
    assert "does not restore unacked messages" in survivor.text()  # the warning, as tested apart
    marker = tmp_path / "pids"
    # And an action (lease 3 s) whose body is running on one of them
    r = tasks.held_action.delay("ord_gevent", hold=600, marker=str(marker))
    [pid] = wait_for(lambda: pids(marker), timeout=30, what="the body to start")
    holder = next(w for w in (first, survivor) if w.proc.pid == pid)  # gevent: no child process
    idle = survivor if holder is first else first
    # When that whole worker (its process group) is SIGKILLed mid-body
    holder.kill()
    killed_at = time.monotonic()
    cluster.set_flag("release:ord_gevent")  # a re-run finishes at once
    # Then the surviving gevent worker does not restore the message, long past the visibility
    # timeout: the body does not run again and the message stays unacked on the broker
    while time.monotonic() - killed_at < NOT_RESTORED_FOR:
        assert pids(marker) == [pid], "the gevent worker restored the message"
        time.sleep(0.2)
    assert idle.proc.poll() is None, "the surviving gevent worker exited"
    assert unacked(broker) == 1
    assert cluster.effects("action:ord_gevent") == []
    assert "takeover" not in idle.text()
    # When a prefork worker starts on the queue
    rescuer = cluster.worker("pf", pool="prefork", concurrency=1)
    # Then the message is restored and the action completes exactly once, by a takeover of the
    # dead holder's claim (its 3 s lease ran out while nobody restored the message)
    out = r.get(timeout=30)
    assert cluster.effects("action:ord_gevent") == [r.id]
    assert len(pids(marker)) == 2 and out["task_id"] == r.id
    assert "celery_idem takeover" in rescuer.text() + idle.text()
    wait_for(lambda: unacked(broker) == 0, timeout=10, what="the message to be acknowledged")
