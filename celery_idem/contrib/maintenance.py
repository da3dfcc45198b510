"""Clean-up of expired records: a function, a beat-schedulable task, and ``celery idem purge``.

An expired record already counts as absent everywhere; deleting it only gives the space back.
Redis deletes expired keys by itself (``PEXPIRE``), so there is nothing to do there. The SQL
store keeps an expired row (and its token) until :meth:`SQLStore.purge_expired
<celery_idem.stores.sql.SQLStore.purge_expired>` deletes it; without a clean-up the table
grows by one row per action for ever.

Schedule it with Celery beat::

    from celery_idem.contrib.maintenance import register_purge_task

    register_purge_task(app, every=3600)   # adds the task and a beat_schedule entry

or run ``celery -A proj idem purge`` from cron. Each batch is one ``DELETE`` of at most
``batch`` rows (a range scan of the ``expires`` index), so a purge never holds many row locks
or a long transaction, and workers claiming keys meanwhile are not blocked by it.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from celery import Celery

__all__ = ["PURGE_TASK_NAME", "PurgeReport", "purge_expired", "register_purge_task"]

#: The name :func:`register_purge_task` gives the task (and its beat_schedule entry).
PURGE_TASK_NAME = "celery_idem.purge_expired"


@runtime_checkable
class _Purgeable(Protocol):
    def purge_expired(self, limit: int = 1000) -> int: ...


@dataclass(frozen=True)
class PurgeReport:
    """What one purge did.

    Attributes:
        deleted: Rows deleted.
        batches: ``DELETE`` statements run.
        seconds: Wall time.
        complete: True when the last batch came back short (no expired row was left), False when
            ``max_seconds`` stopped the purge first (run it again).
        supported: False when the store deletes expired records by itself (Redis, memory).
    """

    deleted: int
    batches: int
    seconds: float
    complete: bool
    supported: bool = True

    def as_dict(self) -> dict[str, Any]:
        """The report as JSON-ready values (the purge task's result, ``idem purge --json``)."""
        return {**dataclasses.asdict(self), "seconds": round(self.seconds, 3)}


def _check_limits(batch: Any, max_seconds: Any) -> None:
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch must be a positive integer, not {batch!r}")
    if max_seconds is not None and max_seconds < 0:
        raise ValueError(f"max_seconds must be >= 0 or None, not {max_seconds!r}")


def purge_expired(
    store: Any,
    *,
    batch: int = 1000,
    max_seconds: float | None = None,
    monotonic: Callable[[], float] = time.monotonic,
) -> PurgeReport:
    """Delete every expired record of ``store``'s prefix, ``batch`` rows per statement.

    Args:
        store: The store (:func:`celery_idem.app.get_store` gives an app's).
        batch: Rows per ``DELETE`` (a positive integer). Small batches keep each statement short.
        max_seconds: Stop after the batch that passes this much time (None: until done).
        monotonic: Injectable clock for tests.

    Returns:
        A :class:`PurgeReport`.

    Raises:
        ValueError: ``batch`` is not a positive integer, or ``max_seconds`` is negative.
        StoreUnavailable: The store could not be reached.
    """
    _check_limits(batch, max_seconds)
    started = monotonic()
    if not isinstance(store, _Purgeable):
        # Redis and memory drop expired records themselves: nothing is left to delete.
        return PurgeReport(0, 0, 0.0, complete=True, supported=False)
    deleted = batches = 0
    while True:
        n = store.purge_expired(limit=batch)
        deleted += n
        batches += 1
        if n < batch:
            return PurgeReport(deleted, batches, monotonic() - started, complete=True)
        if max_seconds is not None and monotonic() - started >= max_seconds:
            return PurgeReport(deleted, batches, monotonic() - started, complete=False)


def register_purge_task(
    app: Celery,
    *,
    every: float | None = 3600.0,
    batch: int = 1000,
    max_seconds: float | None = 60.0,
    queue: str | None = None,
) -> Any:
    """Register ``celery_idem.purge_expired`` on ``app``, and schedule it with beat.

    The task purges the app's own store (``idempotency_store``, else ``result_backend``) and
    returns the :class:`PurgeReport` as a dict. Running it on several workers at once is safe:
    each ``DELETE`` re-checks that the row is still expired, and a row deleted by another purge
    is skipped.

    Args:
        app: The Celery app.
        every: Seconds between runs in ``app.conf.beat_schedule`` (None: register the task but
            schedule nothing).
        batch: Rows per ``DELETE``.
        max_seconds: Time budget per run, so a backlog is worked off over several runs instead
            of holding a worker (None: no limit).
        queue: The queue beat sends it to (calls of your own route with ``task_routes``).

    Returns:
        The registered task.

    Raises:
        ValueError: ``every`` is not positive, or ``batch``/``max_seconds`` are invalid.
    """
    if every is not None and not every > 0:
        raise ValueError(f"every must be a positive number of seconds or None, not {every!r}")
    _check_limits(batch, max_seconds)

    def purge() -> dict[str, Any]:
        from ..app import get_store

        return purge_expired(get_store(app), batch=batch, max_seconds=max_seconds).as_dict()

    # shared=False: the task purges this app's store; it must not be copied onto other apps.
    task = app.task(name=PURGE_TASK_NAME, ignore_result=True, shared=False)(purge)
    if every is not None:
        entry: dict[str, Any] = {"task": PURGE_TASK_NAME, "schedule": float(every)}
        if queue is not None:
            entry["options"] = {"queue": queue}
        schedule = dict(app.conf.beat_schedule or {})
        schedule[PURGE_TASK_NAME] = entry
        app.conf.beat_schedule = schedule
    return task
