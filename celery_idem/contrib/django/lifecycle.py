"""Django's connection lifecycle in Celery workers.

Django closes a request's connections when the request ends (``request_finished``); a worker
has no requests, so this module does the same around each task, as Celery's own Django fixup
does when ``DJANGO_SETTINGS_MODULE`` is set (doing it twice is harmless; a project that calls
``settings.configure()`` instead gets it only from here):

* ``task_prerun`` / ``task_postrun``: :func:`django.db.close_old_connections` in the thread
  that runs the task, so a connection the server dropped, or older than ``CONN_MAX_AGE``, is
  replaced before the claim and after the record;
* ``worker_process_init`` (a prefork child, just forked): every connection inherited from the
  parent is dropped *without* a word to the server (its socket is the parent's too: a
  ``close()`` would end the parent's session), so the child opens its own;
* ``os.register_at_fork``: the same for any other fork (billiard's, a body's ``os.fork``).

Threads that run no task (the lease renewal thread) are not covered by the task signals:
:class:`~celery_idem.contrib.django.store.DjangoStore` checks their connection before each verb
(:func:`in_task`).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from typing import Any

__all__ = ["close_at_thread_exit", "drop_inherited_connections", "in_task", "install_worker_signals",
           "is_psycopg3", "refresh_connection"]

_installed = False
_install_lock = threading.Lock()
_local = threading.local()


def in_task() -> bool:
    """True in a thread running a task between ``task_prerun`` and ``task_postrun``."""
    return bool(getattr(_local, "depth", 0))


def _on_prerun(sender: Any = None, task: Any = None, **_: Any) -> None:
    _local.depth = getattr(_local, "depth", 0) + 1
    _close_old_connections(task)


def _on_postrun(sender: Any = None, task: Any = None, **_: Any) -> None:
    _local.depth = max(0, getattr(_local, "depth", 0) - 1)
    _close_old_connections(task)


def _close_old_connections(task: Any) -> None:
    if getattr(getattr(task, "request", None), "is_eager", False):
        return  # an eager call runs inside the caller's request or transaction: leave it be
    from django.db import close_old_connections

    close_old_connections()


def drop_inherited_connections() -> None:
    """Forget every Django connection this process inherited from its parent, silently.

    Closes the socket's file descriptor (so the child cannot write to the parent's session)
    and then lets Django discard the wrapper; errors from the now-dead connection are ignored.
    """
    from django.db import connections

    for conn in connections.all(initialized_only=True):
        raw = conn.connection
        if raw is None:
            continue
        fileno = getattr(raw, "fileno", None)
        if callable(fileno):
            with contextlib.suppress(Exception):  # an fd that is already gone is what we want
                os.close(fileno())
        with contextlib.suppress(Exception):
            conn.close()  # the driver's goodbye fails on the closed fd: nothing reaches the server
        conn.connection = None
        # Not in the parent's transaction any more: a fresh connection starts in autocommit.
        conn.in_atomic_block = False
        conn.savepoint_ids = []
        conn.needs_rollback = False


def _on_process_init(**_: Any) -> None:
    drop_inherited_connections()


def _after_fork_in_child() -> None:
    # Only when Django is set up: a process that never touched Django has nothing to drop.
    try:
        from django.conf import settings

        if not settings.configured:
            return
        drop_inherited_connections()
    except Exception:  # a fork must never fail because of this hook
        pass


def install_worker_signals() -> None:
    """Connect the handlers above (once per process; later calls do nothing)."""
    global _installed
    with _install_lock:
        if _installed:
            return
        from celery import signals

        signals.task_prerun.connect(_on_prerun, weak=False)
        signals.task_postrun.connect(_on_postrun, weak=False)
        signals.worker_process_init.connect(_on_process_init, weak=False)
        os.register_at_fork(after_in_child=_after_fork_in_child)
        _installed = True


def refresh_connection(conn: Any) -> None:
    """Drop a connection that failed and does not answer, or that outlived ``CONN_MAX_AGE > 0``.

    What ``close_old_connections`` does at a request's start, minus its ``CONN_MAX_AGE = 0``
    rule ("one connection per request"): a thread outside any request or task (the lease
    renewal thread, a script) has no request to end, and a new connection per verb would cost
    a connect (and Django's session set-up) for every renewal. Such a thread keeps one
    connection, replaced when it breaks or, with a positive ``CONN_MAX_AGE``, when it is old.
    """
    if conn.connection is None:
        return
    if conn.errors_occurred:
        if conn.is_usable():
            conn.errors_occurred = False
        else:
            conn.close()
            return
    max_age = conn.settings_dict.get("CONN_MAX_AGE") or 0
    if max_age and conn.close_at is not None and time.monotonic() >= conn.close_at:
        conn.close()


def is_psycopg3(conn: Any) -> bool:
    """True when Django's PostgreSQL backend runs on psycopg 3 (server-side prepares work)."""
    try:
        from django.db.backends.postgresql.psycopg_any import is_psycopg3
    except ImportError:  # Django before 4.2 had psycopg2 only
        return False
    return bool(is_psycopg3)


class _Closer:
    """Held in a thread-local: closes the thread's connection when the thread ends.

    Django keeps one connection per thread and alias and never closes one whose thread ended
    without a request or task (a renewal thread, a thread pool's worker): the connection is
    only garbage-collected (psycopg then warns, ResourceWarning). A thread's locals are cleared
    when it exits, so this object's ``__del__`` runs then and closes the driver connection
    directly (DatabaseWrapper.close() checks the calling thread, which may differ here).
    """

    def __init__(self, conn: Any) -> None:
        self.conn = conn

    def __del__(self) -> None:
        raw = getattr(self.conn, "connection", None)
        if raw is not None:
            with contextlib.suppress(Exception):
                raw.close()


def close_at_thread_exit(conn: Any) -> None:
    """Close ``conn``'s driver connection when the current thread ends (not the main thread)."""
    if threading.current_thread() is threading.main_thread():
        return
    closers = getattr(_local, "closers", None)
    if closers is None:
        closers = _local.closers = {}
    if closers.get(conn.alias) is None or closers[conn.alias].conn is not conn:
        closers[conn.alias] = _Closer(conn)
