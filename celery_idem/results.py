"""A task's result writer, and the producer's answer write.

:class:`ResultWriter` is the plain writer: it writes nothing, so Celery's tracer stores the
task's value. Its fast twins (:mod:`.results_redis`, :mod:`.results_db`) write the result in the
record's own round trip or without the backend's ``GET``; :mod:`celery_idem.paths` picks one.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from celery.states import FAILURE, SUCCESS

from .compat import get_actual_ignore_result
from .records import Record, State
from .stores.base import BackendWrite

if TYPE_CHECKING:
    from .codec import Codec

__all__ = ["ResultWriter", "recorded_outcome", "store_answer"]

logger = logging.getLogger("celery_idem")


class ResultWriter:
    """The plain result writer: builds nothing, so Celery's own write follows.

    Attributes:
        folds: True when the store writes the result in the record's round trip.
    """

    folds = False

    def __init__(self, task: Any) -> None:
        self._task = task

    def left_to_celery(self, request: Any) -> bool:
        """Whether Celery's own result path is needed for ``request``: a direct or eager call
        stores nothing; callbacks, a chain or a chord are published by Celery's tracer with the
        result; an ignored result is not written at all."""
        return bool(
            request.is_eager or request.called_directly or not request.id
            or request.callbacks or request.chain or request.chord
            or get_actual_ignore_result(self._task, request))

    def build(self, request: Any, result: Any, state: str = SUCCESS) -> BackendWrite | None:
        """The backend's write of ``result`` for ``request``, or None: leave it to Celery."""
        return None

    def write(self, write: BackendWrite, state: str = SUCCESS) -> bool:
        """Make ``write`` directly; False when Celery's own write should follow."""
        return False


def store_answer(task: Any, writer: ResultWriter | None, request: Any, value: Any, state: str) -> bool:
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
        logger.debug("celery_idem answer for %s not stored, the message is sent: %r", request.id, exc)
        return False
    return True


def recorded_outcome(codec: Codec, rec: Record) -> tuple[str, Any]:
    """A done or failed record's Celery state (``SUCCESS``, ``FAILURE``) and value (or error)."""
    content_type, data = rec.content_type or "", rec.data or b""
    if rec.state is State.FAILED:
        return FAILURE, codec.decode_error(rec.key, content_type, data)
    return SUCCESS, codec.decode_result(rec.key, content_type, data)
