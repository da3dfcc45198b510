"""What celery_idem keeps per Celery app and per process: the store, the owner, events, start checks."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn

from celery import Celery
from celery.signals import celeryd_after_setup, worker_init, worker_shutdown

from . import probe, timelimits
from .compat import worker_connection
from .config import forget_settings, settings
from .durability import check_replication, check_store
from .events import ANSWERS, EVENT_TYPE, Outcome, log_outcome, notify_observers
from .exceptions import ImproperlyConfigured, StoreUnavailable
from .plugins import OBSERVERS, registered
from .stores import store_from_url
from .stores.base import Store

if TYPE_CHECKING:
    from celery import Task

__all__ = ["check_pool", "check_worker", "emit_answer", "emit_decision", "events_enabled",
           "forget_store", "get_store", "owner_id", "release_held_logs"]

logger = logging.getLogger("celery_idem")

# The ``celery_idem.observers`` entry points (OpenTelemetry's) load with the core; each registers
# itself in ``celery_idem.events.OBSERVERS`` if its dependency is installed.
for _point in registered(OBSERVERS).values():
    try:
        _point.load()
    except Exception:  # another package's broken observer must not stop every task
        logger.exception("celery_idem could not load the observer %s (%s)", _point.name, _point.value)

_stores: weakref.WeakKeyDictionary[Celery, Store] = weakref.WeakKeyDictionary()
_events_on: weakref.WeakSet[Celery] = weakref.WeakSet()
_owner = f"{socket.gethostname()}:{os.getpid()}"


def get_store(app: Celery) -> Store:
    """The idempotency store of ``app`` (built once per app, from its settings).

    ``idempotency_store`` (a URL or a :class:`Store`) wins; else the ``result_backend`` URL. An
    always-eager app with no usable backend gets an in-process ``memory://`` store.

    Raises:
        ImproperlyConfigured: No supported store can be derived.
    """
    store = _stores.get(app)
    if store is None:
        conf = app.conf
        read = settings(app)
        configured = read.store
        if isinstance(configured, Store):
            store = configured
        else:
            url = configured or conf.result_backend
            if not url and conf.task_always_eager:
                url = "memory://"
            if not isinstance(url, str):
                url = getattr(url, "url", None) or repr(url)  # a backend class or instance
            # backend_transport_options: where Celery users put a sentinel master_name.
            store = store_from_url(
                url, prefix=read.key_prefix,
                options={**(read.store_options or {}), "accelerate": read.accelerate},
                backend_transport_options=conf.get("result_backend_transport_options"))
            # Ours to close when the app is collected (not a Store the user passed, nor Django's
            # connections); no store refers back to its app.
            if type(store).__module__.startswith("celery_idem.stores."):
                weakref.finalize(app, _close_quietly, store)
        _stores[app] = store
    return store


def _close_quietly(store: Store) -> None:
    with contextlib.suppress(Exception):  # at garbage collection or exit it could only be printed
        store.close()


def forget_store(app: Celery) -> Store | None:
    """Drop ``app``'s cached store (returned, not closed) and settings: :func:`get_store` builds anew."""
    forget_settings(app)
    return _stores.pop(app, None)


def owner_id() -> str:
    """Who runs an attempt, as stored in its claim: ``host:pid`` of the current process (a
    forked pool child's own)."""
    global _owner
    pid = os.getpid()
    if not _owner.endswith(f":{pid}"):  # forked worker child
        _owner = f"{socket.gethostname()}:{pid}"
    return _owner


def events_enabled(app: Celery) -> bool:
    """Whether this worker process sends ``task-idempotency`` events for ``app`` (switched on
    at worker start by ``-E``, ``worker_send_task_events`` or ``idempotency_events``)."""
    return app in _events_on


