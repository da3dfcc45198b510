"""A task's result writer (the seam of the result fold), and the producer's answer write.

The plain path is Celery's own: the task returns its value and the tracer stores it (for Redis:
the backend's ``GET``, then ``SET`` + ``PUBLISH``). The result fold is an acceleration
(:mod:`celery_idem.accel.redis_results`, :mod:`celery_idem.accel.db_results`): the result
written in the record's own round trip (``Store.record_with``, the stores' seam), or directly
without the backend's ``GET``. :func:`result_writer` is the seam: a writer only with
accelerations on (:func:`celery_idem.accel.enabled`, ``idempotency_accelerate``) and
``idempotency_fold_results`` True (the default); None otherwise, and the task leaves its result
to Celery.

:func:`store_answer` is the producer's write: an enqueue answered from the record under a task
id someone chose (``task_id=``, a frozen signature, a chain's next step, a chord body) stores
the recorded outcome under that id, so whoever waits on it hears. Direct when a writer can,
else the backend's ``store_result`` (the plain path).
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

from celery.states import SUCCESS
from kombu.utils.uuid import uuid

from .accel.celery_compat import get_actual_ignore_result
from .config import settings
from .stores.base import BackendWrite, Store

__all__ = ["ResultWriter", "answer_task_id", "result_writer", "store_answer"]

logger = logging.getLogger("celery_idem")


class ResultWriter(Protocol):
    """What the result fold gives a task (the accelerations' writers are ones).

    Attributes:
        folds: True when the store can write the result in the record's round trip.
    """

    folds: bool

    def build(self, request: Any, result: Any, state: str = SUCCESS) -> BackendWrite | None:
        """The backend's write of ``result`` for ``request``, or None: leave it to Celery."""

    def write(self, write: BackendWrite, state: str = SUCCESS) -> bool:
        """Make ``write`` directly; False when Celery's own write should follow."""


def result_writer(task: Any, store: Store) -> ResultWriter | None:
    """The seam of the result fold: ``task``'s writer for ``store``, or None (Celery writes).

    Args:
        task: The Celery task (its ``app`` and ``backend`` are read).
        store: The task's idempotency store.

    Returns:
        None when accelerations are off or ``idempotency_fold_results`` is False, and when
        the backend is not one the fold knows; else the writer of
        :func:`celery_idem.accel.db_results.result_writer`.
    """
    read = settings(task.app)
    if not (read.accelerate and read.fold_results):
        return None
    from .accel.db_results import result_writer as accelerated

    return accelerated(task, store)


def store_answer(task: Any, writer: ResultWriter | None, request: Any, value: Any,
                 state: str) -> bool:
    """Store an outcome answered from the record under ``request.id``, as Celery stores results.

    One round trip on a Redis backend (the direct write: ``SET`` + ``PUBLISH``, without the
    backend's ``GET``: the value is the record's, the same for every writer); otherwise the
    backend's own ``store_result`` (Redis with the fold turned off: ``GET``, then ``SET`` +
    ``PUBLISH``; a database: one transaction). Nothing is written when the request ignores
    its result, as Celery writes nothing then.

    Args:
        task: The task (its ``backend`` stores the result).
        writer: The task's result writer, or None.
        request: A request context with the ``id`` to store under.
        value: The recorded value, or for ``FAILURE`` the recorded exception.
        state: ``SUCCESS`` or ``FAILURE``.

    Returns:
        True when the outcome is stored (or nothing needs storing); False when the write
        failed (logged at DEBUG), so the caller should publish the message instead.
    """
    if get_actual_ignore_result(task, request):
        return True
    try:
        write = writer.build(request, value, state) if writer is not None else None
    except Exception as exc:  # the backend's own write below raises it again, or copes
        logger.debug("celery_idem answer for %s not built: %r", request.id, exc)
        write = None
    if write is not None and writer is not None and writer.write(write, state):
        return True
    try:
        task.backend.store_result(request.id, value, state, request=request)
    except Exception as exc:
        logger.debug("celery_idem answer for %s not stored, the message is sent instead: %r",
                     request.id, exc)
        return False
    return True


def answer_task_id(chosen: str | None, original: str) -> str | None:
    """The task id an enqueue answered from the record hands back, or None: the original id.

    A chosen id (``task_id=``, a frozen signature, a chain step) is kept, and the outcome is
    stored under it. Without one, the original attempt's id is used: its own result is stored
    under it. A body that ran in a direct call (``task(...)`` in-process, or Celery's
    ``map``/``starmap`` calling it) has no task id and no stored result, so the answer gets a
    new id, as every enqueue does in Celery, and the outcome is stored under that id as for a
    chosen one: a ``ResultSet`` or anyone holding the id can then find it in the backend.

    Args:
        chosen: The task id the caller chose, or None.
        original: The record's task id ("" for a direct call).
    """
    if chosen or original:
        return chosen
    return str(uuid())

