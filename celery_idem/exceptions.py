"""Exceptions raised by celery_idem.

Every exception derives from one root, so ``except IdempotencyError`` catches them all::

    IdempotencyError
    ├── TerminalError            (raise it from a task body: recorded, never retried)
    │   └── IdempotencyKeyMismatch
    ├── LeaseLost
    ├── StoreUnavailable
    ├── CorruptRecord
    └── ImproperlyConfigured     (also a celery.exceptions.ImproperlyConfigured)

Each class calls ``super().__init__(message)`` so that ``str()`` and pickling work when Celery
stores the exception in its result backend.
"""

from __future__ import annotations

from celery.exceptions import ImproperlyConfigured as _CeleryImproperlyConfigured

__all__ = [
    "CorruptRecord",
    "IdempotencyError",
    "IdempotencyKeyMismatch",
    "ImproperlyConfigured",
    "LeaseLost",
    "StoreUnavailable",
    "TerminalError",
]


class IdempotencyError(Exception):
    """Raised for any celery_idem error; the root of the tree above."""


class TerminalError(IdempotencyError):
    """Raised by a task body for an outcome that must never be retried (card declined, ...).

    The gate records it as the action's outcome: every later duplicate re-raises the same type
    and message without running the body.
    """


class IdempotencyKeyMismatch(TerminalError):
    """Raised when a key is reused with a different payload (``idempotency_validate=True``)."""

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key

    def __reduce__(self) -> tuple[type, tuple[str, str | None]]:
        return (type(self), (str(self), self.key))


class LeaseLost(IdempotencyError):
    """Raised when a fenced write (record, release, renew) finds that another holder took over.

    The holder's lease expired (crash, pause, partition) and a newer claim with a higher token
    exists; the stale holder must not overwrite it.
    """

    def __init__(self, message: str, key: str | None = None, token: int | None = None) -> None:
        super().__init__(message)
        self.key = key
        self.token = token

    def __reduce__(self) -> tuple[type, tuple[str, str | None, int | None]]:
        return (type(self), (str(self), self.key, self.token))


class StoreUnavailable(IdempotencyError):
    """Raised when the idempotency store cannot be reached or did not answer in time.

    The gate never runs a body unguarded: at claim time this means the body does not run and
    the message is re-queued.
    """


class CorruptRecord(IdempotencyError):
    """Raised when a record in the store cannot be read (written by another program, damaged)."""

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key

    def __reduce__(self) -> tuple[type, tuple[str, str | None]]:
        return (type(self), (str(self), self.key))


class ImproperlyConfigured(IdempotencyError, _CeleryImproperlyConfigured):  # type: ignore[misc]
    """Raised when a task or app is configured in a way celery_idem cannot honour."""
