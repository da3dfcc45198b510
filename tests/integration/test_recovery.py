"""How soon a whole worker's unacknowledged message comes back (celery-behaviour.md, finding 8).

kombu's Redis transport restores an unacknowledged message only once it is older than the
``visibility_timeout``, at the next scan of the ``unacked`` index. The scan period is
``unacked_restore_interval`` x ``unacked_restore_throttle`` on kombu 5.7 (1 s here) and a
fixed 10 s x 10 on kombu 5.4-5.6, which ignore both options. The broker is a private
``redis-server``: a short visibility timeout restores every old unacknowledged message of the
broker's database, other tests' included. The figures print with ``pytest -s``; the table in
docs/configuration.md comes from ``python -m bench.recovery``.
"""

from __future__ import annotations

import kombu
import pytest

from bench.recovery import measure_once
from tests.conftest import REDIS_URL, require
from tests.integration.harness import RedisServer

pytestmark = [pytest.mark.worker, pytest.mark.crash]

VISIBILITY = 6.0
KOMBU_5_7 = tuple(int(p) for p in kombu.__version__.split(".")[:2]) >= (5, 7)
SCAN = 1.0 if KOMBU_5_7 else 100.0  # seconds between two scans of the unacked index


def test_a_killed_workers_message_runs_again_after_the_visibility_timeout_not_before() -> None:
    require(REDIS_URL, 6379, "Redis")
    broker = RedisServer()
    try:
        # Given two workers on a Redis broker with visibility_timeout 6 s and a scan every second
        # When the worker running a task is SIGKILLed (main process and child) a second after
        # the task started
        run = measure_once(broker.url, broker.url, visibility=VISIBILITY, interval=1, throttle=1,
                           kill_after=1.0, wait=VISIBILITY + SCAN + 30)
    finally:
        broker.cleanup()
    print(f"\nre-run {run.after_kill:.2f} s after the kill, {run.after_send:.2f} s after the "
          f"publish (visibility_timeout {VISIBILITY:g} s, kombu {kombu.__version__})"
          if run.second is not None else "\nno re-run")
    # Then the other worker runs it again, marked redelivered, within the bounded wait
    assert run.second is not None and run.after_send is not None, "the message never came back"
    assert run.redelivered
    # And not before the message was visibility_timeout old: a scan every second would have
    # restored it about 1 s after the kill, were the age not checked
    assert run.after_send >= VISIBILITY
    assert run.kill - run.sent < VISIBILITY - 2
    # And, with a scan every second (kombu 5.7), soon after that
    if KOMBU_5_7:
        assert run.after_send <= VISIBILITY + SCAN + 10
