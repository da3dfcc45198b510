"""Only the schedule's own sends take the nearest slot; an ad-hoc call takes the current one.

A real worker, and beat's own sending code (``celery.beat.Scheduler.apply_async``, which marks
its messages): an operator's call at :36.5 of a task with a 10 s period must not suppress
beat's send of :40.
"""

from __future__ import annotations

import threading

import pytest
from celery import signals
from celery.beat import ScheduleEntry, Scheduler

from celery_idem import identity
from celery_idem.keys import SLOT_FIELD, key_from_fields
from tests.integration import scope_app
from tests.integration.conftest import Cluster

pytestmark = pytest.mark.worker

APP = "tests.integration.scope_app"
BASE = 1_796_472_000.0  # a multiple of 10


def test_an_ad_hoc_call_does_not_take_the_next_scheduled_slot(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    cluster.worker(app=APP)
    now = [BASE + 36.5]
    monkeypatch.setattr(identity, "_clock", lambda: now[0])
    task = scope_app.report
    slot = lambda at: key_from_fields(task.name, {SLOT_FIELD: int(at)})  # noqa: E731

    manual = task.delay()  # an operator's run at :36.5: the current slot, :30
    assert manual.get(timeout=30) == slot(BASE + 30) == manual.idempotency_key
    beat = Scheduler(app=cluster.app, lazy=True)
    entry = ScheduleEntry(name="report", task=task.name, schedule=10.0, app=cluster.app)
    sends = []

    def beat_service() -> None:  # a beat service's thread, as `celery beat` runs one
        signals.beat_init.send(sender=beat)  # a Celery whose beat sets no header needs this
        for at in (BASE + 39.8, BASE + 40.6):  # beat's tick of :40, a moment early and late
            now[0] = at
            sends.append(beat.apply_async(entry, advance=False))

    service = threading.Thread(target=beat_service)
    service.start()
    service.join(timeout=60)
    assert len(sends) == 2
    assert sends[0].get(timeout=30) == slot(BASE + 40)  # beat's :40 run is not suppressed
    assert sends[1].id == sends[0].id  # the late copy is answered by (or attached to) the first
    now[0] = BASE + 41.0  # an ad-hoc call after the tick: the current slot, :40's record
    assert task.delay().get(timeout=30) == slot(BASE + 40)
    assert sorted(cluster.effects("report")) == sorted([slot(BASE + 30), slot(BASE + 40)])
