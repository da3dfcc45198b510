"""Starts a relay (:mod:`celery_idem.contrib.relay`) in every worker whose app needs one.

Loaded with the core (entry point group ``celery_idem.observers``). At ``worker_ready`` the
worker's main process runs the relay in a daemon thread (a greenlet under the gevent or eventlet
pool, where a thread blocked on a socket would stall them all), when the app's store keeps
intents and one of its tasks enqueues them (``idempotency_intent``), unless
``idempotency_relay = False``. ``worker_shutdown`` stops it.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import threading
import weakref
from typing import Any

from celery import Celery
from celery.signals import worker_ready, worker_shutdown

from ..config import settings

__all__ = ["start_relay", "stop_relay", "wants_relay"]

logger = logging.getLogger("celery_idem")

_running: weakref.WeakKeyDictionary[Celery, threading.Event] = weakref.WeakKeyDictionary()


def wants_relay(app: Celery) -> bool:
    """Whether ``app`` needs a relay: on (``idempotency_relay``), a store that keeps intents,
    and a task that enqueues them."""
    # celery_idem.app loads this module while it loads: its names are read at the first call.
    from ..app import get_store
    from ..task import IdempotentTask

    if not settings(app).relay or not get_store(app).keeps_intents:
        return False
    for task in list(app.tasks.values()):
        if isinstance(task, IdempotentTask):
            with contextlib.suppress(Exception):  # a misconfigured task enqueues nothing
                if task.idempotency_config.intent:
                    return True
    return False


def _green(sender: Any, app: Celery) -> str:
    """``gevent`` or ``eventlet`` when the worker runs that pool, else ``""``."""
    controller = getattr(sender, "controller", sender)
    pool = getattr(controller, "pool_cls", None) or app.conf.worker_pool or ""
    name = pool if isinstance(pool, str) else f"{getattr(pool, '__module__', '')}.{pool!r}"
    return next((green for green in ("gevent", "eventlet") if green in name.lower()), "")


def start_relay(app: Celery, sender: Any = None) -> threading.Event | None:
    """Start ``app``'s relay in this process (once) if :func:`wants_relay`; its stop event.

    Args:
        app: The worker's app.
        sender: ``worker_ready``'s sender (the consumer), whose worker names the pool.
    """
    from ..app import get_store
    from .relay import Relay

    if app in _running:
        return _running[app]
    if not wants_relay(app):
        return None
    read = settings(app)
    stop = _running[app] = threading.Event()
    relay = Relay(app, get_store(app), relay_after=read.relay_after, interval=read.relay_interval)
    green = _green(sender, app)
    if green:  # gevent.spawn, eventlet.spawn
        importlib.import_module(green).spawn(relay.run_forever, stop)
    else:
        threading.Thread(target=relay.run_forever, args=(stop,), name="celery_idem-relay",
                         daemon=True).start()
    logger.info("celery_idem relay started (relay_after=%s s, interval=%s s%s)", read.relay_after,
                read.relay_interval, f", {green} pool" if green else "")
    return stop


def stop_relay(app: Celery) -> None:
    """Stop ``app``'s relay in this process (its current pass ends first)."""
    stop = _running.pop(app, None)
    if stop is not None:
        stop.set()


@worker_ready.connect(weak=False)  # type: ignore[untyped-decorator]
def _on_ready(sender: Any = None, **_: Any) -> None:
    try:
        if getattr(sender, "app", None) is not None:
            start_relay(sender.app, sender)
    except Exception:  # the relay is an add-on: a worker runs its tasks without it
        logger.exception("celery_idem could not start the relay")


@worker_shutdown.connect(weak=False)  # type: ignore[untyped-decorator]
def _on_shutdown(sender: Any = None, **_: Any) -> None:
    app = getattr(sender, "app", None)
    if app is not None:
        stop_relay(app)
