"""pytest plugin for the conformance run: Celery's own integration tests, with IdempotentTask.

Loaded with ``-p tests.conformance.celery_suite_plugin`` by ``scripts/celery_suite.py`` while
pytest runs inside an unpacked Celery sdist (``t/integration``). It

* injects the task class: ``CELERY_IDEM_CONFORMANCE=idem`` makes the ``celery_parameters``
  fixture return ``{"task_cls": "celery_idem:IdempotentTask"}``, so both the session app (the
  worker's) and the per-test app are ``Celery(task_cls="celery_idem:IdempotentTask")`` and
  every ``@shared_task`` without its own ``base=`` is an IdempotentTask; ``plain`` leaves
  Celery's defaults. An autouse fixture checks that the injection took, so a run can never
  compare plain with plain;
* fails a test's setup or call after ``CELERY_IDEM_CONFORMANCE_TIMEOUT`` seconds (or Celery's
  own ``timeout`` mark when lower; Celery marks many tests ``timeout(300)``), and again every
  10 s after that, since Celery's subtests catch a failure and go on (a ``.get()`` without a
  timeout must not stall the run); it drops the ``flaky`` rerun marks, so each test has one
  outcome per run. pytest-timeout (thread method) stays as a backstop for anything else;
* writes each test's outcome to ``CELERY_IDEM_CONFORMANCE_OUT`` (JSON) after every test, so a
  run stopped by the driver's wall-clock limit keeps what it has.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest

TASK_CLS = "celery_idem:IdempotentTask"
MODE = os.environ.get("CELERY_IDEM_CONFORMANCE", "plain")
TIMEOUT = float(os.environ.get("CELERY_IDEM_CONFORMANCE_TIMEOUT", "60"))
OUT = os.environ.get("CELERY_IDEM_CONFORMANCE_OUT")
#: A plain run's results: a test that passed there in d seconds gets at most 3 d + 10 s (at least
#: 15 s) here, so the idem run does not spend the full limit on each call that never returns.
REFERENCE = os.environ.get("CELERY_IDEM_CONFORMANCE_REFERENCE")

if MODE not in ("plain", "idem"):
    raise pytest.UsageError(f"CELERY_IDEM_CONFORMANCE={MODE!r}: expected 'plain' or 'idem'")


class _Fixtures:
    """Registered in ``pytest_configure``, after every ``-p`` plugin, so these definitions win
    over ``celery.contrib.pytest``'s whatever order the ``-p`` options came in."""

    @pytest.fixture(scope="session")
    def celery_parameters(self) -> dict[str, Any]:
        return {"task_cls": TASK_CLS} if MODE == "idem" else {}

    @pytest.fixture(autouse=True)
    def _celery_idem_task_cls_check(self, request: pytest.FixtureRequest) -> None:
        if "celery_session_app" not in request.fixturenames:
            return
        from celery_idem import IdempotentTask

        for name in ("celery_session_app", "app"):
            if name not in request.fixturenames:
                continue
            task_base = request.getfixturevalue(name).Task
            if issubclass(task_base, IdempotentTask) != (MODE == "idem"):
                pytest.fail(f"conformance: {name}.Task is {task_base.__mro__}; mode is {MODE}")


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(_Fixtures(), "celery_idem_conformance_fixtures")
    _state["started"] = time.monotonic()


_LIMIT = pytest.StashKey[float]()
#: After a timeout fires, it fires again every this many seconds until the phase ends: Celery's
#: subtests catch the first one and go on, and a later subtest may hang too.
REARM = 10.0


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    reference: dict[str, Any] = {}
    if REFERENCE and os.path.exists(REFERENCE):
        with open(REFERENCE) as fh:
            reference = json.load(fh)["tests"]
    for item in items:
        marks = item.own_markers
        limit = TIMEOUT
        seen = reference.get(item.nodeid)
        if seen and seen["outcome"] == "passed":
            limit = min(limit, max(15.0, 3 * seen["duration"] + 10))
        for mark in marks:
            if mark.name == "timeout":
                given = mark.kwargs.get("timeout", mark.args[0] if mark.args else None)
                if given is not None:
                    limit = min(limit, float(given))
        marks[:] = [m for m in marks if m.name not in ("timeout", "flaky")]
        item.stash[_LIMIT] = limit


@contextlib.contextmanager
def _alarm(item: pytest.Item, phase: str) -> Iterator[None]:
    """Fail the phase after the item's limit, and again every REARM seconds after that."""
    limit = item.stash.get(_LIMIT, TIMEOUT)

    def on_alarm(signum: int, frame: Any) -> None:
        pytest.fail(f"Timeout (>{limit:.0f}s) in {phase}, from the conformance plugin", pytrace=False)

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, limit, REARM)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Any:
    with _alarm(item, "setup"):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Any:
    with _alarm(item, "call"):
        return (yield)


def _message(report: pytest.TestReport) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None:
        text = str(crash.message)
    elif isinstance(report.longrepr, tuple):  # a skip: (path, line, reason)
        text = str(report.longrepr[2])
    else:
        text = str(report.longrepr or "")
    text = " ".join(text.split())
    return text[:400]


@pytest.hookimpl(trylast=True)
def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    results = _results()
    entry = results.setdefault(report.nodeid, {"outcome": None, "message": "", "duration": 0.0})
    wasxfail = hasattr(report, "wasxfail")
    if type(report).__name__ == "SubtestReport":  # pytest 9's subtests: a failure sticks
        if report.failed:
            entry.update(outcome="failed", message="subtest: " + _message(report), sticky=True)
        return
    entry["duration"] = round(entry["duration"] + report.duration, 3)
    if entry.get("sticky"):  # a failed subtest decided the outcome
        if report.when == "teardown":
            _write()
        return
    if report.when == "setup":
        if report.failed:
            entry.update(outcome="error", message=_message(report))
        elif report.skipped:
            entry.update(outcome="xfailed" if wasxfail else "skipped", message=_message(report))
    elif report.when == "call":
        if report.passed:
            entry["outcome"] = "xpassed" if wasxfail else "passed"
        elif report.skipped:
            entry.update(outcome="xfailed" if wasxfail else "skipped", message=_message(report))
        else:
            message = _message(report)
            timed_out = "Timeout (>" in message
            entry.update(outcome="timeout" if timed_out else "failed", message=message)
    elif report.when == "teardown":
        if report.failed and entry["outcome"] in ("passed", None):
            entry.update(outcome="error", message="teardown: " + _message(report))
        _write()  # after every test: a run stopped by its wall limit keeps what it has


_state: dict[str, Any] = {}


def _results() -> dict[str, dict[str, Any]]:
    return _state.setdefault("results", {})


def pytest_sessionfinish(session: pytest.Session) -> None:
    _write()


def _write() -> None:
    if not OUT:
        return
    import celery

    import celery_idem

    payload = {
        "mode": MODE,
        "celery": celery.__version__,
        "celery_idem": os.path.dirname(celery_idem.__file__),
        "task_cls": TASK_CLS if MODE == "idem" else "celery.app.task:Task",
        "timeout": TIMEOUT,
        "reference": REFERENCE,
        "seconds": round(time.monotonic() - _state["started"], 1),
        "tests": dict(sorted(_results().items())),
    }
    tmp = OUT + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(payload, fh, indent=1, sort_keys=True)
        fh.write("\n")
    os.replace(tmp, OUT)
