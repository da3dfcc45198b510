"""A task's result writer (the seam of the result fold), and the producer's answer write.

The plain path is Celery's own: the tracer stores the task's value. The result fold is an
acceleration (``accel/redis_results.py``, ``accel/db_results.py``): the result written in the
record's own round trip (``Store.record_with``), or directly without the backend's ``GET``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Protocol

from celery.states import FAILURE, SUCCESS

from .accel.celery_compat import get_actual_ignore_result
from .config import settings
from .records import Record, State
from .stores.base import BackendWrite, Store

if TYPE_CHECKING:
    from .codec import Codec

__all__ = ["ResultWriter", "recorded_outcome", "result_writer", "store_answer"]

logger = logging.getLogger("celery_idem")


class ResultWriter(Protocol):
    """What the result fold gives a task (the accelerations' writers are ones)."""

    #: True when the store can write the result in the record's round trip.
    folds: bool

    def build(self, request: Any, result: Any, state: str = SUCCESS) -> BackendWrite | None:
        """The backend's write of ``result`` for ``request``, or None: leave it to Celery."""

    def write(self, write: BackendWrite, state: str = SUCCESS) -> bool:
        """Make ``write`` directly; False when Celery's own write should follow."""


def result_writer(task: Any, store: Store) -> ResultWriter | None:
    """The seam of the result fold: ``task``'s writer for ``store``, or None (Celery writes):
    accelerations off, ``idempotency_fold_results`` False, or a backend the fold does not know."""
    read = settings(task.app)
    if not (read.accelerate and read.fold_results):
        return None
    from .accel.db_results import result_writer as accelerated

    return accelerated(task, store)


def store_answer(task: Any, writer: ResultWriter | None, request: Any, value: Any,
                 state: str) -> bool:
    """Store an outcome answered from the record under ``request.id``, as Celery stores results
    (through the writer when it can, else ``store_result``; nothing when the request ignores its
    result). False when the write failed (logged): the caller publishes the message instead."""
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


def recorded_outcome(codec: Codec, rec: Record) -> tuple[str, Any]:
    """A done or failed record's Celery state (``SUCCESS``, ``FAILURE``) and value (or error)."""
    content_type, data = rec.content_type or "", rec.data or b""
    if rec.state is State.FAILED:
        return FAILURE, codec.decode_error(rec.key, content_type, data)
    return SUCCESS, codec.decode_result(rec.key, content_type, data)
