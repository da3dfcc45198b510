"""Fencing for remotes: a holder paused past its lease cannot write after the takeover.

Real processes: two ``celery worker`` subprocesses (Redis broker, Redis store) and the example
payments provider (HTTP, SQLite). The holder is frozen with SIGSTOP, which stops its lease
renewer too, exactly like a long GC pause or a partition.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from celery_idem import LeaseLost
from example_app.payments import ProviderClient
from tests.fencing import tasks
from tests.integration.conftest import Cluster
from tests.integration.harness import Worker, wait_for

pytestmark = [pytest.mark.worker, pytest.mark.crash]

INCLUDE = ("-I", "tests.fencing.tasks")


def _claims(gates: Path, n: int) -> list[int] | None:
    """The tokens of the first ``n`` claims, once there are that many (else None)."""
    path = gates / "claims"
    lines = path.read_text().split() if path.exists() else []
    return [int(t) for t in lines] if len(lines) >= n else None


def _pause_holder_and_take_over(
    cluster: Cluster, gates: Path, order_id: str
) -> tuple[Worker, object, object, float, int, int]:
    """A claims (token t1) and is frozen before its write; B takes over (t2 > t1) and writes."""
    a = cluster.worker("a", concurrency=1, extra=INCLUDE)
    first = tasks.fenced_charge.delay(order_id, 4200, str(gates))
    [t1] = wait_for(lambda: _claims(gates, 1), timeout=40, what="A's claim")
    pid_a = int((gates / f"claimed-{t1}").read_text())
    os.kill(pid_a, signal.SIGSTOP)
    paused = time.monotonic()
    try:
        cluster.worker("b", concurrency=1, extra=INCLUDE)
        # A copy that reaches a worker (send_task: another producer, or a redelivery): an
        # apply_async here would attach to A's live claim at enqueue and publish nothing.
        second = tasks.app.send_task("fencing.charge", (order_id, 4200, str(gates)))
        _, t2 = wait_for(lambda: _claims(gates, 2), timeout=60, what="B's takeover after A's lease")
        assert t2 > t1  # the takeover's token is above the frozen holder's
        (gates / "go").write_text("")
        out = second.get(timeout=60)
        assert out["token"] == t2 and "charge" in out
    finally:
        os.kill(pid_a, signal.SIGCONT)
    return a, first, second, time.monotonic() - paused, t1, t2


def test_a_paused_holder_is_refused_by_the_remote_and_by_the_store(
    cluster: Cluster, provider: ProviderClient, tmp_path: Path
) -> None:
    cluster.env["FENCE_PROVIDER_URL"] = f"http://{provider.host}:{provider.port}"
    order_id = f"fence_{cluster.prefix.strip(':')}"
    # Given A paused past its 2 s lease and B, the new holder, has charged with token t2
    a, first, second, paused_for, t1, t2 = _pause_holder_and_take_over(cluster, tmp_path, order_id)
    # When A resumes and makes its write with token t1
    # Then the store refuses A's record (LeaseLost) ...
    with pytest.raises(LeaseLost):
        first.get(timeout=60)  # type: ignore[attr-defined]
    # ... because the provider had already refused A's write (409, fenced off)
    assert (tmp_path / f"fenced-{t1}").exists(), "A's write was not refused by the provider"
    assert f"'highest_seen': {t2}" in (tmp_path / f"fenced-{t1}").read_text()
    assert not (tmp_path / f"charged-{t1}").exists()
    # And the provider holds exactly one charge: B's
    charges = provider.charges_for(order_id)
    assert [c["id"] for c in charges] == [(tmp_path / f"charged-{t2}").read_text()]
    events = provider.ledger(prefix=order_id)["events"][order_id]["charges"]
    assert events == {"created": 1, "fenced off": 1}
    # And the store keeps B's record, token t2
    rec = cluster.store.get(tasks.fenced_charge.idempotency_key_for((order_id, 4200, str(tmp_path))))
    assert rec.state.value == "done" and rec.token == t2
    assert rec.task_id == second.id  # type: ignore[attr-defined]
    log = a.text()
    assert "celery_idem lease_lost" in log and "verb=record" in log
    print(f"\nfencing: A paused {paused_for:.1f} s; provider events {events}; 1 charge")


def test_without_token_support_the_paused_holder_writes_again(
    cluster: Cluster, provider: ProviderClient, tmp_path: Path
) -> None:
    """The limit: a remote that ignores the key and the token lets the stale holder's write in."""
    cluster.env["FENCE_PROVIDER_URL"] = f"http://{provider.host}:{provider.port}"
    order_id = f"nofence_{cluster.prefix.strip(':')}"
    provider.add_rule(order_id, "charges", keys=False)  # this order: no keys, no tokens
    _, first, _, _, t1, _ = _pause_holder_and_take_over(cluster, tmp_path, order_id)
    # A's write goes through: a second charge. The store still refuses A's record.
    with pytest.raises(LeaseLost):
        first.get(timeout=60)  # type: ignore[attr-defined]
    assert (tmp_path / f"charged-{t1}").exists() and not (tmp_path / f"fenced-{t1}").exists()
    assert len(provider.charges_for(order_id)) == 2
