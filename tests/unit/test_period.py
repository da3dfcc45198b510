"""``idempotency_period``: a key per schedule slot (periodic tasks).

The slot is the multiple of the period nearest to the enqueue time, read once by the producer
(``apply_async``) and carried in the key header; a worker that derives the key itself reads the
message's ``timestamp`` property, else its own clock. The clock is replaced here
(``celery_idem.identity._clock``), so nothing waits for real time.
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Callable
from typing import Any

import pytest
from celery import Celery

import celery_idem
import celery_idem.identity as identity_module
from celery_idem import CachedResult, IdempotentTask
from celery_idem.config import KNOWN_OPTIONS
from celery_idem.identity import BEAT_HEADER
from celery_idem.keys import SLOT_FIELD, key_from_fields, period_slot
from celery_idem.task import HEADER

#: A scheduled instant: 2026-12-05 12:00:00 UTC, a multiple of 60, 300, 3600 and 43200 s.
TICK = 1796472000.0


@pytest.fixture
def app() -> Celery:
    app = Celery("test_period", set_as_current=False)
    app.conf.task_always_eager = True
    app.conf.idempotency_store = "memory://"
    return app


class Clock:
    def __init__(self, monkeypatch: pytest.MonkeyPatch, now: float) -> None:
        self.now = now
        monkeypatch.setattr(identity_module, "_clock", lambda: self.now)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    return Clock(monkeypatch, TICK)


def make_report(app: Celery, runs: list[str | None], **options: Any) -> Any:
    """A no-argument periodic task, as beat sends it: ``apply_async((), {})``."""
    options.setdefault("idempotency_period", 60)

    @app.task(base=IdempotentTask, bind=True, shared=False, **options)
    def nightly_report(self: Any) -> int:
        runs.append(self.idempotency_key)
        return len(runs)

    return nightly_report


# -- the arithmetic ------------------------------------------------------------------------------


def test_sends_a_second_apart_around_a_scheduled_instant_share_its_slot() -> None:
    for period in (1, 3, 60, 3600, 43200):
        # One sender a moment before the instant (its clock is behind), one a second after.
        early, late = TICK - min(0.4, period / 2), TICK + min(0.6, period / 2 - 0.01)
        assert period_slot(early, period) == period_slot(late, period) == TICK


def test_a_period_that_does_not_divide_the_instant_can_cut_at_it() -> None:
    """Why the docs say to pick a period the schedule's instants are multiples of: noon UTC is
    half a day from the multiples of 86400 (midnights UTC), so a daily period cuts there."""
    assert period_slot(TICK - 0.4, 86400) != period_slot(TICK + 0.6, 86400)
    assert period_slot(TICK - 0.4, 43200) == period_slot(TICK + 0.6, 43200)


def test_every_time_within_half_a_period_of_the_instant_has_its_slot_and_no_other_does() -> None:
    period = 60.0
    for offset in (-30.0, -29.999, -10.0, -0.001, 0.0, 0.001, 10.0, 29.999):
        assert period_slot(TICK + offset, period) == TICK, offset
    assert period_slot(TICK + 30.0, period) == TICK + 60  # the half-multiple opens the next slot
    assert period_slot(TICK - 30.001, period) == TICK - 60


def test_a_slot_cut_at_the_instant_would_part_the_two_sends_rounding_does_not() -> None:
    period = 60
    early, late = TICK - 0.3, TICK + 0.7
    assert math.floor(early / period) != math.floor(late / period)  # floor: two slots
    assert period_slot(early, period) == period_slot(late, period)  # nearest: one


def test_sends_a_period_apart_get_two_slots() -> None:
    for period in (1, 2.5, 60, 86400):
        assert period_slot(TICK, period) != period_slot(TICK + period, period)
        assert period_slot(TICK + period, period) - period_slot(TICK, period) == pytest.approx(
            period)


def test_the_slot_is_an_int_when_whole_whatever_the_period_is_written_as() -> None:
    assert period_slot(TICK + 1, 60) == period_slot(TICK + 1, 60.0) == int(TICK)
    assert type(period_slot(TICK + 1, 60.0)) is int
    assert period_slot(7.4, 2.5) == 7.5


# -- the key -------------------------------------------------------------------------------------


def test_two_enqueues_a_second_apart_around_the_tick_run_the_body_once(
    app: Celery, clock: Clock
) -> None:
    runs: list[str | None] = []
    report = make_report(app, runs)
    clock.now = TICK - 0.4  # beat 1 (beat marks its messages with the celery_beat_task header)
    first = report.apply_async(headers={BEAT_HEADER: True})
    clock.now = TICK + 0.6  # beat 2, a second later, across the instant
    second = report.apply_async(headers={BEAT_HEADER: True})
    assert len(runs) == 1
    assert isinstance(second, CachedResult)
    assert second.idempotency_key == first.idempotency_key == runs[0]
    assert second.get() == 1


def test_enqueues_a_period_apart_run_the_body_once_each(app: Celery, clock: Clock) -> None:
    runs: list[str | None] = []
    report = make_report(app, runs)
    for n in range(3):
        clock.now = TICK + n * 60 + 0.5
        report.apply_async()
        clock.now += 0.8  # the second beat
        report.apply_async()
    assert len(runs) == 3
    assert len(set(runs)) == 3


def test_without_the_option_a_no_argument_task_runs_once_per_ttl(
    app: Celery, clock: Clock
) -> None:
    """The trap the docs warn about: every later tick is answered from the first record."""
    runs: list[str | None] = []
    report = make_report(app, runs, idempotency_period=None)
    for n in range(3):
        clock.now = TICK + n * 3600
        report.apply_async()
    assert len(runs) == 1


def test_keys_of_tasks_without_the_option_are_unchanged(app: Celery, clock: Clock) -> None:
    @app.task(base=IdempotentTask, shared=False, idempotency_fields=("order_id",))
    def charge(order_id: str, amount_cents: int) -> str:
        return order_id

    key = charge.idempotency_key_for(("o1", 100))
    assert key == key_from_fields(charge.name, {"order_id": "o1"})
    clock.now += 86400
    assert charge.idempotency_key_for(("o1", 100)) == key
    assert charge.idempotency_key_for(("o1", 100), at=0) == key  # `at` needs a period


def test_the_slot_is_a_field_of_the_derived_key(app: Celery, clock: Clock) -> None:
    @app.task(base=IdempotentTask, shared=False, idempotency_fields=("region",),
              idempotency_period=3600)
    def rollup(region: str, verbose: bool = False) -> str:
        return region

    clock.now = TICK + 1
    key = rollup.idempotency_key_for(("eu",))
    assert key == key_from_fields(rollup.name, {"region": "eu", SLOT_FIELD: int(TICK)})
    assert rollup.idempotency_key_for(("eu",), {"verbose": True}) == key
    assert rollup.idempotency_key_for(("us",)) != key  # the arguments still count
    assert rollup.idempotency_key_for(("eu",), at=TICK + 3600) != key


def test_a_key_func_key_gains_the_slot_a_per_call_key_does_not(app: Celery, clock: Clock) -> None:
    @app.task(base=IdempotentTask, shared=False, idempotency_period=60,
              idempotency_key_func=lambda account: f"acct-{account}")
    def sync(account: str) -> str:
        return account

    now = sync.idempotency_key_for(("a1",))
    assert now == key_from_fields(sync.name, {SLOT_FIELD: int(TICK)}, "acct-a1")
    assert sync.idempotency_key_for(("a1",), at=TICK + 60) != now
    per_call = sync.idempotency_key_for(("a1",), idempotency_key="run-7")
    assert per_call == f"{sync.name}:key=run-7"
    assert sync.idempotency_key_for(("a1",), idempotency_key="run-7", at=TICK + 600) == per_call
    scoped = sync.idempotency_key_for(("a1",), idempotency_scope="t1")
    assert scoped == now.replace(f"{sync.name}:", f"{sync.name}@t1:")


def test_at_takes_unix_seconds_or_an_aware_datetime(app: Celery) -> None:
    runs: list[str | None] = []
    report = make_report(app, runs)
    aware = dt.datetime.fromtimestamp(TICK + 5, dt.timezone.utc)
    paris = aware.astimezone(dt.timezone(dt.timedelta(hours=1)))
    assert report.idempotency_key_for(at=aware) == report.idempotency_key_for(at=TICK + 55) \
        == report.idempotency_key_for(at=paris) \
        == report.idempotency_key_for(at=TICK - 5, scheduled=True)
    with pytest.raises(ValueError, match="naive datetime"):
        report.idempotency_key_for(at=dt.datetime(2026, 12, 5, 12))
    with pytest.raises(TypeError, match="Unix seconds"):
        report.idempotency_key_for(at="2026-12-05")  # type: ignore[arg-type]


# -- where the time comes from -------------------------------------------------------------------


def _deliver(task: Any, clock: Clock, now: float, headers: dict[str, Any],
             properties: dict[str, Any] | None = None) -> Any:
    """Run ``task`` as a worker runs a delivered message (the request pushed, then called)."""
    clock.now = now
    task.push_request(id=f"m-{now}", headers=headers, properties=properties,
                      called_directly=False, is_eager=False)
    try:
        return task()
    finally:
        task.pop_request()


def test_a_redelivery_keeps_the_producers_slot_whatever_the_workers_clock(
    app: Celery, clock: Clock
) -> None:
    runs: list[str | None] = []
    report = make_report(app, runs)
    clock.now = TICK - 0.2
    key = report.idempotency_key_for()  # what apply_async put in the header
    _deliver(report, clock, TICK + 45, {HEADER: key})  # the worker's clock is in the next slot
    _deliver(report, clock, TICK + 3600, {HEADER: key})  # a redelivery an hour later
    assert runs == [key]


def test_a_message_without_the_header_uses_its_timestamp_else_the_workers_clock(
    app: Celery, clock: Clock
) -> None:
    runs: list[str | None] = []
    report = make_report(app, runs)
    beat = {BEAT_HEADER: True}  # beat's send_task of a task its process does not know
    # send_task by name with a timestamp property (as AMQP producers may set it).
    _deliver(report, clock, TICK + 50, beat, {"timestamp": TICK - 1})
    assert runs == [report.idempotency_key_for(at=TICK, scheduled=True)]
    _deliver(report, clock, TICK + 55, beat, {"timestamp": dt.datetime.fromtimestamp(
        TICK + 2, dt.timezone.utc).replace(tzinfo=None)})  # a naive datetime: UTC
    assert len(runs) == 1
    # No timestamp: the worker's clock (TICK + 50 is in the next slot).
    _deliver(report, clock, TICK + 50, beat, {"priority": 0})
    assert runs[1] == report.idempotency_key_for(at=TICK + 60, scheduled=True)
    _deliver(report, clock, TICK + 70, beat, {"timestamp": "yesterday"})  # unusable: the clock
    assert len(runs) == 2
    # Not beat's: the current slot of its time, never the next one.
    _deliver(report, clock, TICK + 200, {}, {"timestamp": TICK + 170})
    assert runs[2] == report.idempotency_key_for(at=TICK + 120) \
        != report.idempotency_key_for(at=TICK + 170, scheduled=True)


# -- the option ----------------------------------------------------------------------------------


def define(app: Celery, **options: Any) -> Callable[..., Any]:
    def tick() -> None:
        return None

    app.task(base=IdempotentTask, shared=False, **options)(tick)
    app.finalize()
    return app.tasks[f"{tick.__module__}.{tick.__name__}"]  # type: ignore[no-any-return]


def test_the_option_is_known_and_resolved(app: Celery) -> None:
    assert "idempotency_period" in KNOWN_OPTIONS
    assert define(app, idempotency_period=300).idempotency_config.period == 300.0
    assert IdempotentTask.idempotency_period is None


@pytest.mark.parametrize("value", [0, 0.5, -60, float("nan"), float("inf"), "60", True, [60]])
def test_a_bad_period_is_refused_at_definition_naming_the_option(app: Celery, value: Any) -> None:
    with pytest.raises(celery_idem.ImproperlyConfigured, match="idempotency_period"):
        define(app, idempotency_period=value)


def test_a_period_below_one_second_says_why(app: Celery) -> None:
    with pytest.raises(celery_idem.ImproperlyConfigured, match=r"at least 1 s, got 0\.5"):
        define(app, idempotency_period=0.5)


def test_a_ttl_shorter_than_the_period_is_refused(app: Celery) -> None:
    with pytest.raises(celery_idem.ImproperlyConfigured,
                       match=r"idempotency_ttl \(60 s\) must be at least idempotency_period"):
        define(app, idempotency_period=3600, idempotency_ttl=60)
    assert define(app, idempotency_period=60, idempotency_ttl=60).idempotency_config.ttl == 60


def test_a_misspelt_period_is_refused_with_the_option_meant(app: Celery) -> None:
    with pytest.raises(celery_idem.ImproperlyConfigured, match="'idempotency_period'"):
        define(app, idempotency_perod=60)
    with pytest.raises(celery_idem.ImproperlyConfigured, match="'idempotency_period'"):
        define(app, idem_period=60)
