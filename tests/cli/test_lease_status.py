"""What ``idem list`` and ``idem show`` say about an in-progress claim's holder.

The record does not keep why a claim is held. A running holder renews its lease every third of
``idempotency_lease``, so it always has two thirds of it left; a claim held after an error the
task does not classify is not renewed (nor is a dead or stalled holder's). The commands look up
the task's lease by the key's operation and say which it is, once a renewal is overdue.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from celery_idem.contrib import ops
from celery_idem.records import Record, State
from tests.cli import cli_app
from tests.cli.conftest import Idem
from tests.integration.conftest import Cluster
from tests.integration.harness import wait_for

pytestmark = pytest.mark.slow

APP = "tests.cli.cli_app"
NOT_RENEWED = "(held after an error, or its holder is gone or stalled)"


def _claim(lease_expires: float | None, state: State = State.IN_PROGRESS) -> Record:
    return Record(key="op:k", state=state, token=1, lease_expires=lease_expires)


@pytest.mark.parametrize(("remaining", "lease", "status"), [
    (59.0, 60.0, "live"),  # just claimed or renewed
    (35.0, 60.0, "live"),  # a renewal due at 40 s left, within the margin (6 s)
    (33.0, 60.0, "not_renewed"),  # past it: 27 s without a renewal
    (-1.0, 60.0, "expired"),
    (33.0, None, "unknown"),  # the task is not known: no verdict
    (4.5, 9.0, "live"),  # a short lease: the margin is at least 2 s (renewal due at 6 s left)
    (3.5, 9.0, "not_renewed"),
])
def test_lease_view_tells_a_renewing_holder_from_one_that_is_not(
    remaining: float, lease: float | None, status: str
) -> None:
    view = ops.lease_view(_claim(1000.0 + remaining), 1000.0, lease)
    assert view is not None and view.status == status
    assert view.remaining == pytest.approx(remaining)
    if status == "not_renewed":
        assert lease is not None and view.not_renewed_for == pytest.approx(lease - remaining)
    else:
        assert view.not_renewed_for is None


def test_a_claim_younger_than_a_renewal_period_is_never_overdue() -> None:
    # Taken 2 s ago with a 30 s lease, while the task now has 60 s: its first renewal is not due
    young = Record(key="op:k", state=State.IN_PROGRESS, token=1, lease_expires=1028.0,
                   updated=998.0)
    assert ops.lease_view(young, 1000.0, 60.0).status == "live"  # type: ignore[union-attr]
    # Taken 40 s ago and never renewed: overdue, for the time since the claim at most
    old = Record(key="op:k", state=State.IN_PROGRESS, token=1, lease_expires=1010.0,
                 updated=960.0)
    view = ops.lease_view(old, 1000.0, 60.0)
    assert view is not None and view.status == "not_renewed"
    assert view.not_renewed_for == pytest.approx(40.0)


def test_lease_view_is_none_for_an_outcome() -> None:
    assert ops.lease_view(_claim(None, State.DONE), 1000.0, 60.0) is None


def _lines(stdout: str) -> dict[str, str]:
    return {line[:13].strip(): line[13:] for line in stdout.splitlines()}


def _row(stdout: str, key: str) -> str:
    [row] = [line for line in stdout.splitlines() if line.endswith(key)]
    return row


def test_a_claim_of_a_known_task_reads_live_and_of_an_unknown_one_gets_no_verdict(
    idem_redis: Idem,
) -> None:
    # Given two claims just taken in the store: one under the operation of a task of the app
    # (its 600 s lease, so the claim reads live however long the commands take to start), one
    # under an operation no task has
    live_key = cli_app.long_lease.idempotency_key_for(("ord_live",))
    idem_redis.claim(live_key, lease=600, task_id="t-live")
    idem_redis.claim("no.such.task:k", lease=600, task_id="t-other")
    # When an operator lists them
    out = idem_redis.run("list", app=APP)
    assert out.returncode == 0, out.stderr
    # Then the task's claim reads live, and the other gets only the time left: no lease to
    # compare it with
    assert "live, on schedule, " in _row(out.stdout, live_key)
    assert "  lease " in _row(out.stdout, "no.such.task:k")
    assert "live" not in _row(out.stdout, "no.such.task:k")
    doc = {r["key"]: r for r in _json(idem_redis, "list")["records"]}
    assert doc[live_key]["lease_status"] == "live" and doc[live_key]["lease_seconds"] == 600
    assert doc["no.such.task:k"]["lease_status"] == "unknown"
    assert doc["no.such.task:k"]["lease_seconds"] is None


def _json(idem: Idem, *args: str) -> dict:  # type: ignore[type-arg]
    import json

    out = idem.run(*args, "--json", app=APP)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)  # type: ignore[no-any-return]


# -- a real worker ---------------------------------------------------------------------------


@pytest.mark.worker
def test_a_claim_held_after_an_unclassified_error_shows_as_not_renewed(
    make_cluster: Callable[..., Cluster],
) -> None:
    # Given a worker whose task committed its effect, then raised an error it does not classify
    cluster = make_cluster()
    worker = cluster.worker("held", concurrency=1, app=APP)
    result = cli_app.fails_unclassified.delay("ord_held")
    with pytest.raises(ValueError, match="nonsense"):
        result.get(timeout=30)
    key = cli_app.fails_unclassified.idempotency_key_for(("ord_held",))
    wait_for(lambda: "celery_idem held" in worker.text(), timeout=10, what="the held log line")
    assert "error=ValueError" in worker.text()  # where the error type is
    store = cluster.store
    rec = store.get(key)
    assert rec is not None and rec.state is State.IN_PROGRESS  # the claim is held
    # When its first renewal is overdue (a holder renews with two thirds of the lease left;
    # then the margin)
    lease = cli_app.HELD_LEASE
    overdue = lease * 2 / 3 - max(ops.RENEWAL_MARGIN_MIN, lease * ops.RENEWAL_MARGIN) - 0.5
    wait_for(lambda: store.get(key).lease_expires - store.now() < overdue,  # type: ignore[union-attr]
             timeout=lease, interval=0.1, what="the lease to fall below what a holder keeps")
    idem = Idem({**cluster.env}, store)
    listed = idem.run("list", "--state", "in_progress", app=APP)
    shown = idem.run("show", key, app=APP)
    # Then list and show say it is not renewed, with the time left until it runs out
    assert listed.returncode == 0 and shown.returncode == 0, listed.stderr + shown.stderr
    row = _row(listed.stdout, key)
    assert row.startswith("in_progress") and "not renewed for " in row and NOT_RENEWED in row
    assert "expires in " in row
    lines = _lines(shown.stdout)
    assert lines["lease"].startswith("not renewed for ") and NOT_RENEWED in lines["lease"]
    # and show names the error, from the task's FAILURE in the result backend (JSON only)
    assert lines["why"].startswith("held after ValueError") and result.id in lines["why"]
    assert cluster.effects("action:ord_held") == [result.id]


@pytest.mark.worker
def test_a_running_body_that_renews_its_lease_shows_as_live(
    make_cluster: Callable[..., Cluster],
) -> None:
    # Given a body running longer than its 9 s lease (renewed every 3 s)
    cluster = make_cluster()
    cluster.worker("live", concurrency=1, app=APP)
    result = cli_app.long_body.delay("ord_running", hold=60)
    key = cli_app.long_body.idempotency_key_for(("ord_running",))
    store = cluster.store
    first = wait_for(lambda: store.get(key), timeout=30, what="the claim").lease_expires
    # Past the lease it was claimed with: only its renewals keep it in progress
    wait_for(lambda: store.now() > first + 0.5, timeout=15, what="a whole lease to pass")
    try:
        # When an operator lists and shows it, a whole lease after the claim
        idem = Idem({**cluster.env}, store)
        listed = idem.run("list", "--state", "in_progress", app=APP)
        shown = idem.run("show", key, "--json", app=APP)
        text = idem.run("show", key, app=APP)
        # Then it is live, on its renewal schedule
        assert listed.returncode == 0, listed.stderr
        assert "live, on schedule, " in _row(listed.stdout, key)
        assert _lines(text.stdout)["lease"].startswith("live, on schedule, ")
        assert "why" not in _lines(text.stdout)
        import json

        doc = json.loads(shown.stdout)
        assert doc["lease_status"] == "live" and doc["lease_seconds"] == 9
        assert doc["not_renewed_for"] is None
    finally:
        cluster.set_flag("release:ord_running")
    assert result.get(timeout=30) == "ord_running"
    assert cluster.effects("action:ord_running") == [result.id]
