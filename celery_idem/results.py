"""Celery's result write, made in fewer round trips when the result backend is Redis.

After a body, a plain Celery worker stores the result with two round trips (the Redis
backend first ``GET``\\ s the old meta so a late duplicate cannot overwrite a success, then
``SET``\\ s the meta and ``PUBLISH``\\ es it); an ``IdempotentTask`` adds its own record before
that. Two shortcuts, both with the meta built by the backend's own methods (``encode_result``,
``_get_result_meta``, ``encode``, ``get_key_for_task``), so it is byte for byte what Celery
would store:

* **Folded**: when the result backend and the idempotency store are the same Redis server and
  database (the default: the store is derived from ``result_backend``), the record script
  writes the backend's meta too. One round trip instead of three.
* **Direct**: otherwise (a PostgreSQL store, a Redis store elsewhere, a duplicate answered from
  its record), the task writes the meta with the backend's own ``set`` (``SET`` + ``PUBLISH``
  in one pipeline, the backend's retry policy) and skips the ``GET``. One round trip instead
  of two.

Either way the tracer's own write is then skipped (``request.ignore_result``, which Celery
checks in ``mark_as_done``). The ``GET`` is not needed: it keeps a late duplicate from
overwriting a success, and here only the holder whose fenced record was accepted writes, or a
duplicate that was answered with that same recorded result. When the direct write fails, Celery
writes the result itself as usual (its ``result_backend_always_retry`` included). Neither
shortcut is taken where Celery's own path is needed: eager runs, ignored results, callbacks,
chains and chords (Celery stores those after it has sent the next tasks, so the meta can list
them as children), or a backend class that overrides how results are stored.

Set ``idempotency_fold_results = False`` in the app's configuration to turn both off.

:func:`store_answer` is the producer's write: an enqueue answered from the record under a task
id someone chose (``task_id=``, a frozen signature, a chain's next step, a chord body) stores
the recorded outcome under that id, so whoever waits on it hears. Direct when it can be, else
the backend's ``store_result``.
"""

from __future__ import annotations

import logging
from typing import Any

from celery.states import SUCCESS
from kombu.utils.uuid import uuid
from vine import barrier  # type: ignore[import-untyped, unused-ignore]

try:  # Celery 5.7
    from celery.app.task import get_actual_ignore_result
except ImportError:  # pragma: no cover - older Celery
    try:  # Celery 5.6
        from celery.app.trace import get_actual_ignore_result
    except ImportError:  # Celery 5.4-5.5

        def get_actual_ignore_result(task: Any, req: Any) -> bool:
            """No result is stored when the task ignores results (the tracer does not publish
            one) or the request does (``mark_as_done`` skips the write)."""
            return bool(task.ignore_result or getattr(req, "ignore_result", False))

from .config import settings
from .stores.base import BackendWrite, Store

__all__ = ["ResultWriter", "answer_task_id", "fire_full_barriers", "result_writer", "store_answer"]

logger = logging.getLogger("celery_idem")

#: The backend methods between the tracer and the Redis write. A subclass that overrides one of
#: them stores results its own way, so its results are left to Celery.
_STORE_PATH = ("mark_as_done", "store_result", "_store_result", "_set_with_state", "set",
               "_get_result_meta", "encode_result", "get_key_for_task")


