"""Accelerations: faster paths beside each plain path, behind one switch.

Every store verb has one plain path, written against the public API of redis-py, kombu and
SQLAlchemy. The modules here replace a plain path with a faster one where it is known to be
equivalent, each at one named seam of its store:

==========================  ===================================  ==================================
module                      plain path (seam)                    accelerated path
==========================  ===================================  ==================================
:mod:`.redis_wire`          ``RedisStore._scripts``: redis-py's  ``EVALSHA``/``GET`` packed once
                            registered ``Script`` objects        and sent on a pooled connection
                            (``run(name, keys, args)``)          without redis-py's per-call layers
:mod:`.redis_enqueue`,      the enqueue check reads the record,  the record is checked by the
:mod:`.enqueue_check`       then publishes (two round trips)     script that pushes the message
                            (``task._enqueue_check``: None)      (one round trip), chosen per
                                                                 task on a running share; a
                                                                 copy of this process's own
                                                                 message in flight attaches
                                                                 with no round trip
:mod:`.redis_results`,      Celery's own result write: the task  the result written in the
:mod:`.db_results`,         returns, the tracer stores it        record's round trip (the
:mod:`.sql_taskmeta`        (``results.result_writer``: None)    stores' seam:
                                                                 ``Store.record_with``), or
                                                                 directly without the ``GET``
:mod:`.sql_psycopg`         ``SQLStore._session``: SQLAlchemy    PostgreSQL + psycopg 3: prepared
                            ``Connection.execute``               statements on the pooled psycopg
                                                                 connection itself
:mod:`.kombu_json`          ``KombuCodec.encode_result``:        one JSON encoder built once, while
                            ``kombu.serialization.dumps``        kombu's own ``"json"`` is registered
==========================  ===================================  ==================================

The switch (:func:`enabled`): on by default; off when the environment variable
``CELERY_IDEM_ACCELERATE`` is ``0``, ``false``, ``no`` or ``off`` (it wins), or when the app
setting ``idempotency_accelerate`` is False (the stores' ``accelerate`` option). With it off
each store behaves the same, through its plain path only (``make test-plain`` runs the fast
tier and the store contract that way), no result writer folds and the enqueue check reads
first. ``idempotency_fold_results = False`` turns the result fold alone off.

:mod:`.celery_compat` and :mod:`.json_encode` are not accelerations: they hold the private
names the core needs whatever the switch says (the pydantic argument dump the key is made of,
the key's JSON encoder, a result set's barrier, the worker's broker connection), each behind a
named function with its fallback. They
are **not switched**: the key of an action, a pickled ``CachedResult`` and a result set's wait
are the same with accelerations on and off.

Other libraries' private names used here
----------------------------------------

Nothing outside this package reaches into another library's private names
(``tests/unit/test_private_names.py``; Django's documented ``Model._meta`` aside).
:data:`PRIVATE_NAMES` lists the ones used here, with the versions checked (celery 5.4.0,
5.5.3, 5.6.3, 5.7.0; kombu of the same minors; redis-py 5.x-8.2.0 as those kombus resolve
it; SQLAlchemy 2.1.9; psycopg 3.3.9) and what happens when one is missing: the acceleration
steps aside and the plain path runs (for :mod:`.celery_compat`'s, each entry says what it
does instead).
"""

from __future__ import annotations

import os
from typing import NamedTuple

__all__ = ["ENV", "PRIVATE_NAMES", "PrivateName", "enabled"]

#: The environment variable that turns every acceleration off (``0``/``false``/``no``/``off``).
ENV = "CELERY_IDEM_ACCELERATE"
_OFF = frozenset({"0", "false", "no", "off"})


def enabled(setting: bool | None = None) -> bool:
    """Whether accelerations are on.

    Args:
        setting: The app's ``idempotency_accelerate`` (a store's ``accelerate`` option), or
            None when not set.

    Returns:
        False when ``CELERY_IDEM_ACCELERATE`` says off (it wins over the setting); else the
        setting when given; else True.
    """
    if os.environ.get(ENV, "").strip().lower() in _OFF:
        return False
    if setting is not None:
        return bool(setting)
    return True


class PrivateName(NamedTuple):
    """One private name of another library used in this package."""

    library: str
    name: str
    where: str
    checked: str
    fallback: str


