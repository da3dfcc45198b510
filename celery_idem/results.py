"""Celery's result write, folded into the record's round trip when both live on one Redis.

After a body, a plain Celery worker stores the result with two round trips (the Redis
backend first ``GET``\\ s the old meta so a late duplicate cannot overwrite a success, then
``SET``\\ s the meta and ``PUBLISH``\\ es it); an ``IdempotentTask`` adds its own record before
that. When the result backend and the idempotency store are the same Redis server and database
(the default: the store is derived from ``result_backend``), the record script writes the
backend's meta too, and the tracer's own write is skipped (``request.ignore_result``, which
Celery checks in ``mark_as_done``): one round trip instead of three.

The meta is built by the backend's own methods (``encode_result``, ``_get_result_meta``,
``encode``, ``get_key_for_task``), so it is byte for byte what Celery would store. The fence
that guards the record guards it too, which is what the backend's ``GET`` was for: only the
current holder of the key writes a result. Folded only when nothing else needs Celery's own
path: not eager, results not ignored, no callbacks, chain or chord (Celery stores those after
it has sent the next tasks, so the meta can list them as children).

Set ``idempotency_fold_results = False`` in the app's configuration to turn it off.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from celery.states import SUCCESS

from .stores.base import BackendWrite, Store

__all__ = ["result_writer"]

#: Connection settings that must be equal for the backend and the store to be one server,
#: one database, one user (a script runs with the store's connection's permissions).
_SAME_SERVER = ("host", "port", "db", "path", "username", "password")

Writer = Callable[[Any, Any], BackendWrite | None]


def result_writer(task: Any, store: Store) -> Writer | None:
    """A builder of ``task``'s result writes for ``store``, or None when they cannot be folded.

    Args:
        task: The Celery task (its ``backend`` and ``app`` are read).
        store: The task's idempotency store.

    Returns:
        ``writer(request, result) -> BackendWrite | None``; None from it means "leave this
        result to Celery".
    """
    if task.app.conf.get("idempotency_fold_results") is False:
        return None
    try:
        from celery.backends.redis import RedisBackend

        from .stores.redis import RedisStore
    except ImportError:  # no redis-py: neither side is Redis
        return None
    backend = task.backend
    # Exact types: a subclass (Sentinel's backend, a cluster store, a user's backend with its
    # own _set) may write elsewhere or otherwise.
    if type(backend) is not RedisBackend or type(store) is not RedisStore:
        return None
    if not _same_server(backend.client, store.client):
        return None

    from celery.app.task import get_actual_ignore_result

    expires = int(backend.expires or 0)
    limit = getattr(backend, "_MAX_STR_VALUE_SIZE", None)

    def writer(request: Any, result: Any) -> BackendWrite | None:
        if (
            request.is_eager or request.called_directly or not request.id
            or request.callbacks or request.chain or request.chord
            or get_actual_ignore_result(task, request)
        ):
            return None
        meta = backend._get_result_meta(
            result=backend.encode_result(result, SUCCESS), state=SUCCESS, traceback=None,
            request=request,
        )
        meta["task_id"] = request.id
        value = backend.encode(meta)
        if limit is not None and isinstance(value, str) and len(value) > limit:
            return None  # the backend refuses it with its own error
        key = backend.get_key_for_task(request.id)
        return BackendWrite(key=key.decode() if isinstance(key, bytes) else key, value=value,
                            expires=expires)

    return writer


def _same_server(backend_client: Any, store_client: Any) -> bool:
    b, s = backend_client.connection_pool, store_client.connection_pool
    if b.connection_class is not s.connection_class:  # TLS on one side only, say
        return False
    bk, sk = b.connection_kwargs, s.connection_kwargs
    return all(bk.get(name) == sk.get(name) for name in _SAME_SERVER)
