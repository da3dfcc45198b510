"""Periodic tasks under two real ``celery beat`` processes (``idempotency_period``).

Two beat processes (each with its own schedule file, started about a second apart, the classic
production mistake) send the same no-argument entries every 3 s to one real worker on a private
queue and key prefix. Each beat's sends are counted in a Redis ledger by ``after_task_publish``
in the beat process, each body's run by the body. The body must run once per slot: every slot
key sent ran exactly once, although most slots were published twice.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from celery_idem.identity import BEAT_HEADER
from celery_idem.keys import SLOT_FIELD, key_from_fields, period_slot
from tests.integration.harness import ROOT, Worker, stop_group, wait_for

pytestmark = pytest.mark.worker

APP = "tests.integration.beat_app"
EVERY = PERIOD = 3.0


class Beat:
    """One ``celery beat`` subprocess with its own schedule file, pid file and log."""

    def __init__(self, env: dict[str, str], name: str, workdir: Path) -> None:
        self.name = name
        self.log = workdir / f"beat-{name}.log"
        self._fh = self.log.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", APP, "beat", "-l", "INFO",
             "--schedule", str(workdir / f"schedule-{name}"),
             "--pidfile", str(workdir / f"beat-{name}.pid"), "--max-interval", "1"],
            cwd=ROOT, env={**os.environ, **env, "IDEM_BEAT_NAME": name},
            stdout=self._fh, stderr=subprocess.STDOUT, start_new_session=True,
        )

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def started(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"beat {self.name} exited: {self.text()[-3000:]}")
        return "beat: Starting..." in self.text()

    def sends(self, entry: str) -> int:
        """How many times this beat sent ``entry`` (its own log line per send)."""
        return self.text().count(f"Sending due task {entry} ")

    def stop(self) -> None:
        stop_group(self.proc)
        self._fh.close()


@pytest.fixture
def beat_env(redis_url: str) -> Iterator[dict[str, str]]:
    tag = uuid.uuid4().hex[:10]
    env = {
        "IDEM_BROKER": redis_url, "IDEM_BACKEND": redis_url, "IDEM_LEDGER": redis_url,
        "IDEM_PREFIX": f"beattest-{tag}:", "IDEM_QUEUE": f"beattest-{tag}",
        "IDEM_BEAT_EVERY": str(EVERY), "IDEM_BEAT_PERIOD": str(PERIOD),
    }
    yield env
    client = redis.Redis.from_url(redis_url)
    for name in client.scan_iter(match=env["IDEM_PREFIX"] + "*", count=1000):
        client.delete(name)
    client.delete(env["IDEM_QUEUE"])
    client.close()


def slot_key(task: str, at: float) -> str:
    """The key a send of the no-argument ``task`` at ``at`` gets (its operation: the name)."""
    return key_from_fields(task, {SLOT_FIELD: period_slot(at, PERIOD)})


def test_two_beats_sending_every_tick_run_the_body_once_per_slot(
    beat_env: dict[str, str], redis_url: str
) -> None:
    prefix = beat_env["IDEM_PREFIX"]
    ledger = redis.Redis.from_url(redis_url)
    client = Celery("beat-client", broker=redis_url, backend=redis_url, set_as_current=False)
    workdir = Path(tempfile.mkdtemp(prefix="celery-idem-beat-"))
    worker = Worker(beat_env, f"beat-{prefix.strip(':')}", concurrency=2, app=APP)
    beats: list[Beat] = []

    def sent(task: str) -> list[dict[str, Any]]:
        return [json.loads(v) for v in ledger.lrange(f"{prefix}sent:{task}", 0, -1)]

    def ran(task: str) -> list[str]:
        return [v.decode() for v in ledger.lrange(f"{prefix}ledger:{task}", 0, -1)]

    try:
        beats.append(Beat(beat_env, "a", workdir))
        wait_for(beats[0].started, timeout=60, what="beat a to start")
        # The second beat a second later: its ticks follow the first's by about a second.
        time.sleep(1.0)
        beats.append(Beat(beat_env, "b", workdir))
        wait_for(beats[1].started, timeout=60, what="beat b to start")
        # Run until each beat has sent four ticks (about 12 s; bounded).
        wait_for(lambda: all(b.sends("tick") >= 4 for b in beats), timeout=60,
                 what="four ticks from each beat")

        # A send by name without the key header: the worker derives the key from the
        # message's timestamp property (two sends of beat straddling a slot's instant, long
        # ago: one slot), else from its own clock (an ad-hoc send: the current slot).
        then = period_slot(time.time(), PERIOD) - 1000 * PERIOD
        by_name = [client.send_task(f"{APP}.by_name", queue=beat_env["IDEM_QUEUE"],
                                    headers={BEAT_HEADER: True}, timestamp=then + dt)
                   for dt in (-0.4, 0.6)]
        by_name.append(client.send_task(f"{APP}.by_name", queue=beat_env["IDEM_QUEUE"]))
        sent_by_clock = time.time()

        for b in beats:
            b.stop()
        published = sent("tick") + sent("tick_checked")
        ids = [s["id"] for s in published] + [r.id for r in by_name]
        # Every published message was handled: run, or answered from the slot's record.
        wait_for(lambda: all(client.AsyncResult(i).ready() for i in ids), timeout=60,
                 what="every published message to be handled")
    finally:
        for b in beats:
            b.stop()
        worker.stop()

    logs = "\n\n".join(f"--- beat {b.name}\n{b.text()[-2000:]}" for b in beats)
    # `tick` publishes every send: the worker's gate answers the second beat's copy.
    ticks, bodies = sent("tick"), ran("tick")
    by_beat = {b.name: {s["key"] for s in ticks if s["beat"] == b.name} for b in beats}
    assert all(len(keys) >= 3 for keys in by_beat.values()), (by_beat, logs)
    assert len(bodies) == len(set(bodies)), f"a slot ran twice: {bodies}"
    assert set(bodies) == {s["key"] for s in ticks}, (bodies, ticks)
    shared = by_beat["a"] & by_beat["b"]
    assert len(shared) >= 2, (by_beat, logs)  # slots both beats published: one body each
    assert len(ticks) >= len(bodies) + 2, (ticks, bodies)
    for s in ticks:  # the producer's slot (its clock when it sent), carried in the header
        assert s["key"] in {slot_key(f"{APP}.tick", s["time"]),
                            slot_key(f"{APP}.tick", s["time"] - 0.5)}, s
    # `tick_checked` (the default enqueue check): a send of a done slot publishes nothing.
    checked = ran("tick_checked")
    assert len(checked) == len(set(checked)), f"a slot ran twice: {checked}"
    assert set(checked) == {s["key"] for s in sent("tick_checked")}
    assert sum(b.sends("tick_checked") for b in beats) >= len(checked) + 2
    # By name: the two timestamped sends share the old slot; the third is the worker's clock.
    named = ran("by_name")
    assert len(named) == 2, named
    assert slot_key(f"{APP}.by_name", then) in named
    by_clock = {key_from_fields(f"{APP}.by_name", {SLOT_FIELD: period_slot(
        sent_by_clock + n * PERIOD, PERIOD, nearest=False)}) for n in range(3)}
    assert len(by_clock & set(named)) == 1, (named, by_clock)
    for r in by_name:
        assert r.get(timeout=10) in named
    client.close()
    ledger.close()


def test_a_requeued_copy_sent_by_name_keeps_its_message_time_slot(
    beat_env: dict[str, str], redis_url: str
) -> None:
    """Two sends by name of one old slot, delivered at once to two pool processes: one runs, the
    other is re-queued while it does. The re-queue carries the key derived from the message's
    time, so the copy is answered from the slot's record; deriving it again from the worker's
    clock (a later slot) ran the body twice (CI, 2026-12-05)."""
    ledger = redis.Redis.from_url(redis_url)
    client = Celery("beat-client", broker=redis_url, backend=redis_url, set_as_current=False)
    worker = Worker(beat_env, f"slow-{beat_env['IDEM_PREFIX'].strip(':')}", concurrency=2, app=APP)
    then = period_slot(time.time(), PERIOD) - 1000 * PERIOD
    try:
        sent = [client.send_task(f"{APP}.slow_by_name", args=("m",), queue=beat_env["IDEM_QUEUE"],
                                 headers={BEAT_HEADER: True}, timestamp=then + dt)
                for dt in (-0.2, 0.2)]
        answers = [r.get(timeout=60) for r in sent]
        wait_for(lambda: "celery_idem requeued" in worker.text(), timeout=30,
                 what="the copy's re-queue while the first ran")
    finally:
        worker.stop()
    key = key_from_fields(f"{APP}.slow_by_name", {"marker": "m", SLOT_FIELD: period_slot(then, PERIOD)})
    bodies = [v.decode() for v in ledger.lrange(f"{beat_env['IDEM_PREFIX']}ledger:slow_by_name", 0, -1)]
    assert bodies == [key], bodies
    assert answers == [key, key]
    client.close()
    ledger.close()
