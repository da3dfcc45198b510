"""Other libraries' private names, in one place: what the core needs whatever the switch says,
and :data:`PRIVATE_NAMES`, the inventory of every private name the package uses.

The functions here decide what a call means (a pickled result, a result set's wait), each
behind a named function with its fallback (the arguments a key is made of, as Celery sends them,
are :func:`celery_idem.identity.dump_pydantic_arguments`). ``tests/unit/test_private_names.py``
holds the package to the inventory: a private name is used only in the module its entry names.
When a name is missing, a fast path steps aside for its plain twin.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from celery.app.task import Context
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

__all__ = ["PRIVATE_NAMES", "MetaHook", "PrivateName", "fire_full_barriers",
           "get_actual_ignore_result", "push_fresh_request", "worker_connection"]


def push_fresh_request(task: Any, **fields: Any) -> None:
    """Push a request made of ``fields`` only; ``task.pop_request()`` pops it."""
    task.request_stack.push(Context(**fields))


class MetaHook:
    """Mix in before ``AsyncResult``: Celery's result consumer calls ``_maybe_set_cache(meta)``
    on a pending handle when its meta arrives; this hands it to :meth:`on_meta`."""

    def on_meta(self, meta: Any) -> Any:
        """Called with the meta the result consumer found; returns it (Celery's contract)."""
        return meta

    def _maybe_set_cache(self, meta: Any) -> Any:
        return self.on_meta(meta)


def fire_full_barriers(waiters: list[Any]) -> None:
    """Fire each vine barrier in ``waiters`` (a ready result's ``then`` callbacks) that has
    counted all its results but not fired.

    A ready result is counted while a ``ResultSet``'s barrier is built, before it is finalized,
    and a barrier whose every result was counted then never fires by itself: ``join_native``
    would wait forever. Counting again would fire a barrier whose other results are pending, so
    only a full one is fired, and nothing is counted twice (without ``barrier._value``, none).
    """
    for waiter in waiters:
        if isinstance(waiter, barrier) and waiter.finalized and not (waiter.ready or waiter.cancelled) \
                and getattr(waiter, "_value", -1) >= waiter.size:
            # What barrier.__call__ does when the last result comes in, minus the count.
            waiter.ready = True
            waiter.p(*waiter.args, **waiter.kwargs)


def worker_connection(consumer: Any) -> Any:
    """The broker connection of a worker's consumer (``Consumer._conninfo``), or None."""
    return getattr(consumer, "_conninfo", None)


class PrivateName(NamedTuple):
    """One private name of another library used in this package."""

    library: str
    name: str
    #: ``module path under celery_idem/:function`` that uses it.
    where: str
    checked: str
    fallback: str


#: Every other library's private name used in the package, by the module that uses it.
PRIVATE_NAMES: tuple[PrivateName, ...] = (
    PrivateName("redis", "Connection._sock", "stores/redis_wire.py:_Lane.ready", "redis-py 5.0-8.2.0",
                "missing: the connection is reconnected before every command (correct, slower)"),
    PrivateName("redis", "Retry._retries", "stores/redis_wire.py:_retries", "redis-py 5.x (before 6)",
                "Retry.get_retries() from redis-py 6; neither: 1 retry assumed, so no wire"),
    PrivateName("kombu", "redis.Channel._put", "enqueue_redis.py:fuse (on the channel instance)",
                "kombu 5.4.0-5.7.0", "missing: no hook, the record is read before publishing"),
    PrivateName("kombu", "redis.Channel._q_for_pri", "enqueue_redis.py:_put", "kombu 5.4.0-5.7.0",
                "checked by _modes: missing, the record is read first"),
    PrivateName("kombu", "redis.Channel._get_message_priority", "enqueue_redis.py:_put",
                "kombu 5.4.0-5.7.0", "as _q_for_pri"),
    PrivateName("kombu", "redis.Channel._expires", "enqueue_redis.py:_put", "kombu 5.7.0 (new)",
                "getattr default: before 5.7 no queue expires"),
    PrivateName("kombu", "_put(_publish_batch=...)", "enqueue_redis.py:_put", "kombu 5.7.0 (new)",
                "kwargs.get: absent before 5.7"),
    PrivateName("celery", "celery._state", "enqueue_redis.py:_undo_for (task_join_will_block)",
                "celery 5.4.0-5.7.0", "ImportError: no undo for the Redis backend's subscription, "
                "so the record is read first (the plain path)"),
    PrivateName("celery", "AsyncResult._cache", "enqueue_redis.py:InFlight.mine", "celery "
                "5.4.0-5.7.0", "getattr default None: a held result is never known finished, so "
                "for that second a copy of a done action attaches to it (an AttachedResult of the "
                "same outcome) instead of being answered as a CachedResult"),
    PrivateName("celery", "RedisBackend._get_result_meta", "results_redis.py:RedisResultWriter.build",
                "celery 5.4.0-5.7.0", "missing: no writer, Celery writes the result (the plain path)"),
    PrivateName("celery", "RedisBackend._set_with_state", "results_redis.py:RedisResultWriter.write",
                "celery 5.4.0-5.7.0", "as _get_result_meta"),
    PrivateName("celery", "RedisBackend._MAX_STR_VALUE_SIZE", "results_redis.py:RedisResultWriter",
                "celery 5.4.0-5.7.0", "getattr default None: no size check before the fold (the "
                "backend's own limit is what is checked)"),
    PrivateName("celery", "DatabaseBackend._update_result", "results_db.py:DatabaseResultWriter.build",
                "celery 5.4.0-5.7.0", "missing: no writer, Celery writes the row (the plain path)"),
    PrivateName("sqlalchemy", "Pool._invalidate", "stores/sql/psycopg.py:RawSession.run",
                "SQLAlchemy 2.0, 2.1.9", "missing: only the failed connection is invalidated "
                "(the pool's older connections are found dead at their next use)"),
    PrivateName("celery", "Task._dump_pydantic_arguments", "identity.py:dump_pydantic_arguments",
                "celery 5.7.0 (absent in 5.4.0-5.6.3)", "the key is made of the dumped "
                "arguments; missing: the arguments as given, as those Celerys send them"),
    PrivateName("vine", "barrier._value", "compat.py:fire_full_barriers", "vine 5.1.0 (celery "
                "5.4.0-5.7.0)", "a result set's wait; missing: no barrier fired here, so "
                "join_native over cached results only may wait"),
    PrivateName("celery", "Task.request_stack", "compat.py:push_fresh_request",
                "celery 5.4.0-5.7.0", "an errback's own request; no fallback: "
                "Task.push_request inherits the current request from 5.5"),
    PrivateName("celery", "AsyncResult._maybe_set_cache (overridden)", "compat.py:MetaHook",
                "celery 5.4.0-5.7.0", "a cached result in a result set; not called: the "
                "handle's value is known already, only a join_native barrier waits longer"),
    PrivateName("celery", "WorkController._conninfo", "compat.py:worker_connection",
                "celery 5.4.0-5.7.0", "a warning's broker driver; missing: the app's "
                "connection_for_read(), the same driver"))
