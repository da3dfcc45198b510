"""Celery time limits: where they come from, the deadline they give a wait, and the checks."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from celery import Celery

import celery_idem.delivery
from celery_idem import IdempotentTask, ImproperlyConfigured, timelimits
from celery_idem.timelimits import check_worker, margin, request_deadline


@pytest.fixture(autouse=True)
def no_worker_limits() -> Iterator[None]:
    """Each test starts (and leaves) without worker-level limits."""
    timelimits.set_worker_limits(None, None)
    yield
    timelimits.set_worker_limits(None, None)


def make_app(**conf: Any) -> Celery:
    app = Celery("test_timelimits", set_as_current=False, broker="redis://127.0.0.1:6379/0")
    app.conf.idempotency_store = "memory://"
    app.conf.update(conf)
    return app


def make_task(app: Celery, **options: Any) -> Any:
    @app.task(base=IdempotentTask, bind=True, shared=False, **options)
    def charge(self: Any, order_id: str) -> str:
        return order_id

    app.finalize()
    return charge


def request(timelimit: tuple[float | None, float | None] | None = None) -> Any:
    return SimpleNamespace(timelimit=timelimit)


@pytest.mark.parametrize(("limit", "expected"), [(1, 0.5), (3, 0.6), (10, 2.0), (300, 5.0)])
def test_the_margin_is_a_fifth_of_the_limit_between_half_a_second_and_five(
    limit: float, expected: float
) -> None:
    assert margin(limit) == pytest.approx(expected)


def test_without_any_limit_there_is_no_deadline() -> None:
    task = make_task(make_app())
    assert request_deadline(task, request(), started=100.0) is None
    assert request_deadline(task, request((None, None)), started=100.0) is None


@pytest.mark.parametrize(
    ("options", "conf", "timelimit", "worker", "first"),
    [
        pytest.param({"soft_time_limit": 3}, {}, None, None, 3, id="task soft"),
        pytest.param({"time_limit": 3}, {}, None, None, 3, id="task hard"),
        pytest.param({}, {"task_soft_time_limit": 4}, None, None, 4, id="app soft"),
        pytest.param({}, {"task_time_limit": 4}, None, None, 4, id="app hard"),
        pytest.param({}, {}, (None, 5), None, 5, id="call soft"),
        pytest.param({}, {}, (5, None), None, 5, id="call hard"),
        pytest.param({}, {}, None, (6, None), 6, id="worker soft"),
        pytest.param({}, {}, None, (None, 6), 6, id="worker hard"),
        pytest.param({"soft_time_limit": 30}, {}, (None, 5), None, 5, id="call beats task"),
        pytest.param({"soft_time_limit": 5}, {}, None, (30, None), 5, id="task beats worker"),
        pytest.param({"soft_time_limit": 8, "time_limit": 4}, {}, None, None, 4,
                     id="a hard limit below the soft one fires first"),
        pytest.param({"soft_time_limit": 4}, {}, (10, None), None, 4,
                     id="a call's hard limit keeps the task's soft one"),
    ],
)
def test_the_deadline_is_the_first_limit_to_fire_less_the_margin(
    options: dict[str, Any], conf: dict[str, Any], timelimit: Any, worker: Any, first: float,
) -> None:
    task = make_task(make_app(**conf), **options)
    if worker is not None:
        timelimits.set_worker_limits(*worker)
    deadline = request_deadline(task, request(timelimit), started=100.0)
    assert deadline == pytest.approx(100.0 + first - margin(first))


@pytest.mark.parametrize("option", ["soft_time_limit", "time_limit"])
def test_a_task_option_limit_too_short_to_wait_is_refused_at_definition(option: str) -> None:
    with pytest.raises(ImproperlyConfigured, match=rf"{option}=0\.5 \(task option\).*no time"):
        make_task(make_app(), **{option: 0.5})


def test_a_limit_of_one_second_is_accepted() -> None:
    make_task(make_app(), soft_time_limit=1, time_limit=2)


def test_a_lease_too_short_to_be_renewed_is_refused_at_definition() -> None:
    with pytest.raises(ImproperlyConfigured, match=r"idempotency_lease \(0\.2 s\) cannot be renewed"):
        make_task(make_app(), idempotency_lease=0.2)


@pytest.mark.parametrize(
    ("conf", "cli", "named"),
    [
        pytest.param({"task_soft_time_limit": 0.5}, (None, None),
                     r"task_soft_time_limit=0\.5 \(app setting\)", id="app setting"),
        pytest.param({}, (0.5, None), r"--time-limit=0\.5 \(worker\)", id="worker flag"),
    ],
)
def test_a_limit_too_short_to_wait_is_refused_at_worker_start_naming_the_setting(
    conf: dict[str, Any], cli: tuple[float | None, float | None], named: str,
) -> None:
    app = make_app(**conf)
    task = make_task(app)
    with pytest.raises(ImproperlyConfigured, match=named):
        check_worker(app, [task], *cli)


def test_a_wait_longer_than_the_limit_allows_is_one_warning_naming_both_settings(
    caplog: pytest.LogCaptureFixture,
) -> None:
    app = make_app(task_soft_time_limit=3)
    tasks = [make_task(app, idempotency_wait=10), make_task(app, name="second", idempotency_wait=1)]
    with caplog.at_level(logging.WARNING, logger="celery_idem"):
        check_worker(app, tasks, None, None)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "idempotency_wait=10" in warnings[0]
    assert "task_soft_time_limit=3 (app setting)" in warnings[0]
    assert "waits at most 2.4 s" in warnings[0]
    assert "second" not in warnings[0]  # its 1 s wait fits


def test_a_time_limit_reaching_the_redis_visibility_timeout_is_one_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    app = make_app(broker_transport_options={"visibility_timeout": 60})
    task = make_task(app, time_limit=60, idempotency_wait=1)
    with caplog.at_level(logging.WARNING, logger="celery_idem"):
        check_worker(app, [task], None, None)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "visibility_timeout (60 s)" in warnings[0] and "time_limit=60 (task option)" in warnings[0]


@pytest.mark.parametrize(
    ("broker", "options"),
    [
        pytest.param("redis://127.0.0.1:6379/0", {"visibility_timeout": 61}, id="redis, longer"),
        pytest.param("amqp://guest@127.0.0.1//", {"visibility_timeout": 1}, id="rabbitmq"),
    ],
)
def test_no_visibility_warning_below_the_timeout_or_on_a_broker_without_one(
    broker: str, options: dict[str, Any], caplog: pytest.LogCaptureFixture,
) -> None:
    app = make_app(broker_transport_options=options)
    app.conf.broker_url = broker
    task = make_task(app, time_limit=60, idempotency_wait=1)
    with caplog.at_level(logging.WARNING, logger="celery_idem"):
        check_worker(app, [task], None, None)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_check_worker_records_the_worker_limits_for_its_children() -> None:
    app = make_app()
    task = make_task(app, idempotency_wait=1)
    check_worker(app, [task], 20, 10)
    assert request_deadline(task, request(), started=0.0) == pytest.approx(10 - margin(10))


class Requeued(Exception):
    """Stands in for the re-queue (which would publish to a broker)."""


@pytest.mark.parametrize(("holder_lease", "countdown"), [(60.0, 0.5), (0.2, 0.0)],
                         ids=["still busy: half a second later", "freed: at once"])
def test_a_worker_duplicate_re_queues_within_its_soft_limit(
    holder_lease: float, countdown: float, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given a worker-side request with a 1 s soft limit (0.5 s to wait) for a key held elsewhere
    app = make_app()
    task = make_task(app, soft_time_limit=1, idempotency_wait=10)
    key = task.idempotency_key_for(("ord_1",))
    task._gate.store.claim(key, owner="other:1", task_id="t-holder", attempt=0,
                           lease=holder_lease, ttl=600)
    calls: list[float] = []

    def requeue(task: Any, countdown: float, reason: str, exc: BaseException | None = None) -> None:
        calls.append(countdown)
        raise Requeued(reason)

    monkeypatch.setattr(celery_idem.delivery, "requeue", requeue)
    task.push_request(id="t2", headers={}, is_eager=False, called_directly=False, timelimit=None)
    started = time.monotonic()
    try:
        # When it runs
        with pytest.raises(Requeued):
            task("ord_1")
    finally:
        task.pop_request()
    # Then it re-queued before its limit (and sooner when the key was freed during the wait)
    assert calls == [countdown]
    assert time.monotonic() - started < 1.0


def test_a_soft_limit_during_the_wait_of_a_direct_call_is_the_callers_and_propagates(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given a task called directly (inside another task's body, say) on a key held elsewhere
    from billiard.exceptions import SoftTimeLimitExceeded

    app = make_app()
    task = make_task(app, idempotency_wait=10)
    key = task.idempotency_key_for(("ord_2",))
    task._gate.store.claim(key, owner="other:1", task_id="t-holder", attempt=0, lease=60, ttl=600)

    def sleep(seconds: float) -> None:
        raise SoftTimeLimitExceeded()  # the calling task's soft limit fires during the wait

    monkeypatch.setattr(task._gate, "sleep", sleep)
    # When it waits, Then the limit reaches the caller (no broker to re-queue to, no endless wait)
    with pytest.raises(SoftTimeLimitExceeded):
        task("ord_2")
