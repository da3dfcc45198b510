"""Is a store error a configuration mistake or an outage? The worker-start probe and the run-time log.

An outage heals by itself, so the gate re-queues the message and waits. A wrong password, an
unknown user or a missing database never heals, yet would look exactly like an outage. So
:func:`probe_store` refuses to start a worker on such an error, :func:`log_store_down` logs it at
ERROR with the fix (an outage: WARNING), and :func:`misconfiguration` tells them apart.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator

from .exceptions import ImproperlyConfigured, StoreUnavailable
from .stores.base import Store

__all__ = ["REQUEUE_DELAY_CAP", "log_store_down", "misconfiguration", "probe_store",
           "requeue_delay", "unreachable"]

logger = logging.getLogger("celery_idem")

#: The longest delay (s) before a message re-queued for an unavailable store is delivered again;
#: it doubles from 1 s (docs/reliability.md, "When the store is down").
REQUEUE_DELAY_CAP = 30.0

AUTHENTICATION = "rejected the credentials (authentication failed)"
MISSING_DATABASE = "has no such database"
PERMISSION = "refused a command this worker needs (permission denied)"

# What to fix, for the messages.
_FIX = {
    AUTHENTICATION: "its user name and password",
    MISSING_DATABASE: "its database name (or create the database)",
    PERMISSION: "the user's permissions (ACL) or the user it names"}

# redis-py's exception classes.
_REDIS_ERRORS = {"AuthenticationError": AUTHENTICATION, "NoPermissionError": PERMISSION}
# MySQL/MariaDB server error codes (access denied: to a database, for a user, by a plugin;
# unknown database), the first argument of PyMySQL's and mysqlclient's errors.
_MYSQL_CODES = {1044: AUTHENTICATION, 1045: AUTHENTICATION, 1698: AUTHENTICATION, 1049: MISSING_DATABASE}
# PostgreSQL's SQLSTATEs: invalid_password, invalid_authorization_specification, invalid_catalog_name.
_SQLSTATES = {"28P01": AUTHENTICATION, "28000": AUTHENTICATION, "3D000": MISSING_DATABASE}
# libpq gives a connection failure's reason only in the message (no SQLSTATE).
_MESSAGES = (
    (re.compile(r'database "[^"]*" does not exist'), MISSING_DATABASE),
    (re.compile(r"password authentication failed|no password supplied|"
                r'role "[^"]*" does not exist|authentication failed', re.I), AUTHENTICATION),
    (re.compile(r"unable to open database file"), MISSING_DATABASE),  # sqlite, a missing folder
    (re.compile(r"DB index is out of range|invalid DB index", re.I), MISSING_DATABASE),  # Redis
)


def _causes(exc: BaseException) -> Iterator[BaseException]:
    """``exc``, its causes and contexts, and the driver errors SQLAlchemy wraps (``orig``)."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        item = todo.pop()
        if item is None or id(item) in seen:
            continue
        seen.add(id(item))
        yield item
        orig = getattr(item, "orig", None)
        todo.extend([item.__cause__, item.__context__, orig if isinstance(orig, BaseException) else None])


def misconfiguration(exc: BaseException) -> str | None:
    """Why ``exc`` (a store error) is a configuration mistake no retry fixes (authentication,
    missing database, permission), or None."""
    for item in _causes(exc):
        kind = type(item)
        if kind.__module__.partition(".")[0] == "redis" and kind.__name__ in _REDIS_ERRORS:
            return _REDIS_ERRORS[kind.__name__]
        args = getattr(item, "args", ())
        if args and isinstance(args[0], int) and args[0] in _MYSQL_CODES:
            return _MYSQL_CODES[args[0]]
        state = getattr(item, "sqlstate", None) or getattr(item, "pgcode", None)
        if isinstance(state, str) and state in _SQLSTATES:
            return _SQLSTATES[state]
        if not isinstance(item, StoreUnavailable):  # our message quotes the driver's
            text = str(item)
            for pattern, reason in _MESSAGES:
                if pattern.search(text):
                    return reason
    return None


def _driver_message(exc: BaseException) -> str:
    """The first line of the innermost driver error behind ``exc`` (the server's own words)."""
    innermost = exc
    for item in _causes(exc):
        if not isinstance(item, StoreUnavailable):
            innermost = item
    lines = str(innermost).strip().splitlines()
    # Without its final period: the messages quoting it go on with their own sentence.
    return lines[0].rstrip(".") if lines else type(innermost).__name__


def probe_store(store: Store, setting: str) -> bool:
    """Ask ``store`` for its clock once, at worker start: True when it answered, False when it
    could not be reached (see :func:`unreachable`, which refuses a configuration mistake)."""
    try:
        store.now()
    except StoreUnavailable as exc:
        unreachable(exc, setting, str(getattr(store, "location", None) or repr(store)))
        return False
    return True


def unreachable(exc: StoreUnavailable, setting: str, where: str) -> None:
    """At worker start: refuse a configuration mistake with ``ImproperlyConfigured`` naming
    ``setting`` and ``where`` (never with a password), or warn that the worker starts anyway."""
    reason = misconfiguration(exc)
    if reason is not None:
        raise ImproperlyConfigured(
            f"the idempotency store ({setting} = {where}) {reason}: {_driver_message(exc)}. Check "
            f"{_FIX[reason]} in {setting}; until then every task of this worker could only be "
            f"re-queued") from exc
    logger.warning(
        "celery_idem could not reach the idempotency store (%s) at worker start: %s. The "
        "worker starts; its tasks are re-queued until the store answers", setting, exc)


def requeue_delay(requeues: int) -> float:
    """Seconds before a message re-queued ``requeues`` times already is delivered again."""
    # The exponent is capped: 2.0 ** n overflows a float past 1023 re-queues.
    return min(2.0 ** min(max(requeues, 0), 16), REQUEUE_DELAY_CAP)


def log_store_down(task_name: str, task_id: str, key: str, exc: BaseException, requeues: int,
                   limit: int | None = None) -> None:
    """Log one re-queue for a store that could not be used: WARNING for an outage, with the
    delay; ERROR, with the cause and the fix, for an error no retry fixes."""
    delay = requeue_delay(requeues)
    reason = misconfiguration(exc)
    if reason is not None:
        logger.error(
            "celery_idem the idempotency store %s: %s (%s). Task %s[%s] key=%s re-queued in %g s "
            "(re-queue %d); it cannot run until %s is fixed",
            reason, _driver_message(exc), exc, task_name, task_id, key, delay, requeues + 1,
            _FIX[reason])
        return
    logger.warning(
        "celery_idem store unavailable: task %s[%s] key=%s re-queued in %g s (re-queue %d of %s; "
        "the delay doubles from 1 s up to %g s): %s",
        task_name, task_id, key, delay, requeues + 1, "no limit" if limit is None else limit,
        REQUEUE_DELAY_CAP, exc)
