"""Celery's and vine's private names the core needs, each behind a named function with its fallback.

Not accelerations: these decide what a call means, so they are **not switched** (the key of an
action, a pickled result, a result set's wait are the same with accelerations on and off). They
live here so that the core holds no other library's private name (issue 27), and each is listed
in :data:`celery_idem.accel.PRIVATE_NAMES` with the versions checked and its fallback.

* :func:`dump_pydantic_arguments`: a ``pydantic=True`` task's arguments as ``apply_async`` dumps
  them (Celery >= 5.7's ``Task._dump_pydantic_arguments``): the key is made of them.
* :func:`fire_full_barriers`: a ``ResultSet``'s vine barrier over ready results, fired once full
  (vine's ``barrier._value``, its count).
* :func:`worker_connection`: the broker connection of a worker's consumer (``Consumer._conninfo``),
  for a warning that names the broker's driver.
* :func:`get_actual_ignore_result`: whether Celery stores no result for a request (public from
  Celery 5.6; before, the same rule written out here).
* :func:`push_fresh_request`: push a request that inherits nothing (``Task.request_stack``:
  ``push_request`` inherits the current request from Celery 5.5).
* :class:`MetaHook`: a result handle told when the result consumer hands it its meta (Celery's
  ``AsyncResult._maybe_set_cache``, which the consumer calls): ``on_meta`` is the public seam.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

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

__all__ = ["MetaHook", "dump_pydantic_arguments", "fire_full_barriers",
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


def dump_pydantic_arguments(
    task: Any, args: Sequence[Any], kwargs: Mapping[str, Any]
) -> tuple[Sequence[Any], Mapping[str, Any]]:
    """``args`` and ``kwargs`` as Celery's ``apply_async`` sends them for a ``pydantic=True`` task.

    Celery >= 5.7 dumps pydantic models before sending (``Task._dump_pydantic_arguments``);
    before 5.7 there is no such method and the arguments are returned as they are (those
    Celerys send them as they are too). Not switched: the key is made of these arguments.
    """
    dump = getattr(task, "_dump_pydantic_arguments", None)  # Celery >= 5.7
    if dump is None:
        return args, kwargs
    dumped: tuple[Sequence[Any], Mapping[str, Any]] = dump(args, kwargs)
    return dumped


def fire_full_barriers(waiters: list[Any]) -> None:
    """Fire each vine barrier in ``waiters`` that has counted all its results but not fired.

    A ``ResultSet`` waits on a ``vine.barrier`` over its results' ``then``. A ready result
    (an ``EagerResult``, so a ``CachedResult``) is counted while the barrier is built, before
    the barrier is finalized, and a barrier whose every result was counted then never fires
    by itself: ``join_native`` would wait forever. Celery's already-ready ``AsyncResult``
    gets it fired by being counted a second time when the result consumer hands its meta back;
    a second count also fires a barrier whose other results are still pending, and
    ``join_native`` then returns before them (``None`` in their place). So the barrier is
    fired only when it is full, and nothing is counted twice. Without vine's count
    (``barrier._value``) no barrier is fired here.

    Args:
        waiters: The callbacks a ready result was given through ``then``.
    """
    for waiter in waiters:
        if (
            isinstance(waiter, barrier) and waiter.finalized
            and not (waiter.ready or waiter.cancelled)
            and getattr(waiter, "_value", -1) >= waiter.size
        ):
            # What barrier.__call__ does when the last result comes in, minus the count.
            waiter.ready = True
            waiter.p(*waiter.args, **waiter.kwargs)


def worker_connection(consumer: Any) -> Any:
    """The broker connection of a worker's consumer (``Consumer._conninfo``), or None."""
    return getattr(consumer, "_conninfo", None)
