"""The paths an app's tasks take, each chosen once from the acceleration switch.

Where a faster way exists, its plain twin sits beside it in the module that owns the verb:

============================  ==============================  ==========================================
verb                          plain                           fast (accelerations on)
============================  ==============================  ==========================================
the enqueue check             :class:`.enqueue.ReadFirst`     :mod:`.enqueue_redis` (within the publish)
a task's result write         :class:`.results.ResultWriter`  :mod:`.results_redis`, :mod:`.results_db`
the Redis store's commands    ``stores.redis.Scripts``        :mod:`.stores.redis_wire`
the SQL store's statements    SQLAlchemy's connection         :mod:`.stores.sql.psycopg`, ``.taskmeta``
============================  ==============================  ==========================================

The switch is read once per app (:func:`celery_idem.config.settings`: the app setting
``idempotency_accelerate``, with ``CELERY_IDEM_ACCELERATE=0`` winning); the stores get it as
their ``accelerate`` option when the app builds them. With it off no fast module is imported.
What each fast path buys is in docs/benchmarks.md, "Accelerations".
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .config import settings
from .enqueue import ReadFirst

if TYPE_CHECKING:
    from .results import ResultWriter
    from .stores.base import Store

__all__ = ["enqueue_check", "result_writer"]

#: The module of the one store class the check within the publish works with.
_REDIS_STORE = "celery_idem.stores.redis"


def enqueue_check(task: Any, store: Store) -> ReadFirst:
    """``task``'s enqueue check (each task keeps its own running share of answered enqueues)."""
    # Only a Redis store can take the fast one: an install without redis-py has no other.
    if settings(task.app).accelerate and type(store).__module__ == _REDIS_STORE:
        from .enqueue_redis import WithinPublish

        return WithinPublish()
    return ReadFirst()


def result_writer(task: Any, store: Store) -> ResultWriter | None:
    """``task``'s result writer, or None: Celery writes its results (accelerations off,
    ``idempotency_fold_results`` False, or a backend no writer knows)."""
    read = settings(task.app)
    if not (read.accelerate and read.fold_results):
        return None
    # Celery's database backend on the store's PostgreSQL, else its Redis backend.
    from .results_db import database_result_writer

    database = database_result_writer(task, store)
    if database is not None:
        return database
    from .results_redis import redis_result_writer

    return redis_result_writer(task, store)