#: Every other library's private name used in ``celery_idem/accel/``.
PRIVATE_NAMES: tuple[PrivateName, ...] = (
    PrivateName("redis", "Connection._sock", "redis_wire._Lane.ready", "redis-py 5.0-8.2.0",
                "missing: the connection is reconnected before every command (correct, slower)"),
    PrivateName("redis", "Retry._retries", "redis_wire._retries", "redis-py 5.x (before 6)",
                "Retry.get_retries() from redis-py 6; neither: 1 retry assumed, so no wire"),
    PrivateName("kombu", "redis.Channel._put", "redis_enqueue.fuse (on the channel instance)",
                "kombu 5.4.0-5.7.0", "missing: no hook, the record is read before publishing"),
    PrivateName("kombu", "redis.Channel._q_for_pri", "redis_enqueue._put", "kombu 5.4.0-5.7.0",
                "checked by redis_enqueue._compatible: missing, the record is read first"),
    PrivateName("kombu", "redis.Channel._get_message_priority", "redis_enqueue._put",
                "kombu 5.4.0-5.7.0", "as _q_for_pri"),
    PrivateName("kombu", "redis.Channel._expires", "redis_enqueue._put", "kombu 5.7.0 (new)",
                "getattr default: before 5.7 no queue expires"),
    PrivateName("kombu", "_put(_publish_batch=...)", "redis_enqueue._put", "kombu 5.7.0 (new)",
                "kwargs.get: absent before 5.7"),
    PrivateName("kombu", "serialization.registry._encoders", "kombu_json.json_shortcut",
                "kombu 5.4.0-5.7.0", "missing or not kombu's own json entry: kombu's dumps"),
    PrivateName("celery", "RedisBackend._get_result_meta", "redis_results.RedisResultWriter.build",
                "celery 5.4.0-5.7.0", "missing: no writer, Celery writes the result (the plain path)"),
    PrivateName("celery", "RedisBackend._set_with_state", "redis_results.RedisResultWriter.write",
                "celery 5.4.0-5.7.0", "as _get_result_meta"),
    PrivateName("celery", "RedisBackend._MAX_STR_VALUE_SIZE", "redis_results.RedisResultWriter",
                "celery 5.4.0-5.7.0", "getattr default None: no size check before the fold (the "
                "backend's own limit is what is checked)"),
    PrivateName("celery", "DatabaseBackend._update_result", "db_results.DatabaseResultWriter.build",
                "celery 5.4.0-5.7.0", "missing: no writer, Celery writes the row (the plain path)"),
    PrivateName("celery", "celery._state", "enqueue_check._undo_for (task_join_will_block)",
                "celery 5.4.0-5.7.0", "ImportError: no undo for the Redis backend's subscription, "
                "so the record is read first (the plain path)"),
    PrivateName("celery", "Task._dump_pydantic_arguments", "celery_compat.dump_pydantic_arguments",
                "celery 5.7.0 (absent in 5.4.0-5.6.3)", "not switched (the key is made of the "
                "dumped arguments); missing: the arguments as given, as those Celerys send them"),
    PrivateName("vine", "barrier._value", "celery_compat.fire_full_barriers", "vine 5.1.0 (celery "
                "5.4.0-5.7.0)", "not switched (a result set's wait); missing: no barrier fired "
                "here, so join_native over cached results only may wait"),
    PrivateName("celery", "Task.request_stack", "celery_compat.push_fresh_request",
                "celery 5.4.0-5.7.0", "not switched (an errback's own request); no fallback: "
                "Task.push_request inherits the current request from 5.5"),
    PrivateName("celery", "AsyncResult._cache", "enqueue_check.EnqueueCheck.mine", "celery "
                "5.4.0-5.7.0", "getattr default None: a held result is never known finished, so "
                "for that second a copy of a done action attaches to it (an AttachedResult of the "
                "same outcome) instead of being answered as a CachedResult"),
    PrivateName("celery", "AsyncResult._maybe_set_cache (overridden)", "celery_compat.MetaHook",
                "celery 5.4.0-5.7.0", "not switched (a cached result in a result set); not called: "
                "the handle's value is known already, only a join_native barrier waits longer"),
    PrivateName("celery", "WorkController._conninfo", "celery_compat.worker_connection",
                "celery 5.4.0-5.7.0", "not switched (a warning's broker driver); missing: the "
                "app's connection_for_read(), the same driver"),
    PrivateName("sqlalchemy", "SQLCompiler._bind_processors", "sql_psycopg.RawStatement.compile",
                "SQLAlchemy 2.0, 2.1.9", "getattr default {}: values sent unprocessed (psycopg "
                "adapts bytes itself)"),
    PrivateName("sqlalchemy", "Pool._invalidate", "sql_psycopg.RawSession.execute",
                "SQLAlchemy 2.0, 2.1.9", "missing: only the failed connection is invalidated "
                "(the pool's older connections are found dead at their next use)"),
    PrivateName("python", "json.encoder.c_make_encoder", "json_encode.make_encode",
                "CPython 3.11.7", "not switched (it writes key text); missing, or not writing "
                "a probe as JSONEncoder does: JSONEncoder.encode, the same text"),
)