def emit_decision(task: Task, outcome: Outcome, key: str, token: int, original: str,
                  extra: dict[str, Any]) -> None:
    """Report one decision of ``task``'s gate: a log line, the observers, and a
    ``task-idempotency`` event when the worker sends events (never in eager or direct calls)."""
    req = task.request
    app = task.app
    log_outcome(outcome, key, token, original, req.id or "", extra,
                answers=outcome not in ANSWERS or settings(app).log_answers)
    notify_observers(task.name, outcome, key, token, original, task_span=True)
    if req.is_eager or req.called_directly or not events_enabled(app):
        return
    try:
        task.send_event(
            EVENT_TYPE, retry=False, idempotency_key=key, outcome=outcome.value,
            original_task_id=original, token=token, **extra)
    except Exception as exc:  # monitoring must never change the outcome
        logger.debug("celery_idem event not sent key=%s: %s", key, exc)


def emit_answer(task: Task, outcome: Outcome, key: str, token: int, original_task_id: str,
                result_id: str, record_state: str) -> None:
    """Report a decision ``apply_async`` made from a record or a reservation (``"reserved"``,
    token 0) as :func:`emit_decision` does, the event under the result's id when this process
    sends events (``idempotency_events``, ``task_send_sent_event``, a worker's ``-E``)."""
    app = task.app
    conf = app.conf
    extra = {"record_state": record_state, "at": "enqueue"}
    log_outcome(outcome, key, token, original_task_id, result_id, extra,
                answers=settings(app).log_answers)
    notify_observers(task.name, outcome, key, token, original_task_id, task_span=False)
    if not (settings(app).events or conf.task_send_sent_event
            or events_enabled(app)) or conf.task_always_eager:
        return
    try:
        with app.events.default_dispatcher() as dispatcher:
            dispatcher.send(
                EVENT_TYPE, uuid=result_id, name=task.name, idempotency_key=key,
                outcome=outcome.value, original_task_id=original_task_id, token=token, **extra)
    except Exception as exc:  # monitoring must never change the answer
        logger.debug("celery_idem event not sent key=%s: %s", key, exc)


# -- worker start ---------------------------------------------------------------------------------
# worker_init runs before Celery sets up logging (a line would miss a --logfile): what the checks
# log is held until celeryd_after_setup, or worker_shutdown if the worker stops first.

_Held = tuple[Callable[[logging.LogRecord], bool], list[logging.LogRecord], int]
_held: weakref.WeakKeyDictionary[Celery, _Held] = weakref.WeakKeyDictionary()


def _hold_logs(app: Celery) -> None:
    records: list[logging.LogRecord] = []

    def hold(record: logging.LogRecord) -> bool:  # a filter that keeps what it stops
        records.append(record)
        return False

    _held[app] = (hold, records, logger.level)
    logger.setLevel(logging.DEBUG)  # every level is kept: the release filters at Celery's level
    logger.addFilter(hold)


def release_held_logs(app: Celery) -> None:
    """Log what the worker-start checks of ``app`` held (only the first call logs anything)."""
    held = _held.pop(app, None)
    if held is None:
        return
    hold, records, level = held
    logger.removeFilter(hold)
    logger.setLevel(level)
    for record in records:
        if logger.isEnabledFor(record.levelno):
            logger.handle(record)


@celeryd_after_setup.connect(weak=False)  # type: ignore[untyped-decorator]
@worker_shutdown.connect(weak=False)  # type: ignore[untyped-decorator]
def _release(sender: Any = None, instance: Any = None, **_: Any) -> None:
    # The worker: celeryd_after_setup's instance (its sender is a host name), worker_shutdown's sender.
    app = getattr(sender if instance is None else instance, "app", None)
    if app is not None:
        release_held_logs(app)


def _broker_driver(sender: Any, app: Celery) -> str:
    conn = worker_connection(sender)
    try:
        if conn is None:
            conn = app.connection_for_read()
        return str(conn.transport.driver_type)
    except Exception:  # an unknown transport: no pool warning, nothing else depends on it
        return ""


