"""celery_idem.lease: the heartbeat that renews held claims from one thread per process.

Each test drives its own :class:`LeaseKeeper` over an in-process store (``MemoryStore``, whose
clock can be moved to expire a lease), with leases of a fraction of a second so that the
renewals at a third of the lease happen within the test; every wait polls with a deadline.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import pytest

from celery_idem import lease as lease_module
from celery_idem.exceptions import StoreUnavailable
from celery_idem.lease import Lease, LeaseKeeper, current_lease, keeper
from celery_idem.records import ClaimStatus
from celery_idem.stores.base import Fence
from celery_idem.stores.memory import MemoryStore
from tests.integration.harness import wait_for

# No Celery, kombu or redis-py code runs here: make test-compat runs it on its first Celery only.
pytestmark = pytest.mark.celery_independent

LEASE = 0.3  # renewed every 0.1 s


class Clock:
    """A store clock that follows real time, plus an offset a test can add to."""

    def __init__(self) -> None:
        import time

        self._time = time.time
        self.offset = 0.0

    def __call__(self) -> float:
        return self._time() + self.offset


class FlakyStore(MemoryStore):
    """A memory store whose ``renew`` raises ``errors`` (in order) before it works again."""

    def __init__(self, errors: list[BaseException]) -> None:
        super().__init__(prefix="unit:")
        self.errors = errors
        self.calls = 0

    def renew(self, key: str, token: int, lease: float, *, claim_id: str | None = None) -> float:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return super().renew(key, token, lease, claim_id=claim_id)


def _claim(store: MemoryStore, key: str = "k", task_id: str = "t-1") -> Any:
    got = store.claim(key, owner="h:1", task_id=task_id, attempt=0, lease=LEASE, ttl=60)
    assert got.status.holds, got
    return got


def _in_heap(keeper_: LeaseKeeper, lease: Lease) -> bool:
    with keeper_._cond:
        return any(entry[2] is lease for entry in keeper_._heap)


def test_a_held_claim_is_renewed_at_a_third_of_its_lease_until_the_block_ends() -> None:
    store = MemoryStore(prefix="unit:")
    got = _claim(store)
    first_expiry = store.get("k").lease_expires  # type: ignore[union-attr]
    keeper_ = LeaseKeeper()
    with keeper_.hold(store, "k", Fence(got.token, got.claim_id), LEASE) as lease:
        assert current_lease.get() is lease
        # Then the record's lease moves forward: it outlives its first expiry
        wait_for(lambda: lease.renewals >= 3, timeout=10, what="three renewals")
        assert store.get("k").lease_expires > first_expiry  # type: ignore[union-attr,operator]
        assert not lease.lost.is_set()
    assert current_lease.get() is None and lease.done
    # Once the block ends the lease leaves the heap, and nothing renews it any more
    wait_for(lambda: not _in_heap(keeper_, lease), timeout=10, what="the lease to be dropped")
    renewals = lease.renewals
    other = _claim(store, "k2")  # the keeper still serves other claims
    with keeper_.hold(store, "k2", Fence(other.token), LEASE) as second:
        wait_for(lambda: second.renewals >= 1, timeout=10, what="the second lease's renewal")
    assert lease.renewals == renewals


def test_a_body_shorter_than_a_third_of_the_lease_causes_no_renewal() -> None:
    store = FlakyStore([])
    got = _claim(store)
    with LeaseKeeper().hold(store, "k", Fence(got.token, got.claim_id), 60.0) as lease:
        pass
    assert store.calls == 0 and lease.renewals == 0


def test_a_takeover_sets_lost_and_logs_lease_lost(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    store = MemoryStore(prefix="unit:", clock=clock)
    got = _claim(store)
    keeper_ = LeaseKeeper()
    with keeper_.hold(store, "k", Fence(got.token, got.claim_id), LEASE) as lease:
        # Given another worker that took the key over once the lease ran out (a stalled holder)
        clock.offset = 10 * LEASE
        taken = store.claim("k", owner="h:2", task_id="t-2", attempt=0, lease=60, ttl=60)
        assert taken.status is ClaimStatus.TAKEOVER and taken.token > got.token
        # Then the holder's next renewal is refused: its lease is lost, and not renewed again
        wait_for(lease.lost.is_set, timeout=10, what="the lease to be lost")
    assert lease.renewals == 0
    wait_for(lambda: not _in_heap(keeper_, lease), timeout=10, what="the lost lease to be dropped")
    [line] = [r for r in caplog.records if "lease_lost" in r.getMessage()]
    assert line.levelno == logging.ERROR and f"token={got.token}" in line.getMessage()
    assert store.get("k").owner == "h:2"  # type: ignore[union-attr]


def test_a_store_outage_retries_the_renewal_sooner(caplog: pytest.LogCaptureFixture) -> None:
    store = FlakyStore([StoreUnavailable("down"), StoreUnavailable("down")])
    got = _claim(store)
    with LeaseKeeper().hold(store, "k", Fence(got.token, got.claim_id), 3.0) as lease:
        # The first renewal is due after 1 s; two failures retry 0.3 s apart, then it works
        wait_for(lambda: lease.renewals >= 1, timeout=10, what="a renewal after the outage")
        assert store.calls == 3 and not lease.lost.is_set()
    warnings = [r for r in caplog.records if "renew failed" in r.getMessage()]
    assert len(warnings) == 2 and all(r.levelno == logging.WARNING for r in warnings)


def test_a_crash_in_one_renewal_keeps_the_heartbeat(caplog: pytest.LogCaptureFixture) -> None:
    store = FlakyStore([RuntimeError("a bug in a store")])
    got = _claim(store)
    with LeaseKeeper().hold(store, "k", Fence(got.token, got.claim_id), LEASE) as lease:
        wait_for(lambda: store.calls >= 3, timeout=10, what="renewals after the crash")
    assert any("renew crashed" in r.getMessage() and r.exc_info for r in caplog.records)
    assert not lease.lost.is_set()


def test_lost_is_one_event_made_on_first_use() -> None:
    lease = Lease(MemoryStore(), "k", 1, LEASE)
    seen: list[threading.Event] = []
    threads = [threading.Thread(target=lambda: seen.append(lease.lost)) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(seen) == 8 and all(e is seen[0] for e in seen)


def test_the_process_keeper_is_replaced_after_a_fork(monkeypatch: pytest.MonkeyPatch) -> None:
    first = keeper()
    assert keeper() is first
    # A forked child has another pid, and no heartbeat thread: it gets a keeper of its own
    monkeypatch.setattr(lease_module, "_keeper_pid", -1)
    child = keeper()
    assert child is not first and keeper() is child
