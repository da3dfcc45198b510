"""Exceptions raised by celery_idem.

Every exception derives from one root, so ``except IdempotencyError`` catches them all::

    IdempotencyError
    ├── TerminalError            (raise it from a task body: recorded, never retried)
    │   └── IdempotencyKeyMismatch
    ├── LeaseLost
    ├── StoreUnavailable
    ├── CorruptRecord
    ├── InvalidKey               (also a ValueError: a key, scope or key header refused)
    └── ImproperlyConfigured     (also Celery's, once ``celery.exceptions`` is loaded)

Each class passes only its message to ``Exception.__init__`` and keeps the rest as attributes,
so ``str()`` is the message and pickling keeps type and attributes. No Celery is imported here.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

__all__ = ["CorruptRecord", "IdempotencyError", "IdempotencyKeyMismatch", "ImproperlyConfigured",
           "InvalidKey", "LeaseLost", "StoreUnavailable", "TerminalError"]


class IdempotencyError(Exception):
    """Raised for any celery_idem error; the root of the tree above."""


class TerminalError(IdempotencyError):
    """Raised by a task body for an outcome that must never be retried (card declined, ...):
    recorded as the action's outcome, every later duplicate re-raises it without running the body."""


class IdempotencyKeyMismatch(TerminalError):
    """Raised when a key is reused for another action: a per-call key (``idempotency_key=``)
    passed again with other identifying arguments (its record keeps their fingerprint), or a
    derived key with other arguments under ``idempotency_validate=True``. Use a new key for a new
    action."""

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


class InvalidKey(IdempotencyError, ValueError):
    """Raised for a per-call key, a scope or a message's key header that cannot be used (not a
    str, empty, too long, or with control or format characters); nothing is published, claimed or
    stored under it."""


class LeaseLost(IdempotencyError):
    """Raised when a fenced write (record, release, renew) finds that another holder took over
    (this holder's lease expired: crash, pause, partition); it must not overwrite the new one."""

    def __init__(self, message: str, key: str | None = None, token: int | None = None) -> None:
        super().__init__(message)
        self.key = key
        self.token = token


class StoreUnavailable(IdempotencyError):
    """Raised when the idempotency store cannot be reached or did not answer in time (at claim
    time the body does not run and the message is re-queued, never unguarded)."""


class CorruptRecord(IdempotencyError):
    """Raised when a record in the store cannot be read (written by another program, damaged)."""

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


class ImproperlyConfigured(IdempotencyError):
    """Raised when a task or app is configured in a way celery_idem cannot honour."""

    def __new__(cls, *args: Any, **kwargs: Any) -> ImproperlyConfigured:
        if cls is ImproperlyConfigured and "celery.exceptions" in sys.modules:
            cls = _with_celerys()
        return super().__new__(cls, *args, **kwargs)

    def __reduce__(self) -> tuple[Any, ...]:
        # By the public class: unpickled where Celery is loaded, it is Celery's too.
        return ImproperlyConfigured, self.args, self.__dict__ or None


@functools.cache
def _with_celerys() -> type[ImproperlyConfigured]:
    """The one subclass of :class:`ImproperlyConfigured` and Celery's ``ImproperlyConfigured``."""
    from celery.exceptions import ImproperlyConfigured as CeleryImproperlyConfigured

    # Both are plain Exception subclasses (no __slots__): the layouts agree.
    return type("ImproperlyConfigured", (ImproperlyConfigured, CeleryImproperlyConfigured),
                {"__module__": __name__, "__qualname__": "ImproperlyConfigured",
                 "__doc__": ImproperlyConfigured.__doc__})