def _pool_name(sender: Any) -> str:
    pool = getattr(sender, "pool_cls", None)
    if isinstance(pool, str):
        return pool.rpartition(":")[2].rpartition(".")[2].lower() or pool
    module = getattr(pool, "__module__", "") or ""
    return module.rpartition(".")[2] or repr(pool)


def check_pool(sender: Any, app: Celery) -> None:
    """Warn when this worker (no event loop, on a Redis broker) will not restore the unacked
    messages of a dead worker: kombu's periodic restore runs on the event loop."""
    if getattr(sender, "use_eventloop", True) or _broker_driver(sender, app) != "redis":
        return
    logger.warning(
        "celery_idem this worker (pool %s) does not restore unacked messages on a Redis broker: "
        "kombu's periodic restore (every unacked_restore_interval x unacked_restore_throttle, "
        "for messages older than visibility_timeout) runs only on a worker's event loop, which "
        "the %s pool does not use. A task whose worker dies mid-body (SIGKILL, OOM, a lost "
        "host) stays unacked until one of these restores it: a prefork, solo or threads worker "
        "consuming the same queue, the start of any worker on it, or a RabbitMQ broker (which "
        "redelivers at once). See docs/reliability.md, 'Recovery by pool'",
        _pool_name(sender), _pool_name(sender))


@worker_init.connect(weak=False)  # type: ignore[untyped-decorator]
def check_worker(sender: Any = None, **_: Any) -> None:
    """Celery's ``worker_init`` hook: switch events on, and check the store, pool and time limits.

    A misconfigured store or time limit stops the worker with ``SystemExit``, logged at CRITICAL
    (Celery swallows other exceptions of signal handlers, and the worker would consume messages
    it can only fail); what only degrades is warned about.
    """
    if (app := getattr(sender, "app", None)) is None:
        return
    try:
        settings(app)  # read first: an unknown idempotency_* setting stops the worker too
    except ImproperlyConfigured as exc:
        _stop(exc)
    if getattr(sender, "task_events", False) or settings(app).events \
            or app.conf.worker_send_task_events:
        _events_on.add(app)
    # The app's IdempotentTasks, known by their gate property (this module cannot import them).
    tasks = [task for task in app.tasks.values() if hasattr(type(task), "idempotency_gate")]
    if not tasks:
        return
    # Only a worker program sets Celery's logging up after this hook (not an embedded one).
    from celery.apps.worker import Worker  # loaded already when a worker program is the sender

    if isinstance(sender, Worker):
        _hold_logs(app)
    try:
        setting = "idempotency_store" if settings(app).store else "result_backend"  # for messages
        try:
            store = get_store(app)
        except StoreUnavailable as exc:  # a cluster client connects when it is built
            configured = settings(app).store or app.conf.get("result_backend")
            probe.unreachable(exc, setting, str(configured))
            return
        timelimits.check_worker(app, tasks, getattr(sender, "time_limit", None),
                                getattr(sender, "soft_time_limit", None))
        intent = [t.name for t in tasks if t.idempotency_config.intent]
        if intent and not store.keeps_intents:
            raise ImproperlyConfigured(
                f"{', '.join(sorted(intent))} keep intents (idempotency_intent=True) but the "
                f"store, {type(store).__name__}, keeps none: use a Redis (not Cluster), SQL or "
                f"Django store, or turn idempotency_intent off")
        check_pool(sender, app)
        if probe.probe_store(store, setting):
            check_store(store, require=settings(app).require_durable_store)
            check_replication(store)
    except ImproperlyConfigured as exc:
        release_held_logs(app)  # the reason comes after what was held
        _stop(exc)


def _stop(exc: ImproperlyConfigured) -> NoReturn:
    if logger.hasHandlers():  # else Python's last resort prints it, as SystemExit does
        logger.critical("celery_idem: %s", exc)
    raise SystemExit(f"celery_idem: the worker cannot start: {exc}") from exc