class ResultWriter:
    """Builds a task's result writes and makes the direct one.

    Attributes:
        folds: True when the store can write the meta in the record's round trip.
    """

    def __init__(self, task: Any, backend: Any, folds: bool) -> None:
        self._task = task
        self._backend = backend
        self.folds = folds
        self._expires = int(backend.expires or 0)
        self._limit = getattr(backend, "_MAX_STR_VALUE_SIZE", None)

    def build(self, request: Any, result: Any, state: str = SUCCESS) -> BackendWrite | None:
        """The backend's write of ``result`` for ``request``, or None: leave it to Celery.

        Args:
            request: The task's request (its ``id`` is the result's id).
            result: The value, or for ``FAILURE`` the exception.
            state: ``SUCCESS``, or ``FAILURE`` for a recorded terminal error.
        """
        if (
            request.is_eager or request.called_directly or not request.id
            or request.callbacks or request.chain or request.chord
            or get_actual_ignore_result(self._task, request)
        ):
            return None
        backend = self._backend
        meta = backend._get_result_meta(
            result=backend.encode_result(result, state), state=state, traceback=None,
            request=request,
        )
        meta["task_id"] = request.id
        value = backend.encode(meta)
        if self._limit is not None and isinstance(value, str) and len(value) > self._limit:
            return None  # the backend refuses it with its own error
        key = backend.get_key_for_task(request.id)
        return BackendWrite(key=key.decode() if isinstance(key, bytes) else key, value=value,
                            expires=self._expires)

    def write(self, write: BackendWrite, state: str = SUCCESS) -> bool:
        """Make ``write`` with the backend's own ``set`` (no ``GET`` first).

        Returns:
            True when it is written; False when it failed (logged at DEBUG) and Celery's own
            write should follow.
        """
        try:
            self._backend._set_with_state(write.key, write.value, state)
        except Exception as exc:  # Celery's own write follows, with its own retries and errors
            logger.debug("celery_idem direct result write of %s failed, left to Celery: %r",
                         write.key, exc)
            return False
        return True


def result_writer(task: Any, store: Store) -> ResultWriter | None:
    """``task``'s result writer for ``store``, or None when results are left to Celery.

    Args:
        task: The Celery task (its ``backend`` and ``app`` are read).
        store: The task's idempotency store.

    Returns:
        A :class:`ResultWriter` when the result backend is Celery's Redis backend (or a subclass
        that stores results the same way); its ``folds`` says whether ``store`` can write the
        result in the record's round trip. A
        :class:`~celery_idem.dbresults.DatabaseResultWriter` when it is Celery's database
        backend on ``store``'s PostgreSQL database (the row rides on the record's statement).
        None otherwise, or when ``idempotency_fold_results`` is False.
    """
    if not settings(task.app).fold_results:
        return None
    from .dbresults import database_result_writer  # it builds on this module

    database = database_result_writer(task, store)
    if database is not None:  # Celery's database backend on the store's PostgreSQL
        return database
    try:
        from celery.backends.redis import RedisBackend

        from .stores.redis import RedisStore, same_server
    except ImportError:  # no redis-py: the backend is not Redis
        return None
    backend = task.backend
    cls = type(backend)
    if not isinstance(backend, RedisBackend) or any(
        getattr(cls, name, None) is not getattr(RedisBackend, name) for name in _STORE_PATH
    ):
        return None
    # Exact types for the fold: a subclass (Sentinel's backend, a cluster store) may write
    # elsewhere than the store's script can reach.
    folds = (cls is RedisBackend and type(store) is RedisStore
             and same_server(backend.client, store.client))
    return ResultWriter(task, backend, folds)


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


def fire_full_barriers(waiters: list[Any]) -> None:
    """Fire each vine barrier in ``waiters`` that has counted all its results but not fired.

    A ``ResultSet`` waits on a ``vine.barrier`` over its results' ``then``. A ready result
    (an ``EagerResult``, so a ``CachedResult``) is counted while the barrier is built, before
    the barrier is finalized, and a barrier whose every result was counted then never fires
    by itself: ``join_native`` would wait forever. Celery's already-ready ``AsyncResult``
    gets it fired by being counted a second time when the result consumer hands its meta back;
    a second count also fires a barrier whose other results are still pending, and
    ``join_native`` then returns before them (``None`` in their place). So the barrier is
    fired only when it is full, and nothing is counted twice.

    Args:
        waiters: The callbacks a ready result was given through ``then``.
    """
    for waiter in waiters:
        if (
            isinstance(waiter, barrier) and waiter.finalized
            and not (waiter.ready or waiter.cancelled) and waiter._value >= waiter.size
        ):
            # What barrier.__call__ does when the last result comes in, minus the count.
            waiter.ready = True
            waiter.p(*waiter.args, **waiter.kwargs)
