"""Lease heartbeat: renew every held claim at a third of its lease while its body runs.

One daemon thread per process serves every claim held in it, so holding a claim costs a heap
push, not a thread start; a body shorter than a third of the lease causes no renewal at all.
"""

from __future__ import annotations

import contextvars
import heapq
import itertools
import logging
import os
import threading
import time
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

from .exceptions import LeaseLost, StoreUnavailable
from .stores.base import Fence, Store

__all__ = ["Lease", "LeaseKeeper", "current_lease", "keeper"]

logger = logging.getLogger("celery_idem")

_LOST_LOCK = threading.Lock()


@dataclass(eq=False)
class Lease:
    """One held claim.

    Attributes:
        store: Where the claim lives.
        key: The claimed key.
        fence: The holder's token and claim id, passed to each renewal.
        duration: Lease length in seconds.
        lost: Set when a renewal found that another holder took over (the body may check it
            through ``task.idempotency_lease_lost`` before a write it cannot take back).
        done: Set when the holder is finished; the keeper drops it.
        renewals: How many renewals succeeded.
    """

    store: Store
    key: str
    fence: Fence
    duration: float
    done: bool = False
    renewals: int = 0
    # Made on first use: almost no lease is ever lost, and an Event costs CPU on every task.
    _lost: threading.Event | None = field(default=None, init=False, repr=False)

    @property
    def token(self) -> int:
        """The holder's fencing token."""
        return self.fence.token

    @property
    def lost(self) -> threading.Event:
        """Set when a renewal found that another holder took over."""
        event = self._lost
        if event is None:
            # The keeper's thread (set) and the body's thread (is_set) may both come here first.
            with _LOST_LOCK:
                event = self._lost
                if event is None:
                    event = self._lost = threading.Event()
        return event


#: The lease held by the body running in this context (thread), for ``idempotency_lease_lost``.
current_lease: contextvars.ContextVar[Lease | None] = contextvars.ContextVar("celery_idem_lease",
                                                                             default=None)


class LeaseKeeper:
    """Renews held leases from one background thread."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, Lease]] = []
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None
        self._wake_at = float("inf")

    def hold(self, store: Store, key: str, fence: Fence, duration: float) -> AbstractContextManager[Lease]:
        """Keep the lease of ``key`` alive until the ``with`` block ends."""
        return _Held(self, Lease(store, key, fence, duration))

    def _schedule(self, lease: Lease, due: float) -> None:
        with self._cond:
            heapq.heappush(self._heap, (due, next(self._seq), lease))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="celery-idem-lease", daemon=True)
                self._thread.start()
            elif due < self._wake_at:
                self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._heap or self._heap[0][2].done:
                    if self._heap:
                        heapq.heappop(self._heap)
                        continue
                    self._wake_at = float("inf")
                    self._cond.wait()
                due, _, lease = self._heap[0]
                delay = due - time.monotonic()
                if delay > 0:
                    self._wake_at = due
                    self._cond.wait(delay)
                    continue
                heapq.heappop(self._heap)
            self._renew(lease)

    def _renew(self, lease: Lease) -> None:
        try:
            lease.store.renew(lease.key, lease.token, lease.duration, claim_id=lease.fence.claim_id)
        except LeaseLost as exc:
            if lease.done:  # a renewal delayed past the holder's own record, which fenced it
                logger.debug("celery_idem late renewal refused key=%s token=%s: %s",
                             lease.key, lease.token, exc)
                return
            lease.lost.set()
            logger.error("celery_idem lease_lost key=%s token=%s: %s; another holder took over, this "
                         "attempt's record will be refused", lease.key, lease.token, exc)
            return
        except StoreUnavailable as exc:
            # Try again soon: the lease still has two thirds of its time left.
            logger.warning("celery_idem renew failed key=%s token=%s: %s", lease.key, lease.token, exc)
            if not lease.done:
                self._schedule(lease, time.monotonic() + max(lease.duration / 10, 0.05))
            return
        except Exception:  # a bug must not kill the heartbeat of every other claim
            logger.exception("celery_idem renew crashed key=%s", lease.key)
        lease.renewals += 1
        if not lease.done:
            self._schedule(lease, time.monotonic() + lease.duration / 3)


class _Held:
    """The context of one :meth:`LeaseKeeper.hold` (a class: cheaper than a generator's, per task)."""

    __slots__ = ("_keeper", "_lease", "_reset")

    def __init__(self, keeper: LeaseKeeper, lease: Lease) -> None:
        self._keeper, self._lease = keeper, lease

    def __enter__(self) -> Lease:
        lease = self._lease
        self._keeper._schedule(lease, time.monotonic() + lease.duration / 3)
        self._reset = current_lease.set(lease)
        return lease

    def __exit__(self, *exc_info: object) -> None:
        self._lease.done = True  # dropped lazily when it comes up: no lock on the way out
        current_lease.reset(self._reset)


_keeper = LeaseKeeper()
_keeper_pid = os.getpid()


def keeper() -> LeaseKeeper:
    """The process's keeper (a new one after a fork: threads do not survive fork)."""
    global _keeper, _keeper_pid
    if _keeper_pid != os.getpid():
        _keeper, _keeper_pid = LeaseKeeper(), os.getpid()
    return _keeper
