"""Celery's Redis result backend, its result written in fewer round trips: the fast twin of
:class:`celery_idem.results.ResultWriter` (Celery's own write).

A plain worker stores a result in two round trips (``GET`` of the old meta so a late duplicate
cannot overwrite a success, then ``SET`` + ``PUBLISH``). Here the meta is built by the
backend's own methods (byte for byte what Celery would store) and written:

* **folded**, when the backend and the store are the same Redis server and database: the record
  script writes it too (``Store.record_with``). One round trip instead of three;
* **directly** otherwise: the backend's own ``set``, without the ``GET``. One instead of two.

Either way the tracer's own write is skipped (``request.ignore_result``). The ``GET`` is not
needed: only the holder whose fenced record was accepted writes, or a duplicate answered with
that same result. A failed direct write is left to Celery. Eager runs, ignored results,
callbacks, chains, chords and backend classes that store results their own way keep Celery's
path.

What it buys (``python -m bench.accel``): about 30% of an ``IdempotentTask``'s time per task
against Celery writing the result itself (docs/benchmarks.md, "Each fast path alone").
"""

from __future__ import annotations

import logging
from typing import Any

from celery.states import SUCCESS

from .results import ResultWriter
from .stores.base import BackendWrite, Store

__all__ = ["RedisResultWriter", "redis_result_writer"]

logger = logging.getLogger("celery_idem")

#: The backend methods between the tracer and the Redis write: a subclass overriding one of
#: them stores results its own way (left to Celery).
_STORE_PATH = ("mark_as_done", "store_result", "_store_result", "_set_with_state", "set",
               "_get_result_meta", "encode_result", "get_key_for_task")
#: Celery's private names the writer calls (listed in celery_idem.compat.PRIVATE_NAMES).
_PRIVATE = ("_get_result_meta", "_set_with_state")


class RedisResultWriter(ResultWriter):
    """Builds a task's result writes (``folds``: the store can write the meta in the record's
    round trip) and makes the direct one."""

    def __init__(self, task: Any, backend: Any, folds: bool) -> None:
        super().__init__(task)
        self._backend = backend
        self.folds = folds
        self._expiry = int(backend.expires or 0)
        self._limit = getattr(backend, "_MAX_STR_VALUE_SIZE", None)

    def build(self, request: Any, result: Any, state: str = SUCCESS) -> BackendWrite | None:
        """The backend's write of ``result`` (the value, or for ``FAILURE`` the exception) for
        ``request``, or None: leave it to Celery."""
        if self.left_to_celery(request):
            return None
        backend = self._backend
        meta = backend._get_result_meta(
            result=backend.encode_result(result, state), state=state, traceback=None,
            request=request)
        meta["task_id"] = request.id
        value = backend.encode(meta)
        if self._limit is not None and isinstance(value, str) and len(value) > self._limit:
            return None  # the backend refuses it with its own error
        key = backend.get_key_for_task(request.id)
        return BackendWrite(key=key.decode() if isinstance(key, bytes) else key, value=value,
                            expires=self._expiry)

    def write(self, write: BackendWrite, state: str = SUCCESS) -> bool:
        """Make ``write`` with the backend's own ``set`` (no ``GET`` first); False when it failed
        (logged at DEBUG) and Celery's own write should follow."""
        try:
            self._backend._set_with_state(write.key, write.value, state)
        except Exception as exc:  # Celery's own write follows, with its own retries and errors
            logger.debug("celery_idem direct result write of %s failed, left to Celery: %r",
                         write.key, exc)
            return False
        return True


def redis_result_writer(task: Any, store: Store) -> RedisResultWriter | None:
    """``task``'s writer when its result backend is Celery's Redis backend (or a subclass that
    stores results the same way), else None; its ``folds`` says whether ``store`` can write the
    result in the record's round trip."""
    try:
        from celery.backends.redis import RedisBackend

        from .stores.redis import RedisStore, same_server
    except ImportError:  # no redis-py: the backend is not Redis
        return None
    backend = task.backend
    cls = type(backend)
    if not all(hasattr(RedisBackend, name) for name in _PRIVATE):
        return None  # a Celery without them: results are left to Celery (compat.PRIVATE_NAMES)
    if not isinstance(backend, RedisBackend) or any(
            getattr(cls, name, None) is not getattr(RedisBackend, name) for name in _STORE_PATH):
        return None
    # Exact types for the fold: a subclass (Sentinel, a cluster) may write out of the script's reach.
    folds = (cls is RedisBackend and type(store) is RedisStore
             and same_server(backend.client, store.client))
    return RedisResultWriter(task, backend, folds)
